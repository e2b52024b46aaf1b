"""Helpers shared by the tests that submit real jobs to the local Slurm cluster.

scripts/test.sh starts the cluster (scripts/local-cluster.sh up) before pytest and
stops it afterwards; these helpers only render, submit, poll and read results.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

from click.testing import CliRunner

from hvdkit.cli import cli

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "scripts" / "local-cluster.sh"
CLUSTER_STATE = Path("/run/hvdkit-cluster")
VENV = sys.prefix
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")


def cluster_mode() -> tuple[str, int]:
    """('multi'|'single'|'none', node count) of the local cluster scripts/local-cluster.sh made."""
    try:
        return (CLUSTER_STATE / "mode").read_text().strip(), int((CLUSTER_STATE / "nodes").read_text())
    except (OSError, ValueError):
        return "none", 0


def cluster(*args: str, timeout: float = 120) -> str:
    """Run ``scripts/local-cluster.sh ARGS`` and return its stdout (asserting success)."""
    proc = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"local-cluster.sh {' '.join(args)}: {proc.stderr}{proc.stdout}"
    return proc.stdout


def job_state(job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True,
                         timeout=30).stdout
    m = re.search(r"JobState=(\w+)", out)
    return m.group(1) if m else "UNKNOWN"


def wait_done(job: str, timeout: float = 240, kick_requeued: bool = False) -> str:
    """Poll until the job ends. ``kick_requeued`` waives Slurm's ~2 min requeue delay."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = job_state(job)
        if state in DONE_STATES:
            return state
        if kick_requeued and state == "PENDING":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                           capture_output=True, timeout=30)
        time.sleep(1)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} still {job_state(job)} after {timeout}s")


def wait_for_text(path: Path, text: str, job: str, timeout: float = 120) -> None:
    """Wait until ``text`` appears in ``path`` while ``job`` is still pending or running."""
    deadline = time.time() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        state = job_state(job)
        assert time.time() < deadline and state in ("PENDING", "RUNNING", "CONFIGURING"), \
            f"job {job} is {state} and never printed {text!r}:\n" + \
            (path.read_text()[-3000:] if path.exists() else "(no log)")
        time.sleep(0.2)


def render(tmp_path: Path, name: str, *args: str) -> Path:
    """``hvdkit slurm ... -o SCRIPT`` with a 10-minute limit and per-job logs; lints the script."""
    script = tmp_path / f"{name}.sh"
    result = CliRunner().invoke(cli, ["slurm", "--venv", VENV, "--time", "10:00", "-J", name,
                                      "--output", str(tmp_path / f"{name}-%j.out"), "-o", str(script),
                                      *args])
    assert result.exit_code == 0, result.output
    lint = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout
    return script


def sbatch(script: Path, cwd: Path, *options: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True,
                          text=True, cwd=cwd, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def final_loss(log: str) -> float:
    return float(re.search(r"final_loss=(\S+)", log).group(1))


def read_metrics(path: Path) -> dict:
    """The metrics JSON rank 0 wrote with --metrics-file (what tests read instead of logs)."""
    return json.loads(path.read_text())
