"""Ray's cost and Tune's ASHA against hvdkit's own, measured in one run on this machine.

1. Fixed start-up: the same 2-rank, 1-step ``hvdkit train`` through ``hvdkit run`` (horovodrun,
   mpirun) and ``hvdkit run --launcher ray``, with an embedded Ray instance (started and stopped
   by the command) and joined to a running head (``--ray-address``, a head this script starts
   and stops by PID), rounds alternated. Embedded minus joined is the instance's start and
   stop; joined minus mpirun/horovodrun is what every job pays on a running cluster.
3. Per Tune trial: sweeps of 1 and of 4 one-step trials (2 ranks each, one trial at a time) on
   the running head and on hvdkit's local engine; (T4 - T1) / 3 is one trial's cost with the
   driver's fixed cost cancelled, and the engines' difference is what Tune adds per trial.
2. One sweep space (digits CNN, 6 lrs, 3 epochs, ASHA eta 3 grace 1), 2 ranks a trial, run by
   hvdkit's engine (local processes, one trial at a time) and by Ray Tune (embedded instance,
   as many trials as its CPUs hold): best val_accuracy, trial-epochs, wall time.

    python benchmarks/ray_compare.py docs/bench/ray [--rounds 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
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


@contextlib.contextmanager
def ray_head(log: Path, cpus: int):  # type: ignore[no-untyped-def]
    """A Ray head on 127.0.0.1 for the benchmark; its process group stopped by PID at the end."""
    sys.path.insert(0, str(ROOT))
    from hvdkit.environments import find_free_port

    port = find_free_port("127.0.0.1")
    with log.open("w") as out:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                                 "--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(cpus),
                                 "--include-dashboard", "false", "--disable-usage-stats"],
                                env={**os.environ, "RAY_AUTH_MODE": "token"}, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the Ray head did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


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
    head_cpus = 2  # one 2-rank trial at a time
    with ray_head(work / "head.log", head_cpus) as address:
        launches.update({"ray joined (horovod)": [*launches["ray (horovod)"], "--ray-address", address],
                         "ray joined (ddp)": [*launches["ray (ddp)"], "--ray-address", address]})
        startup: dict[str, list[float]] = {k: [] for k in launches}
        for _ in range(a.rounds):  # alternated: drift of the machine hits every launcher alike
            for name, argv in launches.items():
                startup[name].append(timed([*HVDKIT, *argv, "--", *ONE_STEP], work))
        per_trial: dict[str, dict[str, list[float]]] = {"hvdkit": {"1": [], "4": []}, "ray": {"1": [], "4": []}}
        for n in ("1", "4"):
            lrs = ", ".join(str(0.01 * (i + 1)) for i in range(int(n)))
            (work / f"trials-{n}.yaml").write_text("metric: final_loss\nfixed: {model: mlp, epochs: 1, "
                                                   f"steps_per_epoch: 1, num_samples: 256}}\ngrid: {{lr: [{lrs}]}}\n")
        for r in range(a.rounds):
            for engine, extra in (("hvdkit", ["--parallel", "1"]), ("ray", ["--engine", "ray", "--ray-address",
                                                                             address])):
                for n in ("1", "4"):
                    out = work / f"pt-{engine}-{n}-{r}"
                    per_trial[engine][n].append(timed([*HVDKIT, "sweep", "run", str(work / f"trials-{n}.yaml"),
                                                       "-np", "2", "--out", str(out), *extra], work))
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
    trial_s = {e: round((statistics.median(v["4"]) - statistics.median(v["1"])) / 3, 2) for e, v in per_trial.items()}
    report = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()}, {__import__('os').cpu_count()} "
              "cores", "rounds": a.rounds, "startup_s": startup, "startup_median_s": med,
              "ray_adds_s": {"horovod": round(med["ray (horovod)"] - med["horovodrun (horovod)"], 2),
                             "ddp": round(med["ray (ddp)"] - med["mpirun (ddp)"], 2)},
              "ray_joined_adds_s": {"horovod": round(med["ray joined (horovod)"] - med["horovodrun (horovod)"], 2),
                                    "ddp": round(med["ray joined (ddp)"] - med["mpirun (ddp)"], 2)},
              "per_trial_sweeps_s": per_trial, "per_trial_s": trial_s,
              "tune_adds_per_trial_s": round(trial_s["ray"] - trial_s["hvdkit"], 2),
              "sweeps": sweeps}
    (a.out / "ray-compare.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = ["| launch (2 ranks, 1 step) | median s | rounds |", "|---|---|---|"]
    lines += [f"| {k} | {med[k]:.1f} | {', '.join(f'{x:.1f}' for x in v)} |" for k, v in startup.items()]
    lines += ["", "| per trial (1-step trials of 2 ranks, one at a time) | T(1 trial) s | T(4 trials) s | "
              "per trial s |", "|---|---|---|---|"]
    lines += [f"| {e} | {', '.join(f'{x:.1f}' for x in v['1'])} | {', '.join(f'{x:.1f}' for x in v['4'])} | "
              f"{trial_s[e]} |" for e, v in per_trial.items()]
    lines += ["", "| engine | wall s | best val_accuracy (trial, lr) | trial-epochs | pruned |",
              "|---|---|---|---|---|"]
    lines += [f"| {e} | {s['wall_s']} | {s['best_val_accuracy']:.4f} ({s['best_trial']}, {s['best_lr']}) | "
              f"{s['trial_epochs']} of {s['full_grid']} | {s['pruned']} |" for e, s in sweeps.items()]
    (a.out / "ray-compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
