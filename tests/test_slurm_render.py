"""sbatch rendering: a pure function, golden files, hostile paths, shellcheck, validation."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from hvdkit.cli import cli
from hvdkit.errors import ConfigError
from hvdkit.launch.slurm import SlurmJob, parse_time, render_sbatch
from hvdkit.launch.templates import template_dir

GOLDEN = Path(__file__).parent / "golden"
HOSTILE = "/tmp/it's a \"dir\" with $HOME and `ls`\nand a newline"
PROG = ("python", "-m", "hvdkit", "train", "--backend")

JOBS = {
    "ddp_basic": SlurmJob(program=(*PROG, "ddp", "--model", "mlp"), backend="ddp", tasks_per_node=2,
                          venv="/opt/venv", time="00:30:00"),
    "horovod_gpu": SlurmJob(program=(*PROG, "horovod", "--epochs", "90"), nodes=4, tasks_per_node=8,
                            gpus_per_node=8, cpus_per_task=12, mem="480G", time="1-12:00:00",
                            partition="gpu", account="proj-42", qos="high", constraint="a100&ib",
                            modules=("cuda/12.4", "openmpi/4.1"), env=(("NCCL_DEBUG", "WARN"),),
                            extra_sbatch=("--exclusive",), checkpoint_dir="/scratch/ckpt"),
    "horovod_mpirun": SlurmJob(program=(*PROG, "horovod"), launcher="mpirun", tasks_per_node=2),
    "horovod_horovodrun": SlurmJob(program=(*PROG, "horovod"), launcher="horovodrun", tasks_per_node=2,
                                   signal_seconds=None, requeue=False),
    "horovod_elastic": SlurmJob(program=(*PROG, "horovod", "--checkpoint-dir", "ck"), launcher="horovodrun",
                                nodes=4, tasks_per_node=2, elastic_min_nodes=2),
    "ddp_array": SlurmJob(program=(*PROG, "ddp"), backend="ddp", tasks_per_node=2, array="0-2%2",
                          array_params="params.txt", results_dir="results", checkpoint_dir="ck"),
    "ray_gpu": SlurmJob(program=(*PROG, "horovod", "--no-requeue"), launcher="ray", nodes=2, tasks_per_node=4,
                        gpus_per_node=4, cpus_per_task=8, checkpoint_dir="/scratch/ckpt",
                        env=(("HVDKIT_IFACE", "ib0"), ("NCCL_SOCKET_IFNAME", "ib0"))),
    "ray_sweep": SlurmJob(program=("python", "-m", "hvdkit", "sweep", "run", "/data/space.yaml", "--engine", "ray",
                                   "--out", "/scratch/my sweep"), launcher="ray", nodes=2, tasks_per_node=4,
                          ray_sweep_dir="/scratch/my sweep"),
    "hostile": SlurmJob(program=(*PROG, "ddp", "--metrics-file", HOSTILE + "/m.json"), backend="ddp",
                        job_name="it's \"quoted\" $job", venv=HOSTILE, workdir=HOSTILE,
                        output="/tmp/it's a dir/%j.out", env=(("WEIRD", HOSTILE),),
                        checkpoint_dir=HOSTILE, results_dir=HOSTILE, conda_env="my env"),
}


@pytest.mark.parametrize("name", sorted(JOBS))
def test_golden(name):
    text = render_sbatch(JOBS[name])
    golden = GOLDEN / f"{name}.sbatch"
    if os.environ.get("HVDKIT_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"regenerate with HVDKIT_UPDATE_GOLDEN=1 and review {golden}"
    assert render_sbatch(JOBS[name]) == text  # pure: same input, same text


@pytest.mark.parametrize("name", sorted(JOBS))
def test_shellcheck_clean(tmp_path, name):
    assert shutil.which("shellcheck"), "shellcheck missing: run scripts/setup.sh"
    script = tmp_path / "job.sh"
    script.write_text(render_sbatch(JOBS[name]))
    proc = subprocess.run(["shellcheck", "-s", "bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_hostile_values_survive_bash_intact(tmp_path):
    """Run the hostile script's body with a fake srun: every value arrives byte for byte."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$ARGS_OUT"\n')
    (fake / "srun").chmod(0o755)
    (fake / "conda").write_text('#!/bin/bash\necho "true"\n')
    (fake / "conda").chmod(0o755)
    hostile_dir = Path(HOSTILE)
    (hostile_dir / "bin").mkdir(parents=True, exist_ok=True)
    (hostile_dir / "bin" / "activate").write_text("export ACTIVATED=yes\n")
    try:
        script = tmp_path / "job.sh"
        script.write_text(render_sbatch(JOBS["hostile"]))
        env = {"PATH": f"{fake}:/usr/bin:/bin", "SLURM_JOB_ID": "12", "SLURM_JOB_NAME": "x",
               "SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS": "1", "ARGS_OUT": str(tmp_path / "args")}
        proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        args = (tmp_path / "args").read_text().split("\0")[:-1]
        assert args[args.index("--metrics-file") + 1] == HOSTILE + "/m.json"
        assert args[args.index("--checkpoint-dir") + 1] == HOSTILE
        assert args[-1] == f"{HOSTILE}/x-12-0.json"
    finally:
        shutil.rmtree("/tmp/it's a \"dir\" with $HOME and `ls`", ignore_errors=True)


def test_every_option_is_rendered():
    text = render_sbatch(JOBS["horovod_gpu"])
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --cpus-per-task=12", "#SBATCH --mem=480G", "#SBATCH --time=1-12:00:00",
                 "#SBATCH --partition=gpu", "#SBATCH --account=proj-42", "#SBATCH --qos=high",
                 "#SBATCH --constraint='a100&ib'", "#SBATCH --signal=USR1@90", "#SBATCH --requeue",
                 "#SBATCH --open-mode=append", "#SBATCH --exclusive", "module load cuda/12.4",
                 "export NCCL_DEBUG=WARN", "--checkpoint-dir /scratch/ckpt", "srun --unbuffered",
                 "--mpi=pmix", "MASTER_PORT=$((15000 + SLURM_JOB_ID % 10000))"]:
        assert line in text, line
    arr = render_sbatch(JOBS["ddp_array"])
    assert "#SBATCH --array=0-2%2" in arr and "#SBATCH --output=%x-%A_%a.out" in arr
    assert "--mpi=none" in arr


@pytest.mark.parametrize("value,seconds", [("10", 600), ("10:30", 630), ("01:00:00", 3600),
                                           ("2-00", 172800), ("1-2:03", 93780), ("1-02:03:04", 93784)])
def test_parse_time(value, seconds):
    assert parse_time(value) == seconds


BAD = [
    (["--nodes", "0"], "Invalid value for '-N' / '--nodes'"),
    (["--time", "99:99"], "--time '99:99' is not a Slurm time limit"),
    (["--time", "1-25:00"], "is not a Slurm time limit"),
    (["--gpus-per-node", "4", "--tasks-per-node", "2"], "--tasks-per-node 2 differs from --gpus-per-node 4"),
    (["--backend", "ddp", "--gpus-per-node", "2", "--tasks-per-node", "2", "--process-group", "gloo"],
     "--process-group gloo leaves the GPUs' NCCL path unused"),
    (["--partition", "gpu queue"], "--partition 'gpu queue' is not a valid Slurm name"),
    (["--mem", "lots"], "--mem 'lots' is not a Slurm memory size"),
    (["--array", "1..3"], "is not a Slurm array spec"),
    (["--array-params", "p.txt"], "--array-params needs --array"),
    (["--env", "1BAD=x"], "environment name '1BAD' is invalid"),
    (["--env", "novalue"], "is not NAME=VALUE"),
    (["--sbatch", "exclusive"], "is not an option"),
    (["--output", "a\nb.out"], "--output contains a newline"),
    (["--backend", "ddp", "--launcher", "horovodrun"], "horovodrun cannot launch the ddp backend"),
]


@pytest.mark.parametrize("args,message", BAD, ids=[" ".join(a)[:40] for a, _ in BAD])
def test_bad_values_are_usage_errors_and_write_nothing(tmp_path, args, message):
    out = tmp_path / "job.sh"
    result = CliRunner().invoke(cli, ["slurm", *args, "-o", str(out)])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_config_file_and_cli_override(tmp_path):
    cfg = tmp_path / "job.toml"
    cfg.write_text('nodes = 2\ntasks-per-node = 4\npartition = "cpu"\nmodule = ["gcc/12"]\n')
    result = CliRunner().invoke(cli, ["slurm", "--config", str(cfg), "--partition", "debug", "--print-config"])
    assert result.exit_code == 0, result.output
    assert "nodes: 2" in result.output and "tasks_per_node: 4" in result.output
    assert "partition: debug" in result.output and "- gcc/12" in result.output
    yml = tmp_path / "job.yaml"
    yml.write_text("nodes: 3\nbackend: ddp\n")
    result = CliRunner().invoke(cli, ["slurm", "--config", str(yml)])
    assert "#SBATCH --nodes=3" in result.output and "--mpi=none" in result.output


def test_user_template_dir(tmp_path):
    src = Path(__file__).resolve().parents[1] / "slurm"
    mine = tmp_path / "mine"
    shutil.copytree(src, mine)
    (mine / "ddp.sbatch").write_text('{% include "_header.sbatch" %}\necho custom "${PROGRAM[@]}"\n')
    result = CliRunner().invoke(cli, ["slurm", "--backend", "ddp", "--template-dir", str(mine)])
    assert result.exit_code == 0 and 'echo custom "${PROGRAM[@]}"' in result.output
    with pytest.raises(ConfigError, match="has no _header.sbatch"):
        template_dir(tmp_path)
