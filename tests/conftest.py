"""pytest hooks and fixtures; the shared helpers live in helpers.py."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import pytest

# Every run the suite starts (launchers, sbatch jobs, nodes) inherits this: no network advice
# from a bench result this machine may hold (hvdkit.advice), so outputs do not depend on it.
os.environ["HVDKIT_NETWORK_BENCH"] = ""

# What the machine has only one of: the local Slurm cluster (its two nodes, its queue, the
# nodes a test drains or kills) and Ray (its clusters' ports, ~/.ray). Tests marked so run one
# after another, in collection order, on one pytest-xdist worker; every other module is a group
# of its own, so its module-scoped fixtures run once. A test that shares an expensive module
# fixture with a machine test is marked serial_group, so that fixture runs once, not once per
# worker. Without xdist (-n 0) the groups are inert.
SHARED_MACHINE_MARKS = ("slurm", "multinode", "ray", "serial_group")


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into node ids
def pytest_collection_modifyitems(config, items):
    """Give each test its pytest-xdist group (scripts/test.sh runs ``--dist loadgroup``)."""
    for item in items:
        shared = any(item.get_closest_marker(mark) for mark in SHARED_MACHINE_MARKS)
        item.add_marker(pytest.mark.xdist_group("machine" if shared else item.nodeid.split("::")[0]))


# Where the suite's time goes, per xdist worker (filled on the controller only): the summary says
# how long each worker was busy and which modules weigh most, and HVDKIT_TEST_TIMELINE=FILE keeps
# every test phase's worker, node id (xdist appends "@group"), phase, start and stop as JSON.
_TIMELINE: list[dict] = []


def pytest_runtest_logreport(report):
    worker = getattr(getattr(report, "node", None), "gateway", None)
    if worker is not None and report.start:
        _TIMELINE.append({"worker": worker.id, "test": report.nodeid, "when": report.when,
                          "start": report.start, "stop": report.stop})


def _timeline_summary(terminalreporter) -> None:
    if not _TIMELINE:
        return
    span = max(r["stop"] for r in _TIMELINE) - min(r["start"] for r in _TIMELINE)
    busy: dict[str, float] = defaultdict(float)
    modules: dict[str, float] = defaultdict(float)
    for r in _TIMELINE:
        busy[r["worker"]] += r["stop"] - r["start"]
        modules[r["test"].split("::")[0]] += r["stop"] - r["start"]
    terminalreporter.write_line(f"tests ran {span / 60:.1f} min; busy per worker: " + ", ".join(
        f"{w} {t / 60:.1f} min" for w, t in sorted(busy.items())))
    heavy = sorted(modules.items(), key=lambda kv: -kv[1])[:10]
    terminalreporter.write_line("heaviest modules (min): " + ", ".join(f"{m.removeprefix('tests/')} {t / 60:.1f}"
                                                                        for m, t in heavy))
    if os.environ.get("HVDKIT_TEST_TIMELINE"):
        with open(os.environ["HVDKIT_TEST_TIMELINE"], "w") as f:
            json.dump({"written": time.time(), "reports": _TIMELINE}, f)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Where the time went (under xdist), and one loud line when the multi-node tests could not run
    (no namespaces on this machine)."""
    _timeline_summary(terminalreporter)
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = {str(r.longrepr[-1]) for r in skipped
               if isinstance(r.longrepr, tuple) and "multi-node tests skipped" in str(r.longrepr[-1])}
    for reason in sorted(reasons):
        terminalreporter.write_line(f"!!! {reason.removeprefix('Skipped: ')} !!!", red=True, bold=True)
