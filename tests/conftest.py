"""pytest hooks and fixtures; the shared helpers live in helpers.py."""

from __future__ import annotations

import os

# Every run the suite starts (launchers, sbatch jobs, nodes) inherits this: no network advice
# from a bench result this machine may hold (hvdkit.advice), so outputs do not depend on it.
os.environ["HVDKIT_NETWORK_BENCH"] = ""


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One loud line when the multi-node tests could not run (no namespaces on this machine)."""
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = {str(r.longrepr[-1]) for r in skipped
               if isinstance(r.longrepr, tuple) and "multi-node tests skipped" in str(r.longrepr[-1])}
    for reason in sorted(reasons):
        terminalreporter.write_line(f"!!! {reason.removeprefix('Skipped: ')} !!!", red=True, bold=True)
