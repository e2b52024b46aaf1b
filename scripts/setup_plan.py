#!/usr/bin/env python3
"""What scripts/setup.sh installs and builds for this machine: CPU, or CUDA 12/13 with NCCL.

Standard library only (it runs before the venv exists). ``HVDKIT_CUDA`` chooses:

* ``none``  -- the CPU build of torch; Horovod with MPI + Gloo ops (the default where no GPU is seen)
* ``12``, ``13`` -- torch's CUDA 12/13 wheels; Horovod built with ``HOROVOD_GPU_OPERATIONS=NCCL``
  against the NCCL those wheels bring (``nvidia-nccl-cu*``), for the GPU architectures seen
* ``auto`` (default) -- ``nvidia-smi`` decides: none without it, else the driver's CUDA major

``python3 scripts/setup_plan.py`` prints the plan as ``KEY=value`` shell lines (setup.sh
evals them); ``--explain`` prints it for people (``scripts/setup.sh --plan`` shows it).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

TORCH_VERSION = "2.13.0"
# torch's wheel index per CUDA major; HVDKIT_TORCH_INDEX overrides (a site mirror, a newer minor).
TORCH_CUDA_INDEX = {
    "12": "https://download.pytorch.org/whl/cu128",
    "13": "https://download.pytorch.org/whl/cu130",
}
CHOICES = ("auto", "none", "12", "13")


class PlanError(ValueError):
    """HVDKIT_CUDA or the machine cannot give a consistent plan (one line, with a hint)."""


@dataclass
class Plan:
    """Everything setup.sh needs to choose: torch wheel, Horovod build, cache key."""

    cuda: str                        # "none", "12" or "13"
    reason: str                      # why this choice, for people
    torch_spec: str = f"torch=={TORCH_VERSION}"
    torch_pip_args: list[str] = field(default_factory=list)
    gpu_archs: list[str] = field(default_factory=list)   # compute capabilities, e.g. ["90"]
    horovod_env: dict[str, str] = field(default_factory=dict)
    extra_packages: list[str] = field(default_factory=list)  # pip's CUDA compiler where no nvcc
    cache_suffix: str = ""

    def shell(self) -> str:
        """KEY=value lines for ``eval`` in bash (every value quoted)."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.horovod_env.items()))
        lines = {
            "PLAN_CUDA": self.cuda, "PLAN_REASON": self.reason, "PLAN_TORCH_SPEC": self.torch_spec,
            "PLAN_TORCH_PIP_ARGS": " ".join(self.torch_pip_args), "PLAN_GPU_ARCHS": ",".join(self.gpu_archs),
            "PLAN_HOROVOD_ENV": env, "PLAN_EXTRA_PACKAGES": " ".join(self.extra_packages),
            "PLAN_CACHE_SUFFIX": self.cache_suffix,
        }
        return "\n".join(f"{k}={shlex.quote(v)}" for k, v in lines.items())

    def explain(self) -> str:
        """The plan in words, one item a line."""
        rows = [f"cuda:          {self.cuda} ({self.reason})",
                f"torch:         pip install {' '.join([*self.torch_pip_args, self.torch_spec])}",
                f"horovod ops:   {'NCCL (GPU) + MPI/Gloo' if self.cuda != 'none' else 'MPI + Gloo (CPU)'}"]
        if self.gpu_archs:
            rows.append(f"gpu archs:     {', '.join('sm_' + a for a in self.gpu_archs)}")
        if self.horovod_env:
            rows.append("horovod build: " + " ".join(f"{k}={v}" for k, v in sorted(self.horovod_env.items())))
        if self.extra_packages:
            rows.append(f"extra pip:     {' '.join(self.extra_packages)} (no system nvcc)")
        rows.append(f"wheel cache:   horovod-...{self.cache_suffix or ' (CPU key, unchanged)'}")
        return "\n".join(rows)


def parse_nvidia_smi(header: str, caps: str) -> tuple[str | None, list[str]]:
    """(driver's CUDA major, compute capabilities) from ``nvidia-smi`` and its compute_cap query."""
    m = re.search(r"CUDA Version:\s*(\d+)\.\d+", header)
    archs = sorted({c.strip().replace(".", "") for c in caps.splitlines() if re.fullmatch(r"\s*\d+\.\d+\s*", c)})
    return (m.group(1) if m else None), archs


def make_plan(choice: str, smi: tuple[str, str] | None, have_nvcc: bool,
              torch_index: str | None = None) -> Plan:
    """The plan for ``HVDKIT_CUDA=choice`` given ``nvidia-smi`` output (``None``: no nvidia-smi)."""
    if choice not in CHOICES:
        raise PlanError(f"HVDKIT_CUDA={choice!r} is not one of {', '.join(CHOICES)}; "
                        "HINT: use auto (detect), none (CPU) or the CUDA major, 12 or 13")
    driver, archs = parse_nvidia_smi(*smi) if smi else (None, [])
    if choice == "auto":
        if smi is None:
            return Plan("none", "auto: no nvidia-smi, so no NVIDIA GPU")
        if driver not in TORCH_CUDA_INDEX:
            raise PlanError(f"nvidia-smi reports CUDA {driver or 'unknown'}, which hvdkit has no torch "
                            "wheels for; HINT: set HVDKIT_CUDA=12 or 13 (or none for the CPU build)")
        choice, reason = driver, f"auto: nvidia-smi shows a driver for CUDA {driver}, GPU(s) sm_{'/'.join(archs)}"
    elif choice == "none":
        return Plan("none", "HVDKIT_CUDA=none")
    else:
        reason = f"HVDKIT_CUDA={choice}"
    if not archs:  # told CUDA without a GPU here (a build host): cover the data-centre GPUs
        archs = ["80", "90"]
        reason += "; no GPU visible, building for sm_80 and sm_90"
    env = {"HOROVOD_GPU_OPERATIONS": "NCCL", "HOROVOD_BUILD_CUDA_CC_LIST": ",".join(archs),
           "HOROVOD_NCCL_LINK": "SHARED"}
    extra = [] if have_nvcc else [f"nvidia-cuda-nvcc-cu{choice}", f"nvidia-cuda-runtime-cu{choice}"]
    return Plan(choice, reason, torch_pip_args=["--index-url", torch_index or TORCH_CUDA_INDEX[choice]],
                gpu_archs=archs, horovod_env=env, extra_packages=extra,
                cache_suffix=f"-cu{choice}-sm{'+'.join(archs)}")


def _probe_nvidia_smi() -> tuple[str, str] | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    def out(*args: str) -> str:
        try:
            return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60).stdout
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return out(), out("--query-gpu=compute_cap", "--format=csv,noheader")


def main(argv: list[str]) -> int:
    try:
        plan = make_plan(os.environ.get("HVDKIT_CUDA", "auto"), _probe_nvidia_smi(),
                         have_nvcc=bool(shutil.which("nvcc")), torch_index=os.environ.get("HVDKIT_TORCH_INDEX"))
    except PlanError as exc:
        print(f"[setup] ERROR: {exc}", file=sys.stderr)
        return 2
    print(plan.explain() if "--explain" in argv else plan.shell())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
