"""The wheel: templates and py.typed inside, and 'pip install hvdkit-*.whl' in a clean venv gives a
working 'hvdkit slurm' (no checkout, no editable install, no Horovod)."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)  # measured 21 s (2 cores, loaded)
def test_wheel_installs_in_a_clean_venv_and_renders_a_script(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(dist), str(ROOT)], check=True, capture_output=True, timeout=300)
    wheel = next(dist.glob("hvdkit-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for name in ("hvdkit/py.typed", "hvdkit/templates/_header.sbatch", "hvdkit/templates/ddp.sbatch",
                 "hvdkit/templates/horovod.sbatch", "hvdkit/templates/_mpirun.sbatch",
                 "hvdkit/templates/mpirun.sh", "hvdkit/templates/discover_hosts.sh"):
        assert name in names, name
    requires = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: horovod==0.28.1; extra == \"horovod\"" in requires
    assert "Requires-Dist: matplotlib>=3.7; extra == \"plots\"" in requires
    assert "Requires-Dist: torch<2.14,>=2.1" in requires

    env_dir = tmp_path / "clean"
    venv.EnvBuilder(with_pip=True).create(env_dir)  # no system site-packages, no checkout on the path
    py = env_dir / "bin" / "python"
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run([str(py), "-m", "pip", "install", "-q", str(wheel)], capture_output=True, text=True,
                             timeout=500, env=clean_env)
    assert install.returncode == 0, install.stderr[-3000:]
    out = tmp_path / "job.sbatch"
    proc = subprocess.run([str(env_dir / "bin" / "hvdkit"), "slurm", "--backend", "ddp", "-N", "2", "-o", str(out),
                           "--", "--model", "tiny"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=clean_env)
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in out.read_text() and "run_step srun" in out.read_text()
    where = subprocess.run([str(env_dir / "bin" / "hvdkit"), "slurm", "--print-template-dir"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path, env=clean_env).stdout.strip()
    assert where.startswith(str(env_dir)) and where.endswith("hvdkit/templates")


def test_hvdkit_train_stays_the_function_after_the_loop_module_is_imported():
    """``hvdkit.train`` is the function; a submodule of the same name replaced it on import
    (``hvdkit.param_digest`` first, as examples/custom_loop.py does, then ``hvdkit.train(cfg)``)."""
    code = ("import hvdkit, importlib; hvdkit.param_digest; importlib.import_module('hvdkit.loop'); "
            "print(callable(hvdkit.train), hvdkit.train.__module__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.split() == ["True", "hvdkit.loop"], proc.stderr
