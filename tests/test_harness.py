"""The suite's own machinery: scripts/test.sh runs two pytest-xdist workers, and the tests that
share the machine's one Slurm cluster or start Ray must run one after another on one of them
(tests/conftest.py gives the groups). Checked in a small pytest session of its own, because a
group split by the scheduler passes silently: the shared tests then only sometimes collide."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SHARED = '''
import os, time, pytest

def log(name):
    time.sleep(0.2)  # both workers busy: a split group would show
    with open(os.path.join(os.environ["WHO_RAN"], name), "w") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"])

@pytest.mark.slurm
@pytest.mark.parametrize("i", range(3))
def test_slurm(i): log(f"machine-slurm{i}")

@pytest.mark.multinode
@pytest.mark.parametrize("i", range(3))
def test_multinode(i): log(f"machine-multinode{i}")

@pytest.mark.parametrize("i", range(3))
def test_plain(i): log(f"shared_module-plain{i}")

@pytest.mark.serial_group
@pytest.mark.parametrize("i", range(3))
def test_beside(i): log(f"machine-beside{i}")
'''

OTHER = '''
import pytest
from test_shared import log

pytestmark = [pytest.mark.ray]

@pytest.mark.parametrize("i", range(3))
def test_ray(i): log(f"machine-ray{i}")
'''

PLAIN = '''
import pytest
from test_shared import log

@pytest.mark.parametrize("i", range(6))
def test_cpu(i): log(f"plain_module-cpu{i}")
'''


@pytest.mark.timeout(120)  # measured 4 s
def test_the_shared_machine_tests_run_on_one_worker_and_each_module_on_one(tmp_path):
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    for name, text in (("test_shared.py", SHARED), ("test_other.py", OTHER), ("test_plain.py", PLAIN)):
        (tmp_path / name).write_text(text)
    (tmp_path / "who").mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "-o", "markers=slurm\nmultinode\nray\nserial_group", "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env={**os.environ, "WHO_RAN": str(tmp_path / "who")},
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    ran: dict[str, set[str]] = {}
    for f in (tmp_path / "who").iterdir():
        ran.setdefault(f.name.split("-")[0], set()).add(f.read_text())
    assert len(list((tmp_path / "who").iterdir())) == 21
    # the Slurm, multinode, Ray and serial_group tests of every module: one worker; the unmarked tests of a
    # module: one worker (its module fixtures run once), whichever
    assert {group: len(workers) for group, workers in ran.items()} == \
        {"machine": 1, "shared_module": 1, "plain_module": 1}, ran
