"""The parameter digests of a fixed set of training configurations, to show that a refactoring
kept every bit: run it on the commit before and after, and compare the two JSON files.

    python benchmarks/digests.py --tree /path/to/checkout > before.json

Each configuration is 'hvdkit run -np 2' of the mlp for 2 epochs of 6 steps, on both backends,
every sharding mode, both compressions, accumulation and clipping, the stock Horovod
optimizer, and a stop at step 7 resumed from its checkpoint. ``--tree`` is the checkout whose
hvdkit runs (PYTHONPATH), so one venv serves both commits.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

MLP = ["--model", "mlp", "--epochs", "2", "--steps-per-epoch", "6", "--num-samples", "1024", "--seed", "3"]
CONFIGS: dict[str, list[str]] = {
    "horovod": ["--backend", "horovod"],
    "horovod stock": ["--backend", "horovod", "--hvd-reducer", "stock"],
    "horovod fp16": ["--backend", "horovod", "--compression", "fp16"],
    "horovod powersgd": ["--backend", "horovod", "--compression", "powersgd:rank=2,start=3"],
    "horovod shard=optimizer": ["--backend", "horovod", "--shard", "optimizer"],
    "horovod accum=2 clip": ["--backend", "horovod", "--accumulation-steps", "2", "--clip-grad-norm", "0.5"],
    "ddp": ["--backend", "ddp"],
    "ddp fp16": ["--backend", "ddp", "--compression", "fp16"],
    "ddp powersgd": ["--backend", "ddp", "--compression", "powersgd:rank=2,start=3"],
    "ddp shard=optimizer": ["--backend", "ddp", "--shard", "optimizer"],
    "ddp shard=full": ["--backend", "ddp", "--shard", "full"],
    "ddp accum=2 clip": ["--backend", "ddp", "--accumulation-steps", "2", "--clip-grad-norm", "0.5"],
}
RESUMED = ("horovod powersgd", "ddp shard=full", "horovod shard=optimizer")  # also stopped at step 7, resumed


def run(tree: Path, args: list[str], extra: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMPI_ALLOW_RUN_AS_ROOT": "1",
           "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "HVDKIT_NETWORK_BENCH": ""}
    backend = args[args.index("--backend") + 1]  # hvdkit run's own option: it launches for that backend
    train = [a for k, a in enumerate(args) if a != "--backend" and (k == 0 or args[k - 1] != "--backend")]
    proc = subprocess.run([sys.executable, "-m", "hvdkit", "run", "-np", "2", "--backend", backend, "--", *MLP,
                           *train, *extra],
                          env=env, cwd=tree, capture_output=True, text=True, timeout=600)
    found = re.search(r"digest=(\w+)", proc.stdout)
    if proc.returncode != 0 or not found:
        sys.exit(f"{' '.join(args + extra)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return found.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[1])
    tree = parser.parse_args().tree.resolve()
    out: dict[str, str] = {}
    for name, args in CONFIGS.items():
        out[name] = run(tree, args, [])
        print(f"{name}: {out[name]}", file=sys.stderr, flush=True)
        if name in RESUMED:
            with tempfile.TemporaryDirectory() as ck:
                run(tree, args, ["--checkpoint-dir", ck, "--max-steps", "7"])
                out[f"{name} resumed"] = run(tree, args, ["--checkpoint-dir", ck])
            print(f"{name} resumed: {out[name + ' resumed']}", file=sys.stderr, flush=True)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
