"""The benchmark suite: launches the measurement jobs, summarises, writes JSON, tables, plots.

Every experiment keeps its raw samples (seconds per step / per allreduce /
per save) next to the summary, together with the machine description, so a
reader can recompute anything. Comparisons that matter (Horovod vs DDP, raw
Horovod vs hvdkit) are measured alternately A/B/A/B in the same run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..environments import usable_cores
from ..errors import HvdkitError
from ..fileio import write_json_atomic as write_json
from ..launch.local import LocalLaunch, build_local_command
from ..models import build_model
from .costmodel import fit_alpha_beta, predict_scaling
from .paths import exp_paths
from .stats import environment, ratio_ci, summarize

EXPERIMENTS = ("paths", "reducer", "ab", "fusion", "scaling", "allreduce", "ckpt", "overhead", "model")
MB = 1 << 20


@dataclass(frozen=True)
class BenchConfig:
    """What to measure and how much. ``quick()`` fits in ~3 minutes on 2 cores."""

    out: Path = Path("bench-results")
    only: tuple[str, ...] = EXPERIMENTS
    models: tuple[str, ...] = ("cnn", "mlp")
    np: int = 2
    batch: int = 32
    warmup: int = 5
    steps: int = 40
    rounds: int = 3
    fusion_mb: tuple[float, ...] = (0, 1, 4, 16, 64, 128)
    cycle_ms: tuple[float, ...] = (1, 5)
    bucket_mb: tuple[float, ...] = (1, 4, 25, 100)
    world_sizes: tuple[int, ...] = (1, 2, 4)
    sizes: tuple[int, ...] = tuple(4096 * 4**i for i in range(9))  # 4 KB .. 256 MB
    reps_small: int = 20
    reps_large: int = 5
    ckpt_params_m: float = 100.0
    ckpt_rounds: int = 3
    overhead_rounds: int = 3
    overhead_epochs: int = 4
    overhead_samples: int = 2048
    predict_workers: tuple[int, ...] = (8, 16, 32, 64, 128, 256, 512)
    hosts: str | None = None      # mpirun -H for the cross-node mode, e.g. node1:1,node2:1
    reducer_steps: int = 50       # timed steps per block; x reducer_rounds per variant
    reducer_rounds: int = 6
    reducer_bucket_mb: float = 25.0
    # the launch paths (hvdkit.bench.paths): each one as users start it, through the loop
    paths: tuple[str, ...] = ("horovod default", "horovodrun gloo", "horovodrun mpi", "mpirun horovod",
                              "mpirun ddp", "srun horovod", "srun ddp")
    path_models: tuple[str, ...] = ("mlp", "cnn", "gpt", "resnet18")
    path_rounds: int = 3
    path_epochs: int = 3          # the first is start-up: the rest are measured
    path_steps: int = 15
    slurm: bool = False           # also the srun paths, on the cluster this node submits to
    timeout_s: float = 900.0

    def __post_init__(self) -> None:
        """Everything that would fail after minutes of measuring fails here, in one line, before
        anything runs or is written."""
        from ..config import ConfigError
        from ..models import MODELS
        from .paths import PATHS, WORKLOADS

        def refuse(what: str, hint: str) -> None:
            raise ConfigError(what, hint)

        unknown = [e for e in self.only if e not in EXPERIMENTS]
        if unknown or not self.only:
            refuse(f"--only {','.join(self.only)}: {', '.join(unknown) or 'nothing'} is not an experiment",
                   f"use some of: {', '.join(EXPERIMENTS)}")
        workers = [e for e in self.only if e not in ("paths", "ckpt", "overhead", "allreduce")]
        bad = [m for m in self.models if m not in MODELS]
        if workers and (bad or not self.models):
            refuse(f"--models: {', '.join(bad) or 'none given'} is not a model the {'/'.join(workers)} "
                   "experiments can build", f"use some of: {', '.join(MODELS)}")
        bad = [m for m in self.path_models if m not in WORKLOADS]
        if "paths" in self.only and (bad or not self.path_models):
            refuse(f"--models: {', '.join(bad) or 'none given'} is not a model of the paths experiment",
                   f"use some of: {', '.join(WORKLOADS)}")
        bad = [p for p in self.paths if p not in PATHS]
        if "paths" in self.only and (bad or not self.paths):
            refuse(f"--paths: {', '.join(bad) or 'none given'} is not a launch path",
                   f"use some of: {', '.join(PATHS)}")
        for name, values, ok, bound, example in (
                ("--sizes", self.sizes, lambda v: v >= 1, ">= 1 byte", "4096,65536"),
                ("--world-sizes", self.world_sizes, lambda v: v >= 1, ">= 1", "1,2"),
                ("--fusion-mb", self.fusion_mb, lambda v: v >= 0, ">= 0", "0,16,128"),
                ("--bucket-mb", self.bucket_mb, lambda v: v > 0, "> 0", "4,25"),
                ("--cycle-ms", self.cycle_ms, lambda v: v > 0, "> 0", "1,5")):
            if not values or any(not (ok(v) and v < float("inf")) for v in values):
                refuse(f"{name} {','.join(f'{v:g}' for v in values) or '(empty)'}: each value must be a finite "
                       f"number {bound}", f"e.g. {name} {example}")
        if "model" in self.only and ("allreduce" not in self.only or len(set(self.sizes)) < 2):
            refuse("the cost model (--only model) is fitted to the allreduce experiment's times at two sizes "
                   "or more", "run it with --only allreduce,model and at least two --sizes")

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """The headline figure in under a minute on 2 cores: what ``hvdkit run --backend horovod``
        trains at against DDP and the floor, on the mlp (``--only`` adds the rest, smaller)."""
        base = dict(only=("paths",), paths=("horovod default", "mpirun ddp"), path_models=("mlp",),
                    path_rounds=2, path_epochs=3, path_steps=10, steps=20, rounds=2,
                    sizes=tuple(4096 * 4**i for i in range(7)), reps_small=10, reps_large=3,
                    ckpt_params_m=100.0, ckpt_rounds=2, overhead_rounds=2, overhead_epochs=3,
                    overhead_samples=1024, reducer_steps=20, reducer_rounds=3)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]  # checked by the dataclass


@dataclass
class Report:
    """Summaries and raw results, keyed by experiment."""

    env: dict[str, Any]
    config: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)


def _launch(cfg: BenchConfig, np: int, program: list[str]) -> None:
    # --hosts spreads the ranks over nodes (run it on one of them); else all on this machine
    hosts = cfg.hosts if np == cfg.np else None
    argv, env = build_local_command(LocalLaunch(np=np, launcher="mpirun", hosts=hosts), program)
    proc = subprocess.run(argv, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"}, text=True,
                          capture_output=True, timeout=cfg.timeout_s)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
        raise HvdkitError(f"benchmark job failed (exit {proc.returncode}): " + " | ".join(tail[-3:]),
                          "run 'hvdkit doctor'; the full output follows on stderr") from None


def _job(cfg: BenchConfig, np: int, spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        _launch(cfg, np, [sys.executable, "-m", "hvdkit.bench.worker", str(spec_path), str(out)])
        return json.loads(out.read_text())["result"]


def _steps_spec(cfg: BenchConfig, models: tuple[str, ...], variants: list[dict[str, Any]],
                rounds: int) -> dict[str, Any]:
    return {"experiment": "steps", "models": list(models), "rounds": rounds, "batch": cfg.batch,
            "warmup": cfg.warmup, "steps": cfg.steps, "variants": variants}


def _block_rate(block: dict[str, Any], batch: int, np: int) -> float:
    return batch * np / statistics.median(block["step_s"])


def _label(v: dict[str, Any]) -> str:
    if v["kind"] == "horovod":
        cycle = f" cycle={v['cycle_ms']:g}ms" if v.get("cycle_ms") else ""
        return f"horovod fusion={v.get('fusion_mb', 128):g}MB{cycle}"
    if v["kind"] == "ddp":
        return f"ddp bucket={v.get('bucket_mb', 25):g}MB"
    return "compute only"


# -- experiments ------------------------------------------------------------------

def exp_reducer(cfg: BenchConfig, rep: Report) -> None:
    """Horovod's bucketed reducer vs its stock optimizer vs DDP, against the same-run floor."""
    spec = {"experiment": "reducer", "models": list(cfg.models), "rounds": cfg.reducer_rounds,
            "batch": cfg.batch, "warmup": cfg.warmup, "steps": cfg.reducer_steps,
            "bucket_mb": cfg.reducer_bucket_mb}
    raw = _job(cfg, cfg.np, spec)
    rep.results["reducer"] = raw
    rows = []
    for model in cfg.models:
        variants = ("bucketed", "bucketed-cycle5", "stock", "ddp")
        blocks = {v: [b["step_s"] for b in sorted(raw["blocks"], key=lambda b: b["round"])
                      if b["model"] == model and b["variant"] == v] for v in variants}
        steps = {v: [t for blk in blocks[v] for t in blk] for v in variants}
        cpu = {v: statistics.fmean(c for b in raw["blocks"] if b["model"] == model and b["variant"] == v
                                   for c in b["cpu_s_per_step"]) for v in steps}
        floor = raw["floor"][model]
        rep.summary["reducer_hosts"] = sorted(set(raw["hosts"]))
        floor_s = statistics.median(floor["compute_s"]) + statistics.median(floor["allreduce_s"])
        best = min(steps, key=lambda v: statistics.median(steps[v]))
        row = {"model": model, "floor_s": floor_s, "compute_s": statistics.median(floor["compute_s"]),
               "mpi_allreduce_s": statistics.median(floor["allreduce_s"]), "grad_bytes": floor["grad_bytes"],
               "best": best}
        for v, ts in steps.items():
            sm = summarize(ts)
            row[v] = {"median_s": sm["median"], "p25_s": sm["p25"], "p75_s": sm["p75"], "n": sm["n"],
                      "cpu_s_per_step": cpu[v], "over_floor": sm["median"] / floor_s}
        for name, (a, b) in {"bucketed_over_ddp": ("bucketed", "ddp"),
                             "stock_over_bucketed": ("stock", "bucketed"),
                             "stock_over_ddp": ("stock", "ddp"),
                             "cycle5_over_ddp": ("bucketed-cycle5", "ddp")}.items():
            point, lo, hi = ratio_ci(blocks[a], blocks[b])
            row[name] = {"ratio": point, "ci95": [lo, hi]}
        rows.append(row)
    rep.summary["reducer"] = rows
    for r in rows:
        b_d = r["bucketed_over_ddp"]
        rep.targets.append({"target": f"bucketed Horovod step time <= 1.00x DDP, upper 95% <= 1.05x ({r['model']})",
                            "value": f"{b_d['ratio']:.3f}x [{b_d['ci95'][0]:.3f}, {b_d['ci95'][1]:.3f}]",
                            "met": b_d["ratio"] <= 1.0 and b_d["ci95"][1] <= 1.05})
        if r["model"] == "mlp":
            s_b = r["stock_over_bucketed"]
            rep.targets.append({"target": "bucketed >= 1.3x faster than stock (mlp)",
                                "value": f"{s_b['ratio']:.2f}x [{s_b['ci95'][0]:.2f}, {s_b['ci95'][1]:.2f}]",
                                "met": s_b["ratio"] >= 1.3})
        best = r[r["best"]]["over_floor"]
        rep.targets.append({"target": f"fastest backend within 1.25x of the floor ({r['model']})",
                            "value": f"{r['best']} {best:.2f}x floor ({r['floor_s'] * 1e3:.1f} ms)",
                            "met": best <= 1.25})


def exp_ab(cfg: BenchConfig, rep: Report) -> None:
    """Horovod vs DDP at equal settings (fusion threshold = bucket cap = 25 MB), A/B/A/B."""
    variants: list[dict[str, Any]] = [{"kind": "horovod", "fusion_mb": 25}, {"kind": "ddp", "bucket_mb": 25},
                                      {"kind": "compute"}]
    raw = _job(cfg, cfg.np, _steps_spec(cfg, cfg.models, variants, cfg.rounds))
    rep.results["ab"] = raw
    rows = []
    for model in cfg.models:
        blocks = [b for b in raw["blocks"] if b["model"] == model]
        rate = {k: [_block_rate(b, cfg.batch, cfg.np) for b in blocks if b["kind"] == k]
                for k in ("horovod", "ddp", "compute")}
        ratios = [h / d for h, d in zip(rate["horovod"], rate["ddp"])]
        all_steps = {k: [t for b in blocks if b["kind"] == k for t in b["step_s"]] for k in rate}
        compute = statistics.median(all_steps["compute"])
        rows.append({
            "model": model,
            "horovod_samples_s": summarize(rate["horovod"]), "ddp_samples_s": summarize(rate["ddp"]),
            "horovod_over_ddp": statistics.median(ratios), "ratios_per_round": ratios,
            "horovod_comm_share": 1 - compute / statistics.median(all_steps["horovod"]),
            "ddp_comm_share": 1 - compute / statistics.median(all_steps["ddp"]),
            "compute_step_s": compute,
        })
    rep.summary["ab"] = rows
    for r in rows:
        rep.targets.append({"target": f"Horovod within 10% of DDP or faster ({r['model']})",
                            "value": f"{r['horovod_over_ddp']:.2f}x DDP throughput",
                            "met": r["horovod_over_ddp"] >= 0.9})


def exp_fusion(cfg: BenchConfig, rep: Report) -> None:
    """Step and communication time vs fusion threshold, cycle time and DDP bucket size (mlp)."""
    variants: list[dict[str, Any]] = [{"kind": "compute"}]
    variants += [{"kind": "horovod", "fusion_mb": f} for f in cfg.fusion_mb]
    variants += [{"kind": "ddp", "bucket_mb": b} for b in cfg.bucket_mb]
    raw = _job(cfg, cfg.np, _steps_spec(cfg, ("mlp",), variants, max(1, cfg.rounds - 1)))
    # Horovod 0.28.1 cannot be re-initialised with HOROVOD_CYCLE_TIME set: one job per value.
    for cycle in cfg.cycle_ms:
        if cycle != 1:
            extra = _job(cfg, cfg.np, _steps_spec(cfg, ("mlp",), [
                {"kind": "compute"}, {"kind": "horovod", "fusion_mb": 128, "cycle_ms": cycle}], 1))
            raw["blocks"] += extra["blocks"]
    rep.results["fusion"] = raw
    compute = statistics.median([t for b in raw["blocks"] if b["kind"] == "compute" for t in b["step_s"]])
    rows = []
    for v in variants[1:] + [{"kind": "horovod", "fusion_mb": 128, "cycle_ms": c} for c in cfg.cycle_ms if c != 1]:
        times = [t for b in raw["blocks"] if _label(b) == _label(v) for t in b["step_s"]]
        step = statistics.median(times)
        rows.append({"setting": _label(v), **v, "step_s": step, "comm_s": max(step - compute, 0.0)})
    rep.summary["fusion"] = {"compute_step_s": compute, "rows": rows}
    by = {r["setting"]: r for r in rows}
    off, on = by.get("horovod fusion=0MB"), by.get("horovod fusion=128MB")
    if off and on and on["comm_s"] > 0:
        ratio = off["comm_s"] / on["comm_s"]
        rep.summary["fusion"]["unfused_over_fused_comm"] = ratio
        rep.targets.append({"target": "fusion: >= 3x less communication time than unfused (mlp)",
                            "value": f"{ratio:.2f}x", "met": ratio >= 3})


def exp_scaling(cfg: BenchConfig, rep: Report) -> None:
    """Throughput at np = 1, 2, 4 (more ranks than cores is marked oversubscribed)."""
    cores = usable_cores()
    variants: list[dict[str, Any]] = [{"kind": "horovod", "fusion_mb": 128}, {"kind": "ddp", "bucket_mb": 25},
                                      {"kind": "compute"}]
    raw: dict[str, Any] = {}
    for np in cfg.world_sizes:
        raw[str(np)] = _job(cfg, np, _steps_spec(cfg, cfg.models, variants, 1))
    rep.results["scaling"] = raw
    med: dict[tuple[str, int, str], float] = {}
    for np in cfg.world_sizes:
        for b in raw[str(np)]["blocks"]:
            med[(b["model"], np, b["kind"])] = statistics.median(b["step_s"])
    rows = []
    for (model, np, kind), step in sorted(med.items()):
        if kind == "compute":
            continue
        thr = cfg.batch * np / step
        one = med.get((model, 1, kind))
        rows.append({"model": model, "np": np, "backend": kind, "samples_s": thr,
                     "efficiency": thr / (np * cfg.batch / one) if one else None,
                     "comm_share": max(0.0, 1 - med[(model, np, "compute")] / step),
                     "oversubscribed": np > cores})
    rep.summary["scaling"] = {"cores": cores, "rows": rows}


def exp_allreduce(cfg: BenchConfig, rep: Report) -> None:
    """Algorithm and bus bandwidth, Horovod vs torch.distributed (gloo), memcpy as the ceiling."""
    raw = _job(cfg, cfg.np, {"experiment": "allreduce", "sizes": list(cfg.sizes),
                             "reps_small": cfg.reps_small, "reps_large": cfg.reps_large})
    rep.results["allreduce"] = raw
    n = cfg.np
    rows = []
    for size in cfg.sizes:
        row: dict[str, Any] = {"bytes": size}
        for lib in ("horovod", "torch", "memcpy", "mpi"):
            t = statistics.median(raw[lib][str(size)])
            algbw = size / t
            row[f"{lib}_s"] = t
            row[f"{lib}_algbw"] = algbw
            row[f"{lib}_busbw"] = algbw * 2 * (n - 1) / n if lib != "memcpy" else algbw
        rows.append(row)
    rep.summary["allreduce"] = {"world_size": n, "rows": rows, "hosts": sorted(set(raw["hosts"]))}
    at = next((r for r in rows if r["bytes"] == 64 * MB), rows[-1])
    ratio = at["horovod_busbw"] / at["torch_busbw"]
    rep.targets.append({"target": f"Horovod bus bandwidth >= 80% of torch gloo at {at['bytes'] // MB} MB",
                        "value": f"{ratio:.0%}", "met": ratio >= 0.8})


def exp_ckpt(cfg: BenchConfig, rep: Report) -> None:
    """HDF5 vs torch.save for a ~100M-parameter state (both fsync'd)."""
    from .ckpt_io import run_ckpt_io

    raw = run_ckpt_io(cfg.out / "tmp-ckpt", cfg.ckpt_params_m, cfg.ckpt_rounds)
    (cfg.out / "tmp-ckpt").rmdir()
    rep.results["ckpt"] = raw
    med = {k: statistics.median(v) for k, v in raw["seconds"].items()}
    summary = {"params": raw["params"], "state_mb": raw["state_bytes"] / MB, **{f"{k}_s": v for k, v in med.items()},
               "save_ratio_hdf5_over_torch": med["hdf5_save"] / med["torch_save"],
               "load_ratio_hdf5_over_torch": med["hdf5_load"] / med["torch_load"]}
    rep.summary["ckpt"] = summary
    rep.targets.append({"target": "HDF5 save within 1.2x of torch.save",
                        "value": f"{summary['save_ratio_hdf5_over_torch']:.2f}x",
                        "met": summary["save_ratio_hdf5_over_torch"] <= 1.2})


def exp_overhead(cfg: BenchConfig, rep: Report) -> None:
    """hvdkit's training loop vs the same training in plain horovod.torch, alternating."""
    rates: dict[str, list[float]] = {"raw": [], "hvdkit": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(cfg.overhead_rounds):
            raw_out, kit_out = Path(tmp) / f"raw{rnd}.json", Path(tmp) / f"kit{rnd}.json"
            _launch(cfg, cfg.np, [sys.executable, "-m", "hvdkit.backends.raw_horovod", "mlp",
                                  str(cfg.overhead_epochs), str(cfg.overhead_samples), str(cfg.batch),
                                  str(raw_out)])
            _launch(cfg, cfg.np, [sys.executable, "-m", "hvdkit", "train", "--backend", "horovod",
                                  "--model", "mlp", "--epochs", str(cfg.overhead_epochs),
                                  "--num-samples", str(cfg.overhead_samples), "--batch-size",
                                  str(cfg.batch), "--metrics-file", str(kit_out)])
            rates["raw"] += json.loads(raw_out.read_text())["samples_per_sec"][1:]  # epoch 0 = warm-up
            rates["hvdkit"] += json.loads(kit_out.read_text())["samples_per_sec"][1:]
    rep.results["overhead"] = rates
    raw_med, kit_med = statistics.median(rates["raw"]), statistics.median(rates["hvdkit"])
    overhead = 1 - kit_med / raw_med
    rep.summary["overhead"] = {"raw_samples_s": summarize(rates["raw"]),
                               "hvdkit_samples_s": summarize(rates["hvdkit"]), "overhead": overhead}
    rep.targets.append({"target": "hvdkit overhead vs raw Horovod <= 2% of step time",
                        "value": f"{overhead:+.1%}", "met": overhead <= 0.02})


def exp_model(cfg: BenchConfig, rep: Report) -> None:
    """Fit alpha/B to the allreduce results and predict 8..512 workers (a prediction)."""
    ar = rep.summary.get("allreduce")
    if not ar:
        raise HvdkitError("the cost model needs the allreduce experiment", "run it with --only allreduce,model")
    sizes = [r["bytes"] for r in ar["rows"]]
    # The transport's latency and bandwidth come from torch.distributed's times; a single
    # Horovod allreduce also waits for its background cycle, so its fit is reported apart.
    alpha, bw = fit_alpha_beta(sizes, [r["torch_s"] for r in ar["rows"]], ar["world_size"])
    hvd_alpha, hvd_bw = fit_alpha_beta(sizes, [r["horovod_s"] for r in ar["rows"]], ar["world_size"])
    ab = {r["model"]: r["compute_step_s"] for r in rep.summary.get("ab", [])}
    scenarios = {"measured here (loopback, CPU compute)": (alpha, bw),
                 "assumed: InfiniBand HDR 200 Gb/s, alpha=3 us, B=20 GB/s": (3e-6, 20e9)}
    out: dict[str, Any] = {"alpha_s": alpha, "bandwidth_Bps": bw, "horovod_alpha_s": hvd_alpha,
                           "horovod_bandwidth_Bps": hvd_bw, "models": {}}
    for model in cfg.models:
        m = build_model(model)
        params = list(m.parameters())
        grad_bytes = sum(p.numel() * 4 for p in params)
        compute = ab.get(model, 0.02)
        out["models"][model] = {"grad_bytes": grad_bytes, "tensors": len(params), "compute_step_s": compute,
                                "scenarios": {name: predict_scaling(compute, grad_bytes, len(params), a, b,
                                                                    list(cfg.predict_workers))
                                              for name, (a, b) in scenarios.items()}}
    rep.summary["model"] = out


RUNNERS: dict[str, Callable[[BenchConfig, Report], None]] = {
    "reducer": exp_reducer, "ab": exp_ab, "fusion": exp_fusion, "scaling": exp_scaling, "allreduce": exp_allreduce,
    "ckpt": exp_ckpt, "overhead": exp_overhead, "model": exp_model, "paths": exp_paths,
}


def run_suite(cfg: BenchConfig, log: Callable[[str], None] = print) -> Report:
    """Run the selected experiments in order, writing results as each finishes."""
    unknown = set(cfg.only) - set(EXPERIMENTS)
    if unknown:
        raise HvdkitError(f"unknown experiment(s): {', '.join(sorted(unknown))}",
                          f"choose from {', '.join(EXPERIMENTS)}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    rep = Report(env=environment(cfg.np), config={k: (str(v) if isinstance(v, Path) else v)
                                                  for k, v in dataclasses.asdict(cfg).items()})
    for name in EXPERIMENTS:
        if name not in cfg.only:
            continue
        t0 = time.perf_counter()
        RUNNERS[name](cfg, rep)
        rep.summary.setdefault("seconds", {})[name] = time.perf_counter() - t0
        log(f"[bench] {name} done in {time.perf_counter() - t0:.1f}s")
        write_json(cfg.out / "bench.json", dataclasses.asdict(rep))
    from .report import render_plots, render_tables

    render_plots(rep, cfg.out)
    tables = render_tables(rep)
    (cfg.out / "summary.md").write_text(tables)
    log(tables)
    return rep
