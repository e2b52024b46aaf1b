"""The launch paths users run, measured through the training loop itself.

Every path is ``hvdkit train`` started exactly the way a user starts it: ``hvdkit run
--backend horovod`` (the default controller), horovodrun with each controller, mpirun for
Horovod and for DDP, and, with ``--slurm``, srun on the local cluster for both. A path's step
time is the global batch over the loop's own epoch throughput (the epochs after the first;
start-up excluded). The floor is the same training with no communication: N independent
one-rank processes, started together so that they share the cores as the ranks do. Paths
run in rotated order every round; ratios to DDP (mpirun) carry a bootstrap interval over
rounds, as the reducer experiment's do.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..environments import usable_cores
from ..errors import HvdkitError
from .stats import ratio_ci, summarize

__all__ = ["PATHS", "clean_env", "exp_paths", "floor_steps", "prepare_models", "workloads"]

HVDKIT = [sys.executable, "-m", "hvdkit"]
REPO = Path(__file__).resolve().parents[2]  # a checkout: examples/ and tests/compat beside hvdkit/
DDP = "mpirun ddp"

# name -> what the user types ("run" paths) or the srun line (Slurm paths)
PATHS: dict[str, dict[str, Any]] = {
    "horovod default": {"run": ["--backend", "horovod"]},
    "horovodrun gloo": {"run": ["--backend", "horovod", "--controller", "gloo"]},
    "horovodrun mpi": {"run": ["--backend", "horovod", "--controller", "mpi"]},
    "mpirun horovod": {"run": ["--backend", "horovod", "--launcher", "mpirun"]},
    DDP: {"run": ["--backend", "ddp"]},
    "srun horovod": {"srun": "pmix", "backend": "horovod"},
    "srun ddp": {"srun": "none", "backend": "ddp"},
    # sharding's cost (not in the default list: --paths names them), against unsharded DDP
    "ddp shard=optimizer": {"run": ["--backend", "ddp"], "train": ["--shard", "optimizer"]},
    "ddp shard=full": {"run": ["--backend", "ddp"], "train": ["--shard", "full"]},
    "horovod shard=optimizer": {"run": ["--backend", "horovod"], "train": ["--shard", "optimizer"]},
    "horovod shard=full": {"run": ["--backend", "horovod"], "train": ["--shard", "full"]},
}


WORKLOADS = ("mlp", "cnn", "gpt", "resnet18")  # the names workloads() knows


def workloads(data: Path) -> dict[str, dict[str, Any]]:
    """The models: the two small built-ins, a 4.8M-parameter GPT and torchvision's ResNet-18."""
    models = REPO / "examples" / "models.py"
    return {
        "mlp": {"args": ["--model", "mlp"], "batch": 32},
        "cnn": {"args": ["--model", "cnn"], "batch": 32},
        "gpt": {"args": ["--model", f"{models}:gpt", "--model-arg", "vocab_size=96", "--model-arg", "n_layer=6",
                         "--model-arg", "n_embd=256", "--model-arg", "n_head=8", "--model-arg", "block_size=64",
                         "--task", "language-model", "--data", str(data / "text" / "train.h5")],
                "batch": 16, "needs": models},
        "resnet18": {"args": ["--model", "torchvision.models:resnet18", "--model-arg", "num_classes=10",
                              "--data", str(data / "digits32" / "train.h5")], "batch": 32, "needs": "torchvision"},
    }


def clean_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without a launcher's or Horovod's variables (a bench run inside a job
    must not inherit the job's rank), unbuffered, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_COMM_WORLD", "PMI_", "SLURM_", "HOROVOD_"))}
    env.update({"PYTHONUNBUFFERED": "1", **(extra or {})})
    return env


def prepare_models(data: Path, names: list[str]) -> tuple[list[str], dict[str, str], list[str]]:
    """Import the data the models need; return the usable models, extra env, and notes."""
    notes, usable, extra_env = [], [], {}
    for name in names:
        spec = workloads(data)[name]
        need = spec.get("needs")
        if need == "torchvision":
            ok = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True, env=clean_env())
            compat = REPO / "tests" / "compat"
            if ok.returncode != 0 and compat.is_dir():
                shim = subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True,
                                      env=clean_env({"PYTHONPATH": str(compat)}))
                if shim.returncode == 0:
                    extra_env["PYTHONPATH"] = str(compat)
                    notes.append("torchvision: its CUDA-only wheel on a CPU torch, through tests/compat")
                    ok = shim
            if ok.returncode != 0:
                notes.append(f"{name} skipped: torchvision is not importable (pip install 'hvdkit[vision]')")
                continue
            if not (data / "digits32" / "val.h5").exists():
                subprocess.run([*HVDKIT, "data", "import-digits", str(data / "digits32"), "--image-size", "32",
                                "--channels", "3"], check=True, capture_output=True, env=clean_env())
        elif isinstance(need, Path):
            if not need.is_file():
                notes.append(f"{name} skipped: {need} not found (run from a checkout)")
                continue
            if not (data / "text" / "val.h5").exists():
                subprocess.run([*HVDKIT, "data", "import-text", str(data / "text"), "--block", "64"],
                               check=True, capture_output=True, env=clean_env())
        usable.append(name)
    return usable, extra_env, notes


def _train_args(spec: dict[str, Any], epochs: int, steps: int, metrics: Path) -> list[str]:
    return [*spec["args"], "--epochs", str(epochs), "--steps-per-epoch", str(steps), "--batch-size",
            str(spec["batch"]), "--progress", "lines", "--metrics-file", str(metrics)]


def _epoch_steps(metrics: Path, global_batch: int) -> list[float]:
    """Seconds per step of each epoch after the first, from the loop's own throughput."""
    history = json.loads(metrics.read_text())["history"]
    return [global_batch / r["samples_per_sec"] for r in history[1:]]


def _run(argv: list[str], env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        raise HvdkitError(f"benchmark run failed (exit {proc.returncode}): {' | '.join(tail)}",
                          f"run it by hand: {' '.join(argv)}")


def _one_path(path: str, spec: dict[str, Any], np_: int, epochs: int, steps: int, env: dict[str, str],
              tmp: Path, timeout: float) -> list[float]:
    metrics = tmp / "m.json"
    metrics.unlink(missing_ok=True)
    how = PATHS[path]
    train = [*_train_args(spec, epochs, steps, metrics), *how.get("train", [])]
    if "run" in how:
        argv = [*HVDKIT, "run", "-np", str(np_), *how["run"], "--", *train]
    else:  # srun from this (login) node, as the generated sbatch script runs its step
        from ..launch.vocabulary import MPI_DEFAULTS, root_mpi_env

        env = {**env, **root_mpi_env(), **MPI_DEFAULTS, "OMP_NUM_THREADS": str(max(1, usable_cores() // np_))}
        argv = ["srun", "-N1", f"-n{np_}", "--unbuffered", "--kill-on-bad-exit=1", f"--mpi={how['srun']}",
                *HVDKIT, "train", "--backend", how["backend"], *train]
    _run(argv, env, timeout)
    return _epoch_steps(metrics, spec["batch"] * np_)


def floor_steps(spec: dict[str, Any], np_: int, epochs: int, steps: int, env: dict[str, str], tmp: Path,
                timeout: float) -> list[float]:
    """np concurrent one-rank processes (no communication): per epoch, the slowest one's step."""
    threads = str(max(1, usable_cores() // np_))
    procs, files = [], []
    for i in range(np_):
        metrics = tmp / f"floor{i}.json"
        metrics.unlink(missing_ok=True)
        files.append(metrics)
        train = [*HVDKIT, "train", "--backend", "local", *_train_args(spec, epochs, steps, metrics)]
        procs.append(subprocess.Popen(train,
                                      env={**env, "OMP_NUM_THREADS": threads}, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=timeout)
        if p.returncode != 0:
            raise HvdkitError(f"floor run failed: {err.strip().splitlines()[-1:] or p.returncode}",
                              "run 'hvdkit train --backend local' by hand")
    per_process = [_epoch_steps(f, spec["batch"]) for f in files]
    return [max(steps_) for steps_ in zip(*per_process)]


def exp_paths(cfg: Any, rep: Any) -> None:
    """Every launch path x model, rotated per round, against the same-run floor and DDP."""
    slurm = bool(getattr(cfg, "slurm", False))
    if slurm and not shutil.which("srun"):
        raise HvdkitError("--slurm needs srun here", "run on a login node, or scripts/local-cluster.sh up")
    paths = [p for p in cfg.paths if slurm or "srun" not in PATHS[p]]
    if DDP not in paths:
        paths.append(DDP)
    data = cfg.out / "data"
    models, extra_env, notes = prepare_models(data, list(cfg.path_models))
    env = clean_env(extra_env)
    raw: dict[str, Any] = {"paths": paths, "models": models, "notes": notes, "blocks": []}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for r in range(cfg.path_rounds):
            for model in models:
                spec = workloads(data)[model]
                variants = [*paths, "floor"]
                order = variants[r % len(variants):] + variants[:r % len(variants)]  # rotated per round
                for path in order:
                    if path == "floor":
                        steps_s = floor_steps(spec, cfg.np, cfg.path_epochs, cfg.path_steps, env, tmp, cfg.timeout_s)
                    else:
                        steps_s = _one_path(path, spec, cfg.np, cfg.path_epochs, cfg.path_steps, env, tmp,
                                            cfg.timeout_s)
                    raw["blocks"].append({"round": r, "model": model, "path": path, "step_s": steps_s})
    from ..launch.local import horovod_controller

    default_controller = horovod_controller("auto")[0]
    rep.results["paths"] = raw
    rows = []
    for model in models:
        blocks = {v: [b["step_s"] for b in raw["blocks"] if b["model"] == model and b["path"] == v]
                  for v in [*paths, "floor"]}
        floor_s = statistics.median(t for blk in blocks["floor"] for t in blk)
        row: dict[str, Any] = {"model": model, "floor_s": floor_s, "paths": {}}
        for path in paths:
            sm = summarize([t for blk in blocks[path] for t in blk])
            point, lo, hi = ratio_ci(blocks[path], blocks[DDP])
            row["paths"][path] = {"median_s": sm["median"], "p25_s": sm["p25"], "p75_s": sm["p75"],
                                  "over_floor": sm["median"] / floor_s, "over_ddp": [point, lo, hi]}
        fastest = min(paths, key=lambda p: row["paths"][p]["median_s"])
        row["fastest"] = fastest
        if "horovod default" in paths:
            paths = row["paths"]
            row["default_over_fastest"] = paths["horovod default"]["median_s"] / paths[fastest]["median_s"]
        rows.append(row)
    rep.summary["paths"] = {"rows": rows, "paths": paths, "notes": notes, "default_controller": default_controller,
                            "rounds": cfg.path_rounds, "epochs": cfg.path_epochs, "steps": cfg.path_steps}
    for row in rows:
        for path in paths:
            if "horovod" not in path or "train" in PATHS[path]:  # the target is about launch paths
                continue
            point, lo, hi = row["paths"][path]["over_ddp"]
            rep.targets.append({"target": f"Horovod at most 1.05x DDP's step time: {path}, {row['model']}",
                                "value": f"{point:.2f}x [{lo:.2f}, {hi:.2f}]", "met": point <= 1.05})
        if "default_over_fastest" in row:
            rep.targets.append({"target": f"the default path within 1.10x of the fastest ({row['model']})",
                                "value": f"{row['default_over_fastest']:.2f}x of {row['fastest']}",
                                "met": row["default_over_fastest"] <= 1.10})
