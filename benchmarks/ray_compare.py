"""Ray's cost and Tune's ASHA against hvdkit's own, measured in one run on this machine.

1. Fixed start-up: the same 2-rank, 1-step ``hvdkit train`` through ``hvdkit run`` (horovodrun,
   mpirun) and ``hvdkit run --launcher ray`` (an embedded Ray instance, started and stopped by
   the command), rounds alternated; the difference is what Ray adds to every job.
2. One sweep space (digits CNN, 6 lrs, 3 epochs, ASHA eta 3 grace 1), 2 ranks a trial, run by
   hvdkit's engine (local processes, one trial at a time) and by Ray Tune (embedded instance,
   as many trials as its CPUs hold): best val_accuracy, trial-epochs, wall time.

    python benchmarks/ray_compare.py docs/bench/ray [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HVDKIT = [sys.executable, "-m", "hvdkit"]
ONE_STEP = ["--model", "mlp", "--epochs", "1", "--steps-per-epoch", "1", "--num-samples", "256"]


def timed(argv: list[str], cwd: Path) -> float:
    started = time.monotonic()
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {proc.stderr[-2000:]}")
    return time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ray-compare-"))
    launches = {"horovodrun (horovod)": ["run", "-np", "2", "--backend", "horovod"],
                "mpirun (ddp)": ["run", "-np", "2", "--backend", "ddp"],
                "ray (horovod)": ["run", "-np", "2", "--backend", "horovod", "--launcher", "ray"],
                "ray (ddp)": ["run", "-np", "2", "--backend", "ddp", "--launcher", "ray"]}
    startup: dict[str, list[float]] = {k: [] for k in launches}
    for _ in range(a.rounds):  # alternated: drift of the machine hits every launcher alike
        for name, argv in launches.items():
            startup[name].append(timed([*HVDKIT, *argv, "--", *ONE_STEP], work))
    subprocess.run([*HVDKIT, "data", "import-digits", str(work / "digits")], check=True, capture_output=True,
                   timeout=300)
    space = work / "space.yaml"
    space.write_text(f"metric: val_accuracy\nmode: max\nfixed: {{model: {ROOT}/examples/models.py:digits_cnn, "
                     f"data: {work}/digits/train.h5, val_data: {work}/digits/val.h5, batch_size: 32, "
                     "optimizer: adamw, epochs: 3}\n"
                     "grid: {lr: [0.003, 0.002, 0.001, 0.00001, 0.00002, 0.00003]}\n"
                     "scheduler: asha\neta: 3\ngrace: 1\n")
    sweeps = {}
    for engine, extra in (("hvdkit", ["--parallel", "1"]), ("ray", ["--engine", "ray"])):
        out = work / f"sweep-{engine}"
        wall = timed([*HVDKIT, "sweep", "run", str(space), "-np", "2", "--out", str(out), *extra], work)
        rows = json.loads((out / "results.json").read_text())
        done = [r for r in rows if r["status"] == "completed"]
        best = max(done, key=lambda r: r["val_accuracy"])
        sweeps[engine] = {"wall_s": round(wall, 1), "best_val_accuracy": best["val_accuracy"],
                          "best_trial": best["trial"], "best_lr": best["params"]["lr"],
                          "trial_epochs": sum(r["epochs"] for r in rows), "full_grid": 3 * len(rows),
                          "pruned": sum(r["status"] == "pruned" for r in rows)}
    med = {k: statistics.median(v) for k, v in startup.items()}
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {__import__('os').cpu_count()} "
              "cores", "rounds": a.rounds, "startup_s": startup, "startup_median_s": med,
              "ray_adds_s": {"horovod": round(med["ray (horovod)"] - med["horovodrun (horovod)"], 2),
                             "ddp": round(med["ray (ddp)"] - med["mpirun (ddp)"], 2)},
              "sweeps": sweeps}
    (a.out / "ray-compare.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| launch (2 ranks, 1 step) | median s | rounds |", "|---|---|---|"]
    lines += [f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |" for k, v in startup.items()]
    lines += ["", "| engine | wall s | best val_accuracy (trial, lr) | trial-epochs | pruned |",
              "|---|---|---|---|---|"]
    lines += [f"| {e} | {s['wall_s']} | {s['best_val_accuracy']:.4f} ({s['best_trial']}, {s['best_lr']}) | "
              f"{s['trial_epochs']} of {s['full_grid']} | {s['pruned']} |" for e, s in sweeps.items()]
    (a.out / "ray-compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
