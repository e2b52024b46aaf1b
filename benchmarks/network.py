"""Step time where the link costs something: 2 ranks, one per node, over a shaped fabric link.

Every variant is ``hvdkit run -np 2 -H node1:1,node2:1 --iface eth1`` typed on node1 of the
local cluster (scripts/local-cluster.sh), exactly as a user on a login node would, with the
link between the nodes shaped by ``scripts/local-cluster.sh link RATE`` (``off``: unshaped).
Step time is the global batch over the loop's own throughput in the epochs after the first
(start-up and PowerSGD's plain first steps excluded). Two floors from the same run:

* compute: the same training with no communication (two one-rank processes side by side);
* overlap: max(compute, the allreduce of the model's gradient bytes on this link, measured
  with gloo between the nodes): what perfect overlap of communication with backward reaches.

Variants run in rotated order every round; ratios to DDP's default carry a bootstrap
interval over rounds (hvdkit.bench.stats). The nodes share this machine's cores: one thread
per rank. Not part of ``make test``.

    scripts/local-cluster.sh up
    python benchmarks/network.py --links 1gbit --models resnet18,gpt --rounds 2 --out docs/bench/network
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from hvdkit.advice import bench_file  # noqa: E402
from hvdkit.bench.paths import clean_env, floor_steps, prepare_models, workloads  # noqa: E402
from hvdkit.bench.stats import ratio_ci, summarize  # noqa: E402

CLUSTER = ROOT / "scripts" / "local-cluster.sh"
LINK_WORKER = ROOT / "tests" / "workers" / "link_allreduce.py"
DDP = "ddp default"
# name -> (hvdkit run options, hvdkit train options): every knob the issue names
VARIANTS: dict[str, tuple[list[str], list[str]]] = {
    "horovod default": (["--backend", "horovod"], []),
    "horovod fp16": (["--backend", "horovod"], ["--compression", "fp16"]),
    "horovod powersgd": (["--backend", "horovod"], ["--compression", "powersgd"]),
    "horovod gloo": (["--backend", "horovod", "--controller", "gloo"], []),
    "horovod fusion=0MB": (["--backend", "horovod"], ["--fusion-threshold-mb", "0"]),
    "horovod fusion=32MB": (["--backend", "horovod"], ["--fusion-threshold-mb", "32"]),
    "horovod cycle=5ms": (["--backend", "horovod"], ["--cycle-time-ms", "5"]),
    "horovod bucket=5MB": (["--backend", "horovod"], ["--bucket-cap-mb", "5"]),
    "horovod bucket=100MB": (["--backend", "horovod"], ["--bucket-cap-mb", "100"]),
    DDP: (["--backend", "ddp"], []),
    "ddp bucket=5MB": (["--backend", "ddp"], ["--bucket-cap-mb", "5"]),
    "ddp bucket=100MB": (["--backend", "ddp"], ["--bucket-cap-mb", "100"]),
    "ddp fp16": (["--backend", "ddp"], ["--compression", "fp16"]),
    "ddp powersgd": (["--backend", "ddp"], ["--compression", "powersgd"]),
}


SAVED = ""  # --use-saved: the bench result the runs may read; none by default


def _env() -> dict[str, str]:
    """The paths bench's clean environment, one thread per rank (the nodes share the cores),
    and no saved bench result unless --use-saved: "default" is then hvdkit's built-in default,
    not one that an earlier run of this bench chose (hvdkit.advice.measured_controller)."""
    return clean_env({"OMP_NUM_THREADS": "1", "HVDKIT_NETWORK_BENCH": SAVED})


def _cluster(*args: str) -> str:
    proc = subprocess.run([str(CLUSTER), *args], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"scripts/local-cluster.sh {' '.join(args)}: {(proc.stdout + proc.stderr).strip()[-500:]}")
    return proc.stdout


def _train(spec: dict[str, Any], variant: str, epochs: int, steps: int, metrics: Path, extra_env: dict[str, str]
           ) -> dict[str, Any]:
    run, train = VARIANTS[variant]
    argv = [str(CLUSTER), "exec", "node1", "--", "env", *(f"{k}={v}" for k, v in extra_env.items()),
            sys.executable, "-m", "hvdkit", "run", "-np", "2", "-H", "node1:1,node2:1", "--iface", "eth1", *run,
            "--", *spec["args"], *train, "--epochs", str(epochs), "--steps-per-epoch", str(steps),
            "--batch-size", str(spec["batch"]), "--progress", "lines", "--metrics-file", str(metrics)]
    metrics.unlink(missing_ok=True)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=_env())
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(metrics.read_text())


def _allreduce_s(nbytes: int, tmp: Path) -> float:
    """Median seconds of a gloo allreduce of ``nbytes`` between node1 and node2 on eth1."""
    mib = max(1, math.ceil(nbytes / 2**20))
    store = tmp / f"store-{time.monotonic_ns()}"
    procs = [subprocess.Popen([str(CLUSTER), "exec", f"node{r + 1}", "--", sys.executable, str(LINK_WORKER), str(r),
                               str(store), str(mib), "5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_env(), start_new_session=True) for r in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"allreduce between the nodes failed: {outs}")
    busbw = statistics.median(json.loads(outs[0].strip().splitlines()[-1])["busbw"])
    return mib * 2**20 / busbw  # two ranks: bus bytes = bytes x 2(n-1)/n = bytes


def summarize_report(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with its rows (re)computed from its blocks: per (link, model) the compute
    floor, the overlap floor and each variant's quartiles and ratio to DDP's default. The
    allreduce floor and gradient bytes come from ``floors``/``grad_bytes``, or from the rows
    of a report written before they were kept apart."""
    blocks, old = report["blocks"], {(r["link"], r["model"]): r for r in report.get("rows", [])}
    floors = report.get("floors") or {k[0]: {} for k in old}
    grad_bytes = dict(report.get("grad_bytes") or {})
    for (link, model), r in old.items():
        floors.setdefault(link, {}).setdefault(model, {"allreduce_s": r["allreduce_s"]})
        grad_bytes.setdefault(model, r["grad_bytes"])
    rows = []
    for link in report["links"]:
        for model in report["models"]:
            def of(v: str, link: str = link, model: str = model) -> list[list[float]]:
                return [b["step_s"] for b in blocks if (b["link"], b["model"], b["variant"]) == (link, model, v)]
            compute = statistics.median(t for blk in of("floor") for t in blk)
            comm = floors[link][model]["allreduce_s"]
            overlap = max(compute, comm)
            row: dict[str, Any] = {"link": link, "model": model, "grad_bytes": grad_bytes[model], "compute_s": compute,
                                   "allreduce_s": comm, "overlap_floor_s": overlap, "variants": {}}
            for v in report["variants"]:
                sm = summarize([t for blk in of(v) for t in blk])
                point, lo, hi = ratio_ci(of(v), of(DDP))
                row["variants"][v] = {"median_s": sm["median"], "p25_s": sm["p25"], "p75_s": sm["p75"],
                                      "over_ddp": [point, lo, hi], "over_overlap_floor": sm["median"] / overlap}
            rows.append(row)
    return {**report, "floors": floors, "grad_bytes": grad_bytes, "rows": rows}


def plot(report: dict[str, Any], path: Path) -> None:
    """One panel per (link, model): median step time of each variant with its quartiles, and
    the two floors as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["rows"]
    fig, axes = plt.subplots(1, len(rows), figsize=(6.5 * len(rows), 6), squeeze=False)
    for ax, row in zip(axes[0], rows):
        items = sorted(row["variants"].items(), key=lambda kv: kv[1]["median_s"])
        names = [k for k, _ in items]
        med = [v["median_s"] for _, v in items]
        err = [[v["median_s"] - v["p25_s"] for _, v in items], [v["p75_s"] - v["median_s"] for _, v in items]]
        colors = ["tab:blue" if k.startswith("horovod") else "tab:orange" for k in names]
        ax.barh(names, med, xerr=err, color=colors)
        ax.axvline(row["compute_s"], color="k", linestyle=":", label=f"compute floor {row['compute_s']:.3f} s")
        ax.axvline(row["overlap_floor_s"], color="k", linestyle="--",
                   label=f"overlap floor {row['overlap_floor_s']:.3f} s")
        ax.invert_yaxis()
        ax.set_xlabel("seconds per step (median, p25-p75)")
        ax.set_title(f"{row['model']}, 2 ranks on 2 nodes, link {row['link']}")
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write_outputs(report: dict[str, Any], out: Path) -> str:
    """OUT/network.json, network.md (returned) and network.png of a summarized report."""
    (out / "network.json").write_text(json.dumps(report, indent=1))
    lines = []
    for row in report["rows"]:
        lines += [f"### {row['model']}, link {row['link']}", "",
                  f"gradient {row['grad_bytes'] / 2**20:.1f} MiB; compute floor {row['compute_s']:.3f} s/step; "
                  f"allreduce of the gradient on this link {row['allreduce_s']:.3f} s; overlap floor "
                  f"{row['overlap_floor_s']:.3f} s/step", "",
                  "| variant | step (s), median [p25, p75] | x DDP default [95% CI] | x overlap floor |",
                  "|---|---|---|---|"]
        for v, s in sorted(row["variants"].items(), key=lambda kv: kv[1]["median_s"]):
            point, lo, hi = s["over_ddp"]
            lines.append(f"| {v} | {s['median_s']:.3f} [{s['p25_s']:.3f}, {s['p75_s']:.3f}] | {point:.2f}x "
                         f"[{lo:.2f}, {hi:.2f}] | {s['over_overlap_floor']:.2f}x |")
        lines.append("")
    lines += [f"Note: {note}" for note in report.get("corrections", [])]
    text = "\n".join(lines)
    (out / "network.md").write_text(text)
    plot(report, out / "network.png")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--links", default="1gbit", help="comma-separated RATE[,DELAY] specs or 'off' (unshaped), "
                                                    "separated by ';' when a delay is given")
    ap.add_argument("--models", default="resnet18,gpt")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--no-save", action="store_true",
                    help="do not copy the result to where hvdkit train looks for advice (hvdkit.advice)")
    ap.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / "hvdkit-network-data",
                    help="where the imported data sets are kept between runs")
    ap.add_argument("--plot-only", action="store_true", help="redraw OUT/network.png from OUT/network.json")
    ap.add_argument("--use-saved", type=Path, default=None,
                    help="let the runs read this saved bench result, as a user's runs on this cluster do "
                         "(the defaults it changes: the controller across hosts); such a run is never saved")
    ap.add_argument("--resummarize", action="store_true",
                    help="recompute OUT/network.json's rows from its blocks and rewrite its table and plot")
    opts = ap.parse_args()
    if opts.plot_only:
        plot(json.loads((opts.out / "network.json").read_text()), opts.out / "network.png")
        return
    if opts.resummarize:
        print(write_outputs(summarize_report(json.loads((opts.out / "network.json").read_text())), opts.out))
        return
    global SAVED
    if opts.use_saved is not None:
        if not opts.use_saved.is_file():
            raise SystemExit(f"--use-saved {opts.use_saved}: no such file; save one with a run of this bench")
        SAVED = str(opts.use_saved.resolve())
    variants = [v.strip() for v in opts.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; valid: {', '.join(VARIANTS)}")
    if DDP not in variants:
        variants.append(DDP)
    links = [s.strip() for s in opts.links.split(";" if ";" in opts.links else ",")]
    if "down" in _cluster("status").splitlines()[0]:
        raise SystemExit("the local cluster is down: scripts/local-cluster.sh up")
    opts.out.mkdir(parents=True, exist_ok=True)
    data = opts.data
    models, extra_env, notes = prepare_models(data, [m.strip() for m in opts.models.split(",")])
    blocks: list[dict[str, Any]] = []
    floors: dict[str, dict[str, Any]] = {}
    grad_bytes: dict[str, int] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="hvdkit-network-") as tmp_name:  # the nodes share the file system
            tmp = Path(tmp_name)
            for link in links:
                _cluster("link", link)
                for r in range(opts.rounds):
                    for model in models:
                        spec = workloads(data)[model]
                        order = [*variants, "floor"]
                        order = order[r % len(order):] + order[:r % len(order)]
                        for variant in order:
                            if variant == "floor":
                                steps_s = floor_steps(spec, 2, opts.epochs, opts.steps, {**_env(), **extra_env},
                                                      tmp, 1800)
                            else:
                                m = _train(spec, variant, opts.epochs, opts.steps, tmp / "m.json", extra_env)
                                steps_s = [2 * spec["batch"] / h["samples_per_sec"] for h in m["history"][1:]]
                                grad_bytes[model] = m["memory"][0]["grads"]
                            blocks.append({"link": link, "round": r, "model": model, "variant": variant,
                                           "step_s": steps_s})
                            print(f"{link} round {r} {model} {variant}: {statistics.median(steps_s):.3f} s/step",
                                  flush=True)
                for model in models:
                    floors.setdefault(link, {})[model] = {"allreduce_s": _allreduce_s(grad_bytes[model], tmp)}
    finally:
        _cluster("link", "off")
    report = summarize_report({"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "links": links, "models": models,
                               "variants": variants, "options": {v: VARIANTS[v][1] for v in variants},
                               "rounds": opts.rounds, "epochs": opts.epochs, "steps": opts.steps,
                               "notes": notes + ([f"runs read the saved bench result {SAVED}"] if SAVED else []),
                               "floors": floors, "grad_bytes": grad_bytes, "blocks": blocks})
    text = write_outputs(report, opts.out)
    saved = bench_file()
    if SAVED:  # measured under an earlier result's choices: not a clean result to decide from
        print("not saved for hvdkit's advice and controller choice: this run read a saved result (--use-saved)")
    elif not opts.no_save and saved is not None:  # where training and hvdkit run look (hvdkit.advice)
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text((opts.out / "network.json").read_text())
        print(f"saved for hvdkit's advice and controller choice: {saved}")
    print(text)

if __name__ == "__main__":
    main()
