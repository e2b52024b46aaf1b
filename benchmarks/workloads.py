"""The README's example table: each example model on its real data, both backends, 2 ranks.

    python benchmarks/workloads.py --out docs/workloads [--only digits,gpt,resnet18]

Runs exactly what a user runs (``hvdkit run -np 2 --backend B -- ...``, default launcher),
one example at a time, the two backends alternated, and writes ``workloads.json`` (every
command, metric and epoch record) and ``workloads.md`` (the table). samples/s is the median
over the epochs after the first (start-up and the first epoch's allocations excluded).
Run it on a quiet machine: the numbers are wall-clock throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models.py"
COMPAT = ROOT / "tests" / "compat"  # torchvision's CUDA-only wheel on a CPU torch (see there)
HVDKIT = [sys.executable, "-m", "hvdkit"]


def examples(data: Path) -> dict[str, dict]:
    return {
        "digits": {
            "title": "CNN (examples/models.py:digits_cnn)", "data": "sklearn digits, 8x8, 1,497 train / 300 val",
            "args": ["--model", f"{MODELS}:digits_cnn", "--data", f"{data}/digits/train.h5",
                     "--val-data", f"{data}/digits/val.h5", "--epochs", "8", "--batch-size", "32",
                     "--optimizer", "adamw", "--lr", "0.002"],
            "metric": "val_accuracy"},
        "gpt": {
            "title": "char GPT (examples/models.py:gpt), bf16", "data": "Python stdlib source, 1 MB, 96 chars",
            "args": ["--model", f"{MODELS}:gpt", "--model-arg", "vocab_size=96", "--model-arg", "n_layer=6",
                     "--model-arg", "block_size=32", "--task", "language-model", "--precision", "bf16",
                     "--data", f"{data}/text/train.h5", "--val-data", f"{data}/text/val.h5", "--epochs", "2",
                     "--batch-size", "32", "--optimizer", "adamw", "--lr", "0.0015", "--warmup-epochs", "0.03",
                     "--lr-schedule", "cosine", "--min-lr-ratio", "0.1", "--weight-decay", "0.1",
                     "--clip-grad-norm", "1.0", "--eval-batch-size", "256"],
            "metric": "val_loss"},
        "resnet18": {
            "title": "ResNet-18 (torchvision.models:resnet18)", "data": "sklearn digits, 32x32 RGB, 1,497 / 300",
            "args": ["--model", "torchvision.models:resnet18", "--model-arg", "num_classes=10",
                     "--data", f"{data}/digits32/train.h5", "--val-data", f"{data}/digits32/val.h5",
                     "--epochs", "3", "--batch-size", "32", "--lr", "0.02", "--weight-decay", "0.0005"],
            "metric": "val_accuracy", "env": {"PYTHONPATH": str(COMPAT)}},
    }


def prepare(data: Path) -> dict:
    """Import the data once; returns the text corpus's baselines."""
    for name, extra in (("digits", []), ("digits32", ["--image-size", "32", "--channels", "3"])):
        if not (data / name / "val.h5").exists():
            subprocess.run([*HVDKIT, "data", "import-digits", str(data / name), *extra], check=True)
    if not (data / "text" / "val.h5").exists():
        subprocess.run([*HVDKIT, "data", "import-text", str(data / "text"), "--block", "32",
                        "--max-bytes", "1000000"], check=True)
    import h5py

    with h5py.File(data / "text" / "train.h5", "r") as f:
        return {k: float(f.attrs[k]) for k in ("unigram_entropy_nats", "unigram_val_xent_nats")}


def param_count(example: dict) -> int:
    """Parameters of the example's model, built the way training builds it."""
    code = ("import sys, json; from hvdkit.models import build_model; from hvdkit.factories import parse_args; "
            "a = sys.argv[1:]; m = a[a.index('--model') + 1]; "
            "args = parse_args([a[i + 1] for i, x in enumerate(a) if x == '--model-arg']); "
            "print(sum(p.numel() for p in build_model(m, args=args).parameters()))")
    env = {**os.environ, **example.get("env", {})}
    out = subprocess.run([sys.executable, "-c", code, *example["args"]], env=env, check=True,
                         capture_output=True, text=True)
    return int(out.stdout.strip())


def run_one(example: dict, backend: str, out: Path, name: str) -> dict:
    metrics = out / f"{name}-{backend}.json"
    argv = [*HVDKIT, "run", "-np", "2", "--backend", backend, "--", *example["args"], "--metrics-file", str(metrics)]
    env = {**os.environ, **example.get("env", {})}
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name} on {backend} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    m = json.loads(metrics.read_text())
    rates = [r["samples_per_sec"] for r in m["history"][1:]] or [r["samples_per_sec"] for r in m["history"]]
    return {"command": " ".join(argv[2:]), "seconds": round(seconds, 1), "epochs": len(m["history"]),
            "metric": m[example["metric"]], "final_loss": m["final_loss"], "samples_per_sec": statistics.median(rates),
            "history": m["history"], "params_identical": m["params_identical"], "digest": m["param_digest"],
            "topology": m["topology"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "workloads")
    ap.add_argument("--data", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "hvdkit-workloads")
    ap.add_argument("--only", default="digits,gpt,resnet18")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    baselines = prepare(args.data)
    chosen = {k: v for k, v in examples(args.data).items() if k in args.only.split(",")}
    import torch

    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores", "torch": torch.__version__, "python": platform.python_version(),
              "text_baselines_nats": baselines, "examples": {}}
    for name, example in chosen.items():
        runs = {}
        for backend in ("horovod", "ddp"):  # alternated: one after the other, same conditions
            runs[backend] = run_one(example, backend, args.out, name)
            print(f"{name:9} {backend:8} {example['metric']} {runs[backend]['metric']:.4f} "
                  f"{runs[backend]['samples_per_sec']:.0f} samples/s ({runs[backend]['seconds']} s)", flush=True)
        report["examples"][name] = {**{k: example[k] for k in ("title", "data", "metric")},
                                    "params": param_count(example), "runs": runs}
    (args.out / "workloads.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "workloads.md").write_text(table(report))
    print(table(report))


def table(report: dict) -> str:
    lines = [f"Measured {report['date']} on {report['machine']}, torch {report['torch']}, 2 ranks, "
             "`hvdkit run -np 2 --backend B` (python benchmarks/workloads.py).", "",
             "| example | parameters | data | epochs | metric | Horovod | DDP | samples/s Horovod | samples/s DDP |",
             "|---|---|---|---|---|---|---|---|---|"]
    for ex in report["examples"].values():
        h, d = ex["runs"]["horovod"], ex["runs"]["ddp"]
        fmt = "{:.1%}" if "accuracy" in ex["metric"] else "{:.3f}"
        lines.append(f"| {ex['title']} | {ex['params'] / 1e6:.2f}M | {ex['data']} | {h['epochs']} | {ex['metric']} | "
                     f"{fmt.format(h['metric'])} | {fmt.format(d['metric'])} | {h['samples_per_sec']:.0f} | "
                     f"{d['samples_per_sec']:.0f} |")
    b = report["text_baselines_nats"]
    lines += ["", f"Text baselines: unigram entropy of the training text {b['unigram_entropy_nats']:.3f} nats/char; "
              f"a unigram model scores {b['unigram_val_xent_nats']:.3f} nats/char on the validation text."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
