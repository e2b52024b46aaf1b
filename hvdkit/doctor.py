"""``hvdkit doctor``: what is installed and usable, with the fix for each missing piece."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass

from .backends.traits import LAUNCHABLE
from .errors import first_line
from .launch.vocabulary import root_mpi_env

__all__ = ["Check", "run_checks", "verdict"]

SETUP = "run ./scripts/setup.sh"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str
    ok: bool
    detail: str
    fix: str = ""
    required_for: tuple[str, ...] = ()


def _cmd(argv: list[str], timeout: float = 30) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **root_mpi_env()})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return proc.returncode, (proc.stdout + proc.stderr).strip()


def check_python() -> Check:
    ok = sys.version_info[:2] >= (3, 11)
    return Check("python", ok, f"{platform.python_version()} ({sys.executable})",
                 "use Python 3.11 (scripts/setup.sh creates .venv with it)", ("horovod", "ddp"))


def check_torch() -> Check:
    try:
        import torch
    except ImportError as exc:
        return Check("torch", False, f"not importable: {exc}", f"{SETUP} (pins torch==2.13.0)", ("horovod", "ddp"))
    cuda = torch.cuda.is_available()
    gpus = f"available, {torch.cuda.device_count()} GPU(s)" if cuda else "not available (CPU/gloo paths)"
    detail = f"{torch.__version__}; CUDA {gpus}"
    dist = torch.distributed.is_available()
    nccl = cuda and torch.distributed.is_nccl_available()
    gloo = dist and torch.distributed.is_gloo_available()
    detail += f"; distributed {'yes' if dist else 'NO'}, gloo {'yes' if gloo else 'no'}, nccl {'yes' if nccl else 'no'}"
    return Check("torch", dist, detail, "install a torch build with distributed support", ("horovod", "ddp"))


def check_horovod() -> Check:
    try:
        from .backends.horovod import build_info

        version, built = build_info()
    except ImportError as exc:  # torch or horovod.torch missing (BackendUnavailableError is one)
        detail = getattr(exc, "message", None) or f"not importable: {first_line(exc, default='import failed')}"
        return Check("horovod", False, detail,
                     f"{SETUP} (builds horovod 0.28.1 with the C++17 patch)", ("horovod",))
    flags = [f"{name} {'yes' if on else 'no'}" for name, on in built.items()]
    ok = built["mpi"] or built["gloo"]
    return Check("horovod", ok, f"{version} with PyTorch; controllers/ops: {', '.join(flags)}",
                 "rebuild with HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 (scripts/setup.sh)", ("horovod",))


def _tool(name: str) -> str | None:
    """The path 'hvdkit run' would launch ``name`` from (beside this interpreter first, then PATH):
    readiness is judged the way the launcher resolves tools, venv activated or not."""
    from .launch.local import resolve_launcher

    found = resolve_launcher(name)
    return found if os.path.isabs(found) and os.access(found, os.X_OK) else shutil.which(found)


def check_horovodrun() -> Check:
    exe = _tool("horovodrun")
    if not exe:
        return Check("horovodrun", False, f"neither beside {sys.executable} nor on PATH",
                     "install Horovod into this environment (scripts/setup.sh)", ("horovod",))
    code, out = _cmd([exe, "--check-build"], timeout=60)
    sections: dict[str, list[str]] = {}
    current = ""
    for line in out.splitlines():
        if line.strip().startswith("Available "):
            current = line.strip().removeprefix("Available ").rstrip(":").lower()
        elif "[X]" in line:
            sections.setdefault(current, []).append(line.replace("[X]", "").strip())
    summary = "; ".join(f"{k} {', '.join(v)}" for k, v in sections.items())
    return Check("horovodrun", code == 0, f"--check-build: {summary or out[:80]}",
                 "reinstall horovod with scripts/setup.sh", ("horovod",))


def check_mpi() -> Check:
    exe = _tool("mpirun")
    if not exe:
        return Check("mpirun", False, "not on PATH",
                     "apt-get install openmpi-bin libopenmpi-dev (scripts/setup.sh does)", ("horovod-mpi", "ddp-mpi"))
    code, out = _cmd([exe, "--version"])
    first = out.splitlines()[0] if out else "?"
    needed = root_mpi_env()
    root = f" (root: needs {' '.join(f'{k}={v}' for k, v in needed.items())}; hvdkit sets them)" if needed else ""
    return Check("mpirun", code == 0, f"{first}{root}", "reinstall Open MPI", ("horovod-mpi", "ddp-mpi"))


def check_mpi4py() -> Check:
    code, out = _cmd([sys.executable, "-c",
                      "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])"])
    if code != 0:
        return Check("mpi4py", False, f"not usable: {out.splitlines()[-1] if out else code}",
                     "MPICC=$(which mpicc) pip install --no-binary mpi4py mpi4py", ("ddp-mpi",))
    return Check("mpi4py", True, out.splitlines()[-1], "", ("ddp-mpi",))


def check_slurm() -> Check:
    missing = [c for c in ("sbatch", "srun", "scontrol", "sinfo") if not shutil.which(c)]
    if missing:
        return Check("slurm", False, f"missing: {', '.join(missing)}",
                     "run on a Slurm login node, or apt-get install slurm-wlm (scripts/setup.sh) "
                     "and scripts/local-cluster.sh up", ("slurm",))
    code, out = _cmd(["sinfo", "-h", "-o", "%P %a %D %t"])
    _, mpis = _cmd(["srun", "--mpi=list"])
    pmix = "pmix" in mpis
    sinfo = out.splitlines()[0] if code == 0 and out else "no controller reachable"
    detail = f"sinfo: {sinfo}; srun --mpi: {'pmix' if pmix else 'no pmix'}"
    fix = "" if code == 0 else "start Slurm (scripts/local-cluster.sh up) or check slurm.conf"
    if code == 0 and not pmix:
        fix = "Horovod under srun needs --mpi=pmix (or use --launcher mpirun)"
    return Check("slurm", code == 0, detail, fix, ("slurm",))


_PROBE = ("import socket, sys\n"
          "host = socket.gethostname()\n"
          "try:\n"
          "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10).close()\n"
          "    print(host, 'ok', flush=True)\n"
          "except OSError as exc:\n"
          "    print(host, 'FAIL', exc, flush=True)\n")


def check_allocation(environ: dict[str, str] | None = None) -> Check | None:
    """Inside a Slurm allocation: nodes, tasks per node, and MASTER_ADDR seen from every node.

    Rank 0's rendezvous fails late and vaguely when a node cannot resolve or reach
    MASTER_ADDR (a firewall, a name only the login node knows), so doctor opens a TCP
    listener here and has one task per node connect to MASTER_ADDR with ``srun``.
    Run it in the batch script (on the job's first node), where rank 0 will run.
    """
    import socket
    import threading

    from .environments import expand_nodelist

    env = dict(os.environ if environ is None else environ)
    job, nodelist = env.get("SLURM_JOB_ID"), env.get("SLURM_JOB_NODELIST")
    if not job or not nodelist:
        return None
    nodes = expand_nodelist(nodelist)
    detail = (f"job {job}: {len(nodes)} node(s) {','.join(nodes)}, tasks per node "
              f"{env.get('SLURM_TASKS_PER_NODE', '?')}")
    master = env.get("MASTER_ADDR") or nodes[0]
    try:
        master_ip = socket.getaddrinfo(master, None, socket.AF_INET)[0][4][0]
    except OSError as exc:
        return Check("allocation", False, f"{detail}; MASTER_ADDR {master} does not resolve ({exc})",
                     "export MASTER_ADDR to a name or address the compute nodes resolve", ("slurm",))
    detail += f"; MASTER_ADDR {master} -> {master_ip}"
    here = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    if master_ip not in here and master != socket.gethostname():
        return Check("allocation", True, f"{detail} (not this host: reachability not probed)",
                     "run 'hvdkit doctor' in the batch script to probe MASTER_ADDR from every node")
    with socket.create_server(("", 0)) as server:
        server.settimeout(1.0)
        port = server.getsockname()[1]
        stop = threading.Event()

        def accept() -> None:
            while not stop.is_set():
                try:
                    server.accept()[0].close()
                except OSError:
                    continue

        threading.Thread(target=accept, daemon=True).start()
        code, out = _cmd(["srun", "--overlap", f"--nodes={len(nodes)}", "--ntasks-per-node=1",
                          "--mpi=none", sys.executable, "-c", _PROBE, master, str(port)], timeout=90)
        stop.set()
    answers = dict(line.split(" ", 1) for line in out.splitlines() if line.split(" ", 1)[0] in nodes)
    bad = sorted(n for n in nodes if not answers.get(n, "").startswith("ok"))
    if code != 0 or bad:
        why = "; ".join(f"{n}: {answers.get(n, 'no answer')}" for n in bad) or out[-200:]
        return Check("allocation", False, f"{detail}; NOT reachable from {why}",
                     "check firewalls and that MASTER_ADDR names an interface every node can route to "
                     "(or pick one with --iface)", ("slurm",))
    return Check("allocation", True, f"{detail}; reachable from {', '.join(nodes)}")


def check_gpus() -> Check:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return Check("gpus", True, "no nvidia-smi: CPU-only machine (gloo)", "")
    code, out = _cmd([exe, "-L"])
    return Check("gpus", code == 0, out.replace("\n", "; ") or "none", "check the NVIDIA driver")


def gpu_stack_verdict(gpus: int, torch_cuda: bool, hvd_nccl: bool | None) -> Check:
    """Whether GPUs this machine has are used properly: CUDA torch, Horovod with NCCL ops.

    ``hvd_nccl`` is None when Horovod is not installed (then only torch matters).
    """
    fix = "HVDKIT_CUDA=auto ./scripts/setup.sh (CUDA torch, Horovod built with NCCL ops)"
    if gpus == 0:
        return Check("gpu stack", True, "no NVIDIA GPU: CPU paths (gloo)")
    if not torch_cuda:
        return Check("gpu stack", False, f"{gpus} GPU(s) but torch is a CPU build: training would "
                     "run on the CPU", fix, ("gpu",))
    if hvd_nccl is False:
        return Check("gpu stack", False, f"{gpus} GPU(s), CUDA torch, but Horovod has no NCCL ops: "
                     "its allreduce would go through host memory", fix, ("gpu",))
    tail = "Horovod with NCCL ops" if hvd_nccl else "no Horovod"
    return Check("gpu stack", True, f"{gpus} GPU(s), CUDA torch (NCCL for DDP), {tail}")


def check_gpu_stack() -> Check:
    code, out = _cmd(["nvidia-smi", "-L"]) if shutil.which("nvidia-smi") else (1, "")
    gpus = sum(1 for line in out.splitlines() if line.startswith("GPU ")) if code == 0 else 0
    try:
        import torch

        torch_cuda = torch.cuda.is_available()
    except ImportError:
        torch_cuda = False
    try:
        from .backends.horovod import build_info

        hvd_nccl: bool | None = build_info()[1]["nccl"]
    except ImportError:
        hvd_nccl = None
    return gpu_stack_verdict(gpus, torch_cuda, hvd_nccl)


def check_precision() -> Check:
    """Whether bf16/fp16 autocast has native kernels on this CPU (and GPU): emulated, they are
    several times slower than fp32 (hvdkit.precision). Advice, not a failure: fp32 always works."""
    try:
        import torch

        from .precision import lowp_support
    except ImportError:
        return Check("precision", True, "torch not importable: not checked")
    parts = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        found = [lowp_support(p, device) for p in ("bf16", "fp16")]
        said = ", ".join(f"{s.precision} {'native' if s.native else 'EMULATED'}" for s in found)
        slow = [s for s in found if not s.native]
        advice = f" ({slow[0].reason}; use --precision fp32 here)" if slow else ""
        parts.append(f"{device}: {said}{advice}")
    return Check("precision", True, "; ".join(parts))


def check_shellcheck() -> Check:
    return Check("shellcheck", bool(shutil.which("shellcheck")),
                 "present" if shutil.which("shellcheck") else "missing (only needed to lint scripts)",
                 "apt-get install shellcheck")


CHECKS: tuple[Callable[[], Check], ...] = (check_python, check_torch, check_horovod, check_horovodrun,
                                           check_mpi, check_mpi4py, check_slurm, check_gpus, check_gpu_stack,
                                           check_precision, check_shellcheck)


def run_checks() -> list[Check]:
    """Every check, in order; inside a Slurm allocation also the allocation itself."""
    checks = [check() for check in CHECKS]
    allocation = check_allocation()
    return checks + ([allocation] if allocation else [])


def verdict(checks: list[Check]) -> tuple[bool, str]:
    """(core usable, one line saying which paths are ready)."""
    failed = {t for c in checks if not c.ok for t in c.required_for}
    paths = {"horovod": "Horovod (horovodrun)", "ddp": "DDP", "horovod-mpi": "Horovod over MPI",
             "ddp-mpi": "DDP via mpirun+mpi4py", "slurm": "Slurm submission"}
    ready = [label for key, label in paths.items() if key not in failed]
    blocked = [label for key, label in paths.items() if key in failed]
    core = any(name not in failed for name in LAUNCHABLE)  # some backend can run ranks
    line = f"ready: {', '.join(ready) or 'nothing'}" + (f"; not ready: {', '.join(blocked)}" if blocked else "")
    return core, line
