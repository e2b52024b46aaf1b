"""The scaling model (hvdkit.bench.costmodel) checked against measurements, then used to predict.

Three parts, one report (JSON, markdown, plot):

1. **Fit and check.** Every (link, model, variant) point the network bench measured
   (benchmarks/network.py: 2 ranks on 2 nodes of the local cluster) is predicted from that
   run's compute floor, the model's real bucket plan for the variant, when backward makes
   each gradient (the layers' FLOPs), and the link's bandwidth (the bench's own allreduce of
   each model's gradient bytes on that link). This
   machine's overheads (how much of compute backward is, what a byte and a collective cost the
   shared cores, PowerSGD's products) are fitted by least squares on log step time. Reported:
   every point's error, the share within +-15%, and the same with each link left out of the
   fit (the honest test: predicting a link it never saw).
2. **Published results.** The model given the hardware of Horovod's 512-GPU benchmark and of
   the PyTorch DDP paper, with every input and its source stated.
3. **Projection.** Efficiency of the README's models from 8 to 512 GPUs on 10/25/100/400
   Gbit/s links, and the per-GPU step time each needs for 90% efficiency.

    python benchmarks/scaling_model.py --out docs/bench/scaling
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from network import VARIANTS  # noqa: E402

from hvdkit.backends.buckets import FIRST_BUCKET_BYTES, plan_buckets  # noqa: E402
from hvdkit.backends.hvd_reducer import plan_allreduce_buckets  # noqa: E402
from hvdkit.backends.powersgd import wire_elements  # noqa: E402
from hvdkit.bench.costmodel import Link, Message, Overheads, messages, step_time  # noqa: E402

RUNS = [ROOT / "docs" / "bench" / "network" / p / "network.json" for p in ("unshaped", "10gbit", ".")]
HOROVOD_CYCLE_S = 1e-3       # Horovod 0.28's HOROVOD_CYCLE_TIME default
STACKS = ("horovod mpi", "horovod gloo", "ddp")
WITHIN = 0.15


# -- the models' layouts ------------------------------------------------------------------------

def _torchvision() -> Any:
    """torchvision's models, through tests/compat where its compiled ops cannot load here."""
    compat = ROOT / "tests" / "compat" / "sitecustomize.py"
    if compat.is_file() and not getattr(_torchvision, "done", False):
        runpy.run_path(str(compat))
        _torchvision.done = True  # type: ignore[attr-defined]
    import torchvision.models

    return torchvision.models


def ready_fractions(model: torch.nn.Module, example: torch.Tensor) -> list[float]:
    """How far through backward each trainable parameter's gradient exists (0-1), from the
    FLOPs of one forward and backward of ``example`` per layer (torch's FlopCounterMode; meta
    tensors are enough): backward runs the layers in reverse, so a layer's gradient is ready
    once every later layer and itself are done. A parameter used twice (tied embeddings) is
    ready only after its first use in forward, the last in backward."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        model(example).float().sum().backward()
    counts = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    root = type(model).__name__
    mods = dict(model.named_modules())

    def total(name: str) -> int:
        return counts.get(f"{root}.{name}" if name else root, 0)

    own: dict[str, float] = {}  # each module's FLOPs without its children's
    for name, mod in mods.items():
        own[name] = max(0, total(name) - sum(total(f"{name}.{c}" if name else c) for c, _ in mod.named_children()))
    owners = [(name, [p for p in mods[name].parameters(recurse=False) if p.requires_grad]) for name in mods]
    owners = [(name, ps) for name, ps in owners if ps]
    whole = float(sum(own[name] for name, _ in owners)) or 1.0
    ready: dict[int, float] = {}
    acc = 0.0
    for name, ps in reversed(owners):
        acc += own[name]
        for p in ps:
            ready[id(p)] = max(ready.get(id(p), 0.0), acc / whole)
    return [ready[id(p)] for p in model.parameters() if p.requires_grad]


def layouts(names: Sequence[str]) -> dict[str, tuple[list[torch.nn.Parameter], list[float]]]:
    """The bench's models, built from the bench's own arguments (hvdkit.bench.paths.workloads):
    trainable parameters (registration order) and when backward makes each gradient, for one
    batch of the bench's size and shape."""
    from hvdkit.bench.paths import workloads
    from hvdkit.factories import parse_args
    from hvdkit.models import MODELS, build_model

    out = {}
    for name in names:
        spec = workloads(Path(tempfile.gettempdir()))[name]
        argv = spec["args"]
        model_args = parse_args(argv[i + 1] for i, a in enumerate(argv) if a == "--model-arg")
        target = argv[argv.index("--model") + 1]
        if "torchvision" in target:
            _torchvision()
        model = build_model(target, args=model_args)
        if "--task" in argv and argv[argv.index("--task") + 1] == "language-model":
            example = torch.randint(0, model_args["vocab_size"], (spec["batch"], model_args["block_size"]))
        elif target in MODELS:
            example = torch.randn(spec["batch"], *MODELS[target].input_shape)
        else:  # the bench's images: digits at 32x32, 3 channels
            example = torch.randn(spec["batch"], 3, 32, 32)
        out[name] = ([p for p in model.parameters() if p.requires_grad], ready_fractions(model, example))
    return out


def _opt(argv: list[str], flag: str, default: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv else default


def knobs(variant: str) -> dict[str, Any]:
    """A network-bench variant as the model's inputs: its stack, bucket cap, compression and
    cycle, read from its training options as ``hvdkit train`` parses them (defaults included)."""
    from hvdkit.backends.traits import DEFAULT_BACKEND
    from hvdkit.cli.train_cmd import build_train_config, train_command

    run, train = VARIANTS[variant]
    backend = _opt(run, "--backend", DEFAULT_BACKEND)
    ctx = train_command.make_context("hvdkit train", ["--backend", backend, *train], resilient_parsing=False)
    b = build_train_config(ctx.params).backend
    # the bench's runs see no saved result, so horovodrun's auto controller is MPI there
    stack = "ddp" if b.name == "ddp" else f"horovod {_opt(run, '--controller', 'mpi')}"
    cycle = b.horovod.cycle_time_ms
    return {"stack": stack, "bucket_mb": b.bucket_cap_mb, "compression": b.compression.kind,
            "rank": b.compression.rank, "cycle_s": cycle / 1e3 if cycle is not None else HOROVOD_CYCLE_S}


def collectives(layout: tuple[list[torch.nn.Parameter], list[float]], k: dict[str, Any]
                ) -> tuple[list[Message], float]:
    """The collectives one step sends for this variant, and PowerSGD's products (n·m·r summed)."""
    params, ready = layout
    sizes = [p.numel() * p.element_size() for p in params]
    if k["stack"] == "ddp":  # DDP's reducer: a 1 MiB first bucket, then the cap
        plan = plan_buckets(sizes, [0] * len(sizes), int(k["bucket_mb"] * 2**20), first_cap_bytes=FIRST_BUCKET_BYTES)
    else:                   # hvdkit's Horovod reducer, its own planner
        plan = plan_allreduce_buckets(params, int(k["bucket_mb"] * 2**20))
    if k["compression"] != "powersgd":
        return messages(sizes, plan, 0.5 if k["compression"] == "fp16" else 1.0, ready), 0.0
    out, products = [], 0.0
    for b, bucket in zip([b for b in plan if b], messages(sizes, plan, ready=ready)):  # its rest, P, Q
        w = wire_elements([params[i].shape for i in b], k["rank"])
        products += w["products"]
        size = params[b[0]].element_size()
        out += [Message(size * w[part], bucket.ready) for part in ("plain", "p", "q") if w[part]]
    return out, products


# -- fitting ------------------------------------------------------------------------------------

PARAMS = ["backward_share", *(f"{s}: cpu s/GB" for s in STACKS), *(f"{s}: ms/collective" for s in STACKS),
          "powersgd ns/(n·m·r)", "fp16 ns/element"]
LOWER = [0.0, *[0.0] * 3, *[0.0] * 3, 0.0, 0.0]
UPPER = [1.0, *[5.0] * 3, *[50.0] * 3, 10.0, 50.0]
START = [0.6, *[0.2] * 3, *[1.0] * 3, 1.0, 1.0]


def overheads(theta: Sequence[float], stack: str, cycle_s: float, products: float, cast: float) -> Overheads:
    """This machine's overheads for one stack, from the fitted vector (units as in PARAMS)."""
    i = STACKS.index(stack)
    return Overheads(backward_share=theta[0], cpu_s_per_byte=theta[1 + i] / 1e9, message_s=theta[4 + i] / 1e3,
                     extra_s=theta[7] * 1e-9 * products + theta[8] * 1e-9 * cast,
                     cycle_s=cycle_s if stack.startswith("horovod") else 0.0)


def predict(point: dict[str, Any], theta: Sequence[float]) -> float:
    k = point["knobs"]
    over = overheads(theta, k["stack"], k["cycle_s"], point["products"], point["cast"])
    return step_time(point["compute_s"], point["messages"], 2, point["link"], over)["step_s"]


def fit(points: list[dict[str, Any]]) -> list[float]:
    """Least squares on log(predicted / measured), from a few fixed starting points (the step
    has kinks: max() and Horovod's ticks), keeping the best."""
    from scipy.optimize import least_squares

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.array([math.log(predict(p, list(theta)) / p["measured_s"]) for p in points])

    starts = [START, *([min(max(x * f, lo), hi) for x, lo, hi in zip(START, LOWER, UPPER)] for f in (0.3, 3.0)),
              [(lo + hi) / 4 for lo, hi in zip(LOWER, UPPER)]]
    best = min((least_squares(residuals, x0, bounds=(LOWER, UPPER), method="trf") for x0 in starts),
               key=lambda r: r.cost)
    return list(best.x)


Layout = tuple[list[torch.nn.Parameter], list[float]]


def measured_points(runs: list[Path], params: dict[str, Layout]) -> tuple[list[dict], dict]:
    """Every (link, model, variant) median the network bench measured, with the model's inputs."""
    reports = [json.loads(run.read_text()) for run in runs if run.exists()]
    rows = [row for rep in reports for row in rep["rows"]]
    rounds: dict[tuple[str, str, str], list[float]] = {}  # each round's median: how stable a point is
    for rep in reports:
        for b in rep["blocks"]:
            rounds.setdefault((b["link"], b["model"], b["variant"]), []).append(statistics.median(b["step_s"]))
    links: dict[str, Link] = {}
    for label in dict.fromkeys(r["link"] for r in rows):
        mine = [r for r in rows if r["link"] == label]
        # B through the origin: the links have no delay configured, so a collective's fixed
        # cost is the stack's (fitted), not the wire's; two sizes cannot pin down an alpha
        links[label] = Link(0.0, sum(r["grad_bytes"] for r in mine) / sum(r["allreduce_s"] for r in mine))
    points = []
    for r in rows:
        for variant, v in r["variants"].items():
            k = knobs(variant)
            msgs, products = collectives(params[r["model"]], k)
            per_round = rounds.get((r["link"], r["model"], variant), [v["median_s"]])
            points.append({"link_label": r["link"], "model": r["model"], "variant": variant, "knobs": k,
                           "round_spread": max(per_round) / min(per_round) - 1,
                           "compute_s": r["compute_s"], "measured_s": v["median_s"], "link": links[r["link"]],
                           "messages": msgs, "products": products,
                           "cast": sum(p.numel() for p in params[r["model"]][0]) if k["compression"] == "fp16" else 0})
    return points, links


def check(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Fit on every point; then refit without each link and predict that link's points."""
    theta = fit(points)
    for p in points:
        p["predicted_s"] = predict(p, theta)
    held: dict[str, Any] = {}
    for label in dict.fromkeys(p["link_label"] for p in points):
        rest = [p for p in points if p["link_label"] != label]
        if not rest:
            continue
        th = fit(rest)
        for p in points:
            if p["link_label"] == label:
                p["held_out_s"] = predict(p, th)
        held[label] = dict(zip(PARAMS, th))
    return {"theta": dict(zip(PARAMS, theta)), "held_out_theta": held}


def _err(p: dict[str, Any], key: str) -> float:
    return p[key] / p["measured_s"] - 1


def _within(points: list[dict[str, Any]], key: str) -> str:
    ok = sum(abs(_err(p, key)) <= WITHIN for p in points)
    errs = [abs(_err(p, key)) for p in points]
    return (f"{ok} of {len(points)} within ±{WITHIN:.0%} (median |error| {statistics.median(errs):.1%}, "
            f"largest {max(errs):.1%})")


# -- published results --------------------------------------------------------------------------

def _meta_layout(factory: Any, image: int, **kw: Any) -> tuple[list[int], list[float]]:
    """A torchvision architecture's parameter bytes and readiness, built and run on the meta
    device (no weights, no arithmetic) with a batch of two ``image`` x ``image`` pictures."""
    with torch.device("meta"):
        model = factory(**kw)
        example = torch.randn(2, 3, image, image)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return [p.numel() * 4 for p in params], ready_fractions(model, example)


def published() -> list[dict[str, Any]]:
    """The model on the hardware of two published scaling results; inputs and sources stated."""
    tvm = _torchvision()

    # time per image, P100 (TensorFlow's tf_cnn_benchmarks page, DGX-1, batch 64, synthetic);
    # ResNet-101 is not on that page: interpolated by FLOPs (He et al. 2016: 3.8/7.6/11.3 GFLOPs)
    # between its ResNet-50 (219 img/s) and ResNet-152 (91.8 img/s)
    r101 = 1 / 219 + (7.6 - 3.8) / (11.3 - 3.8) * (1 / 91.8 - 1 / 219)
    horovod: dict[str, Any] = {
               "source": "Horovod README / docs/benchmarks.rst: 128 servers x 4 Pascal GPUs, RoCE 25 Gbit/s, "
                         "tf_cnn_benchmarks, batch 64 per GPU",
               "workers": 512, "link": "25 Gbit/s", "gbit": 25.0, "batch": 64, "fusion_mb": 64.0, "cycle_ms": 5.0,
               "models": {"Inception V3": (tvm.inception_v3, {"init_weights": False, "aux_logits": False}, 1 / 142,
                                           0.90),
                          "ResNet-101": (tvm.resnet101, {}, r101, 0.90),
                          "VGG-16": (tvm.vgg16, {}, 1 / 154, 0.68)}}
    # ResNet-50 on a V100, FP32: NVIDIA DeepLearningExamples resnet50v1.5 (PyTorch), 367 img/s
    ddp: dict[str, Any] = {"source": "Li et al., VLDB 2020 (PyTorch DDP): 'near-linear scalability using 256 GPUs'; "
                     "V100 servers of 8 GPUs",
           "workers": 256, "link": "100 Gbit/s", "gbit": 100.0, "batch": 32, "fusion_mb": 25.0, "cycle_ms": 0.0,
           "models": {"ResNet-50": (tvm.resnet50, {}, 1 / 367, None)}}
    rows = []
    for study in (horovod, ddp):
        for name, (factory, kw, s_per_image, reported) in study["models"].items():
            sizes, ready = _meta_layout(factory, 299 if "Inception" in name else 224, **kw)
            nbytes = sum(sizes)
            plan = plan_buckets(sizes, [0] * len(sizes), int(study["fusion_mb"] * 2**20),
                                first_cap_bytes=None if study is horovod else FIRST_BUCKET_BYTES)
            compute = study["batch"] * s_per_image
            msgs = messages(sizes, plan, ready=ready)
            preds = {}
            for label, alpha, frac in (("alpha 10 us, line rate", 10e-6, 1.0), ("alpha 5 us, line rate", 5e-6, 1.0),
                                       ("alpha 20 us, 80% of line rate", 20e-6, 0.8)):
                link = Link(alpha, frac * study["gbit"] * 1e9 / 8)
                over = Overheads(backward_share=2 / 3, cycle_s=study["cycle_ms"] / 1e3)
                preds[label] = step_time(compute, msgs, study["workers"], link, over)["efficiency"]
            rows.append({"study": study["source"], "model": name, "workers": study["workers"], "link": study["link"],
                         "params_m": nbytes / 4e6, "grad_mb": nbytes / 1e6, "batch": study["batch"],
                         "compute_s": compute, "buckets": len(msgs), "predicted": preds, "reported": reported})
    return rows


# -- projection ---------------------------------------------------------------------------------

LINKS = {"10 Gbit/s": (10.0, 20e-6), "25 Gbit/s": (25.0, 10e-6), "100 Gbit/s": (100.0, 5e-6),
         "400 Gbit/s": (400.0, 3e-6)}
WORKERS = [8, 16, 32, 64, 128, 256, 512]
COMPUTE_S = [0.01, 0.03, 0.1]


def projection(params: dict[str, Layout]) -> list[dict[str, Any]]:
    """Predicted efficiency of hvdkit's defaults on an ideal GPU cluster (communication off the
    compute engine), and the step time that reaches 90% at each size."""
    rows = []
    for model, ps in params.items():
        msgs, _ = collectives(ps, knobs("ddp default"))
        grad = sum(p.numel() * p.element_size() for p in ps[0])
        for label, (gbit, alpha) in LINKS.items():
            link = Link(alpha, gbit * 1e9 / 8)
            eff = {str(c): [step_time(c, msgs, n, link)["efficiency"] for n in WORKERS] for c in COMPUTE_S}
            need = []
            for n in WORKERS:
                lo, hi = 1e-4, 100.0
                for _ in range(60):  # efficiency grows with compute: bisect for 0.9
                    mid = math.sqrt(lo * hi)
                    lo, hi = (mid, hi) if step_time(mid, msgs, n, link)["efficiency"] < 0.9 else (lo, mid)
                need.append(hi)
            rows.append({"model": model, "grad_mb": grad / 2**20, "link": label, "alpha_s": alpha,
                         "efficiency": eff, "compute_for_90": need})
    return rows


# -- report -------------------------------------------------------------------------------------

def plot(points: list[dict[str, Any]], path: Path) -> None:
    """Predicted against measured step time, fitted on all links and with the link held out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 6))
    colors = {label: c for label, c in zip(dict.fromkeys(p["link_label"] for p in points),
                                             ("tab:green", "tab:blue", "tab:red", "tab:purple"))}
    for ax, key, title in ((axes[0], "predicted_s", "fitted on every link"),
                           (axes[1], "held_out_s", "each link predicted by a fit without it")):
        lo = min(min(p["measured_s"], p[key]) for p in points) * 0.9
        hi = max(max(p["measured_s"], p[key]) for p in points) * 1.1
        ax.plot([lo, hi], [lo, hi], "k-", lw=1)
        ax.fill_between([lo, hi], [lo * (1 - WITHIN), hi * (1 - WITHIN)], [lo * (1 + WITHIN), hi * (1 + WITHIN)],
                        color="0.9", label=f"±{WITHIN:.0%}")
        for label, c in colors.items():
            for model, marker in (("resnet18", "o"), ("gpt", "s")):
                mine = [p for p in points if p["link_label"] == label and p["model"] == model]
                if mine:
                    ax.scatter([p["measured_s"] for p in mine], [p[key] for p in mine], c=c, marker=marker,
                               label=f"{model}, link {label}")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured seconds per step (median)")
        ax.set_ylabel("predicted seconds per step")
        ax.set_title(f"{title}: {_within(points, key).split(' (')[0]}")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def markdown(report: dict[str, Any]) -> str:
    pts = report["points"]
    lines = ["## Fit on this machine's measurements", "",
             f"Points: every (link, model, variant) median of the network bench ({', '.join(report['runs'])}).", "",
             f"- fitted on all links: {_within(pts, 'predicted_s')}",
             f"- each link predicted by a fit on the others only: {_within(pts, 'held_out_s')}; by link: "
             + "; ".join(f"{label} {_within([p for p in pts if p['link_label'] == label], 'held_out_s')}"
                         for label in report["fit"]["held_out_theta"]), "",
             "Links (B = gradient bytes / measured allreduce seconds, through the origin): "
             + ", ".join(f"{k} {v['bandwidth_Bps'] / 1e6:.0f} MB/s" for k, v in report["links"].items()), "",
             "Fitted overheads of this machine:", "", "| parameter | all links | "
             + " | ".join(f"without {k}" for k in report["fit"]["held_out_theta"]) + " |",
             "|---|---|" + "---|" * len(report["fit"]["held_out_theta"])]
    for name, value in report["fit"]["theta"].items():
        lines.append(f"| {name} | {value:.3g} | "
                     + " | ".join(f"{t[name]:.3g}" for t in report["fit"]["held_out_theta"].values()) + " |")
    misses = [p for p in pts if abs(_err(p, "predicted_s")) > WITHIN]
    unstable = [p for p in misses if p["round_spread"] > WITHIN]
    lines += ["", f"Of the {len(misses)} points outside ±{WITHIN:.0%}, {len(unstable)} were themselves unstable: "
              f"their two rounds differ by more than {WITHIN:.0%} (the median point's rounds differ by "
              f"{statistics.median(p['round_spread'] for p in pts):.1%}).", "",
              "| link | model | variant | measured s | rounds differ | predicted s | error | held-out prediction "
              "| error |", "|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(pts, key=lambda p: -abs(_err(p, "predicted_s"))):
        lines.append(f"| {p['link_label']} | {p['model']} | {p['variant']} | {p['measured_s']:.3f} | "
                     f"{p['round_spread']:.0%} | {p['predicted_s']:.3f} | {_err(p, 'predicted_s'):+.1%} | "
                     f"{p['held_out_s']:.3f} | {_err(p, 'held_out_s'):+.1%} |")
    lines += ["", "## Published results", "",
              "| study | model | GPUs | link | params | grad MB | batch/GPU | compute s/step | collectives "
              "| predicted efficiency (alpha 10 us, line rate) | range (alpha 5-20 us, 80-100% of line rate) "
              "| reported |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["published"]:
        p = r["predicted"]
        lo, hi = min(p.values()), max(p.values())
        rep = f"{r['reported']:.0%}" if r["reported"] is not None else "near-linear (no figure value here)"
        lines.append(f"| {r['study'].split(':')[0]} | {r['model']} | {r['workers']} | {r['link']} | "
                     f"{r['params_m']:.1f}M | {r['grad_mb']:.0f} | {r['batch']} | {r['compute_s']:.3f} | "
                     f"{r['buckets']} "
                     f"| {p['alpha 10 us, line rate']:.0%} | {lo:.0%}-{hi:.0%} | {rep} |")
    lines += ["", "## Projection: hvdkit's DDP defaults on a GPU cluster", ""]
    for r in report["projection"]:
        lines += [f"**{r['model']}** ({r['grad_mb']:.1f} MiB of gradients), {r['link']} "
                  f"(alpha {r['alpha_s'] * 1e6:.0f} us)", "",
                  "| per-GPU compute s/step | " + " | ".join(str(n) for n in WORKERS) + " |",
                  "|---|" + "---|" * len(WORKERS)]
        for c, effs in r["efficiency"].items():
            lines.append(f"| {float(c):.3f} | " + " | ".join(f"{e:.0%}" for e in effs) + " |")
        lines.append("| **needed for 90%** | " + " | ".join(f"{s * 1e3:.1f} ms" for s in r["compute_for_90"]) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=Path, nargs="*", default=RUNS, help="network bench results (network.json)")
    ap.add_argument("--out", type=Path, required=True)
    opts = ap.parse_args()
    runs = [r for r in opts.runs if r.exists()]
    if not runs:
        raise SystemExit("no network bench result found: run benchmarks/network.py first (see its --help)")
    models = list(dict.fromkeys(row["model"] for r in runs for row in json.loads(r.read_text())["rows"]))
    params = layouts(models)
    points, links = measured_points(runs, params)
    fitted = check(points)
    report: dict[str, Any] = {"runs": [str(r.relative_to(ROOT)) if r.is_relative_to(ROOT) else str(r) for r in runs],
              "links": {k: {"alpha_s": v.alpha_s, "bandwidth_Bps": v.bandwidth} for k, v in links.items()},
              "fit": fitted, "within": WITHIN,
              "points": [{k: v for k, v in p.items() if k not in ("messages", "link")}
                         | {"collectives": len(p["messages"])} for p in points],
              "published": published(), "projection": projection(params)}
    opts.out.mkdir(parents=True, exist_ok=True)
    (opts.out / "scaling_model.json").write_text(json.dumps(report, indent=1))
    (opts.out / "scaling_model.md").write_text(markdown(report))
    plot(report["points"], opts.out / "predicted_vs_measured.png")
    print(markdown(report))


if __name__ == "__main__":
    main()
