"""scripts/setup.sh's choice of torch and Horovod build for CPU and CUDA machines, without a GPU.

The plan is a pure function of HVDKIT_CUDA and what nvidia-smi prints; `setup.sh --plan`
shows it and changes nothing. (Building Horovod with NCCL itself needs a GPU machine:
benchmarks/gpu_check.sh does it there.)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("setup_plan", ROOT / "scripts" / "setup_plan.py")
setup_plan = importlib.util.module_from_spec(_spec)
sys.modules["setup_plan"] = setup_plan  # dataclasses look their module up there
_spec.loader.exec_module(setup_plan)

H200 = ("| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: 12.8 |\n", "9.0\n")
MIXED_13 = ("Driver Version: 580.1   CUDA Version: 13.0\n", "8.0\n9.0\n9.0\n")


def test_no_gpu_keeps_the_cpu_build_and_its_cache_key():
    for choice, smi in (("auto", None), ("none", None), ("none", H200)):
        plan = setup_plan.make_plan(choice, smi, have_nvcc=False)
        assert (plan.cuda, plan.torch_pip_args, plan.horovod_env, plan.cache_suffix) == ("none", [], {}, "")
        assert plan.torch_spec == "torch==2.13.0"


def test_auto_on_a_gpu_machine_picks_the_drivers_cuda_and_the_gpus_arch():
    plan = setup_plan.make_plan("auto", H200, have_nvcc=True)
    assert plan.cuda == "12" and plan.gpu_archs == ["90"]
    assert plan.torch_pip_args == ["--index-url", "https://download.pytorch.org/whl/cu128"]
    assert plan.horovod_env == {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_BUILD_CUDA_CC_LIST": "90",
                                "HOROVOD_NCCL_LINK": "SHARED"}
    assert plan.extra_packages == [] and plan.cache_suffix == "-cu12-sm90"


def test_explicit_cuda_major_without_nvcc_brings_pips_compiler_and_covers_every_arch():
    plan = setup_plan.make_plan("13", MIXED_13, have_nvcc=False)
    assert plan.gpu_archs == ["80", "90"] and plan.cache_suffix == "-cu13-sm80+90"
    assert plan.extra_packages == ["nvidia-cuda-nvcc-cu13", "nvidia-cuda-runtime-cu13"]
    no_gpu_here = setup_plan.make_plan("12", None, have_nvcc=True)  # a build host without GPUs
    assert no_gpu_here.gpu_archs == ["80", "90"] and "no GPU visible" in no_gpu_here.reason
    mirror = setup_plan.make_plan("12", H200, True, torch_index="https://mirror.example/cu128")
    assert mirror.torch_pip_args == ["--index-url", "https://mirror.example/cu128"]


@pytest.mark.parametrize("choice,smi,words", [
    ("11", None, "HVDKIT_CUDA='11' is not one of auto, none, 12, 13"),
    ("auto", ("CUDA Version: 11.8\n", "7.0\n"), "CUDA 11, which hvdkit has no torch wheels for"),
    ("auto", ("garbage\n", ""), "CUDA unknown"),
])
def test_impossible_plans_are_one_line_errors(choice, smi, words):
    with pytest.raises(setup_plan.PlanError, match="HINT:") as info:
        setup_plan.make_plan(choice, smi, have_nvcc=False)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_shell_lines_round_trip_through_bash():
    plan = setup_plan.make_plan("auto", H200, have_nvcc=False)
    out = subprocess.run(["bash", "-c", f'{plan.shell()}\nprintf "%s|" "$PLAN_CUDA" "$PLAN_CACHE_SUFFIX" '
                          '"$PLAN_HOROVOD_ENV" "$PLAN_EXTRA_PACKAGES"'], capture_output=True, text=True,
                         check=True, timeout=30).stdout
    assert out == ("12|-cu12-sm90|HOROVOD_BUILD_CUDA_CC_LIST=90 HOROVOD_GPU_OPERATIONS=NCCL "
                   "HOROVOD_NCCL_LINK=SHARED|nvidia-cuda-nvcc-cu12 nvidia-cuda-runtime-cu12|")


@pytest.mark.timeout(60)  # measured 1 s (2 cores, loaded)
def test_setup_sh_plan_is_a_dry_run_that_reads_a_fake_nvidia_smi(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text(
        '#!/bin/sh\nif [ "$1" = --query-gpu=compute_cap ]; then echo 9.0; else echo "CUDA Version: 12.8"; fi\n')
    (fake / "nvidia-smi").chmod(0o755)
    venv = tmp_path / "venv-that-must-not-appear"
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "HVDKIT_VENV": str(venv),
           "HVDKIT_CUDA": "auto"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh"), "--plan"], env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 0, proc.stderr
    assert "cuda:          12 (auto: nvidia-smi shows a driver for CUDA 12, GPU(s) sm_90)" in proc.stdout
    assert "HOROVOD_GPU_OPERATIONS=NCCL" in proc.stdout and not venv.exists()
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env={**env, "HVDKIT_CUDA": "cuda"},
                         capture_output=True, text=True, timeout=50)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and not venv.exists()


def test_set_up_and_example_scripts_are_shellcheck_clean():
    assert shutil.which("shellcheck"), "shellcheck missing: run scripts/setup.sh"
    scripts = [ROOT / "scripts" / n for n in ("setup.sh", "patch_horovod.sh", "test.sh", "local-cluster.sh")]
    scripts += [ROOT / "benchmarks" / "gpu_check.sh", *(ROOT / "examples").glob("*.sbatch")]
    proc = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
