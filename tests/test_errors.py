"""Bad input ends in one clear line (and a hint), never a traceback or a hang."""

from __future__ import annotations

import subprocess

import pytest
from click.testing import CliRunner

from helpers import HVDKIT, base_env, free_port, launch
from hvdkit.cli import cli


def one_line_error(output: str, *needles: str) -> None:
    assert "Traceback" not in output, output
    lines = [ln for ln in output.splitlines() if ln.startswith("Error:")]
    assert lines, output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_unknown_backend_is_usage_error():
    result = CliRunner().invoke(cli, ["train", "--backend", "mxnet"])
    assert result.exit_code == 2
    assert "Invalid value for '--backend'" in result.output and "'horovod'" in result.output


def test_horovod_not_built_with_torch(tmp_path):
    # A horovod package whose torch extension is missing, exactly as Horovod reports it.
    fake = tmp_path / "horovod" / "torch"
    fake.mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("__version__ = '0.28.1'\n")
    (fake / "__init__.py").write_text(
        "raise ImportError('Extension horovod.torch has not been built: mpi_lib_v2 is missing. '\n"
        "                  'If this is not expected, reinstall Horovod with HOROVOD_WITH_PYTORCH=1')\n")
    env = base_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    proc = subprocess.run([*HVDKIT, "train", "--backend", "horovod"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 1
    one_line_error(proc.stderr, "horovod.torch cannot be imported", "has not been built",
                   "HINT: run ./scripts/setup.sh")


@pytest.mark.timeout(60)  # measured 1 s (2 cores, loaded)
def test_inconsistent_launcher_environment():
    env = base_env(RANK="3", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([*HVDKIT, "train", "--backend", "ddp"], env=env, text=True,
                          capture_output=True, timeout=60)
    assert proc.returncode == 1
    one_line_error(proc.stderr, "rank 3 is outside world size 2", "HINT:")


@pytest.mark.timeout(90)  # measured 2 s (2 cores, loaded)
def test_srun_without_mpi_plugin_is_detected_for_horovod():
    # srun started 2 tasks but Horovod's MPI sees a world of 1 (the classic
    # "every rank has size()==1" report): say so instead of training twice alone.
    env = base_env(SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="0", SLURM_NTASKS="2",
                   SLURM_LOCALID="0", SLURM_JOB_NODELIST="localhost")
    proc = subprocess.run([*HVDKIT, "train", "--backend", "horovod"], env=env, text=True,
                          capture_output=True, timeout=90)
    assert proc.returncode == 1
    one_line_error(proc.stderr, "slurm started 2 processes but Horovod sees a world of 1", "HINT:")


@pytest.mark.mp
@pytest.mark.timeout(120)  # measured 4 s (2 cores, loaded)
@pytest.mark.parametrize("kind,backend", [("mpirun", "ddp"), ("hvd-gloo", "horovod")])
def test_global_batch_that_does_not_divide(kind, backend):
    proc = launch(kind, 2, [*HVDKIT, "train", "--backend", backend, "--global-batch-size", "63",
                            "--exact-batch"], timeout=120)
    assert proc.returncode != 0
    # horovodrun itself prints a traceback of its own when a worker fails; the
    # workers' lines (prefixed "[rank]") must not hold one.
    worker_lines = [ln for ln in proc.stdout.splitlines()
                    if kind == "mpirun" or ln.startswith(("[0]", "[1]"))]
    assert not any("Traceback" in ln for ln in worker_lines), proc.stdout
    assert "global batch 63 does not divide over 2 ranks x 1 accumulation steps" in proc.stdout
    assert "HINT: use a multiple of 2" in proc.stdout


def test_dataset_smaller_than_batch():
    result = CliRunner().invoke(cli, ["train", "--num-samples", "8", "--batch-size", "16"])
    assert result.exit_code == 1
    assert "8 training samples are fewer than one global batch of 16" in result.output


def test_bad_config_file(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("epochs: [1, 2\n")
    result = CliRunner().invoke(cli, ["train", "--config", str(bad)])
    assert result.exit_code == 2 and "is not valid" in result.output
    bad.write_text("epochz: 3\n")
    result = CliRunner().invoke(cli, ["train", "--config", str(bad)])
    assert result.exit_code == 2 and "unknown key(s)" in result.output and "epochz" in result.output
