"""What gradient compression costs in quality: held-out metrics with and without it, both backends.

Runs ``hvdkit run -np 2`` exactly as users type it, on real data shipped with the packages:
the digits CNN (scikit-learn's scans, 4 epochs, validation accuracy) and the example char GPT
(the Python standard library's source, 200 steps, validation loss in nats per character),
each with ``--compression none``, ``fp16`` and ``powersgd`` (its defaults) on Horovod and on
DDP, over ``--seeds`` seeds. A compressed setting *meets* its tolerance when its mean over
seeds is within it of the uncompressed mean on the same backend:

* digits: validation accuracy at most 1.0 percentage point below;
* char GPT: validation loss at most 0.05 nats/char above (about 2% of the ~2.3 reached).

    python benchmarks/compression_quality.py --out docs/bench/compression/quality.json

Writes the JSON and a markdown table next to it (``quality.md``). Step time is not judged
here: on this machine the link costs nothing, so see the network bench for what it buys.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = str(ROOT / "examples" / "models.py")
HVDKIT = [sys.executable, "-m", "hvdkit"]
WORKLOADS = {
    "digits": {"args": ["--model", f"{MODELS}:digits_cnn", "--epochs", "4", "--batch-size", "32",
                        "--optimizer", "adamw", "--lr", "0.002"],
               "metric": "val_accuracy", "better": "higher", "tolerance": 0.01},
    "char-gpt": {"args": ["--model", f"{MODELS}:gpt", "--model-arg", "vocab_size=96", "--model-arg", "n_layer=6",
                          "--model-arg", "block_size=32", "--task", "language-model", "--max-steps", "200",
                          "--batch-size", "32", "--optimizer", "adamw", "--lr", "0.0015", "--warmup-epochs", "0.03",
                          "--lr-schedule", "cosine", "--min-lr-ratio", "0.1", "--weight-decay", "0.1",
                          "--clip-grad-norm", "1.0", "--eval-batch-size", "256"],
                 "metric": "val_loss", "better": "lower", "tolerance": 0.05},
}
COMPRESSIONS = ("none", "fp16", "powersgd")


def _data(work: Path) -> dict[str, list[str]]:
    """The two data sets, imported from what ships inside scikit-learn and Python."""
    subprocess.run([*HVDKIT, "data", "import-digits", str(work / "digits")], check=True, capture_output=True)
    subprocess.run([*HVDKIT, "data", "import-text", str(work / "text"), "--block", "32", "--max-bytes", "1000000"],
                   check=True, capture_output=True)
    return {name: ["--data", str(work / d / "train.h5"), "--val-data", str(work / d / "val.h5")]
            for name, d in (("digits", "digits"), ("char-gpt", "text"))}


def _run(work: Path, backend: str, args: list[str]) -> dict:
    metrics = work / "m.json"
    metrics.unlink(missing_ok=True)
    start = time.perf_counter()
    proc = subprocess.run([*HVDKIT, "run", "-np", "2", "--backend", backend, "--log-dir", str(work), "--", *args,
                           "--log-every", "0", "--metrics-file", str(metrics)], capture_output=True, text=True,
                          timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"failed: hvdkit run --backend {backend} -- {' '.join(args)}\n{proc.stdout[-2000:]}"
                         f"{proc.stderr[-2000:]}")
    m = json.loads(metrics.read_text())
    return {**{k: m[k] for k in ("val_accuracy", "val_loss", "param_digest") if k in m},
            "compression_report": m.get("compression", {}), "wall_s": time.perf_counter() - start}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--only", choices=tuple(WORKLOADS), default=None)
    ap.add_argument("--summarize", action="store_true", help="only rewrite the summary of --out's rows")
    ap.add_argument("--compressions", default=",".join(COMPRESSIONS),
                    help="the --compression values to compare with none (e.g. powersgd:rank=4)")
    opts = ap.parse_args()
    compressions = ["none", *(c for c in opts.compressions.split(",") if c != "none")]
    earlier = json.loads(opts.out.read_text())["rows"] if opts.out.exists() else []
    if opts.summarize:
        write(opts.out, earlier, opts.seeds)
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvdkit-quality-") as tmp:
        work = Path(tmp)
        data = _data(work)
        for name, w in WORKLOADS.items():
            if opts.only and name != opts.only:
                continue
            for backend in ("horovod", "ddp"):
                for comp in compressions:
                    for seed in range(opts.seeds):
                        args = [*w["args"], *data[name], "--compression", comp, "--seed", str(seed)]
                        r = _run(work, backend, args)
                        rows.append({"workload": name, "backend": backend, "compression": comp, "seed": seed,
                                     "metric": w["metric"], "value": r[w["metric"]], **r})
                        print(f"{name} {backend} {comp} seed {seed}: {w['metric']} {r[w['metric']]:.4f}", flush=True)
    def key(r: dict) -> tuple:
        return r["workload"], r["backend"], r["compression"], r["seed"]

    measured = {key(r) for r in rows}  # a setting measured again replaces its earlier rows
    write(opts.out, [r for r in earlier if key(r) not in measured] + rows, opts.seeds)


def write(out: Path, rows: list[dict], seeds: int) -> None:
    """The summary (mean over seeds against none, per backend) as JSON and markdown."""
    compressions = ["none", *sorted({r["compression"] for r in rows} - {"none"})]
    summary = []
    for name, w in WORKLOADS.items():
        for backend in ("horovod", "ddp"):
            def values(comp: str, name: str = name, backend: str = backend) -> list[float]:
                return [r["value"] for r in rows if (r["workload"], r["backend"], r["compression"]) ==
                        (name, backend, comp)]
            base = values("none")
            if not base:
                continue
            for comp in compressions:
                vals = values(comp)
                if not vals:
                    continue
                delta = statistics.mean(vals) - statistics.mean(base)
                worse = -delta if w["better"] == "higher" else delta
                summary.append({"workload": name, "backend": backend, "compression": comp, "metric": w["metric"],
                                "mean": statistics.mean(vals), "values": vals, "delta_vs_none": delta,
                                "tolerance": w["tolerance"], "met": worse <= w["tolerance"]})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "summary": summary, "seeds": seeds,
                                    "tolerances": {k: (w["metric"], w["better"], w["tolerance"])
                                                   for k, w in WORKLOADS.items()}}, indent=1))
    lines = ["| workload | backend | compression | metric | mean over seeds | seeds | vs none | tolerance | met |",
             "|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['workload']} | {s['backend']} | {s['compression']} | {s['metric']} | {s['mean']:.4f} | "
                     f"{', '.join(f'{v:.4f}' for v in s['values'])} | {s['delta_vs_none']:+.4f} | "
                     f"{s['tolerance']} | {'yes' if s['met'] else 'NO'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
