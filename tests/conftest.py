"""pytest hooks and fixtures; the shared helpers live in helpers.py."""

from __future__ import annotations

import os

import pytest

# Every run the suite starts (launchers, sbatch jobs, nodes) inherits this: no network advice
# from a bench result this machine may hold (hvdkit.advice), so outputs do not depend on it.
os.environ["HVDKIT_NETWORK_BENCH"] = ""

# What the machine has only one of: the local Slurm cluster (its two nodes, its queue, the
# nodes a test drains or kills) and Ray (its clusters' ports, ~/.ray). Tests marked so run one
# after another, in collection order, on one pytest-xdist worker; every other module is a group
# of its own, so its module-scoped fixtures run once. Without xdist (-n 0) the groups are inert.
SHARED_MACHINE_MARKS = ("slurm", "multinode", "ray")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Give each test its pytest-xdist group (scripts/test.sh runs ``--dist loadgroup``)."""
    for item in items:
        shared = any(item.get_closest_marker(mark) for mark in SHARED_MACHINE_MARKS)
        item.add_marker(pytest.mark.xdist_group("machine" if shared else item.nodeid.split("::")[0]))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One loud line when the multi-node tests could not run (no namespaces on this machine)."""
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = {str(r.longrepr[-1]) for r in skipped
               if isinstance(r.longrepr, tuple) and "multi-node tests skipped" in str(r.longrepr[-1])}
    for reason in sorted(reasons):
        terminalreporter.write_line(f"!!! {reason.removeprefix('Skipped: ')} !!!", red=True, bold=True)
