"""--shard optimizer's per-rank memory on a model of few large tensors, in a tree you name.

    python benchmarks/zero_memory.py --tree . --label after --out docs/bench/zero-kept
    python benchmarks/zero_memory.py --tree /tmp/before --label before --out docs/bench/zero-kept

The 84M-parameter wide MLP of ``tests/test_preflight.py`` (2,896-wide square layers of 33.5 MB,
each over the 25 MiB bucket cap, so alone in its bucket), AdamW, 2 ranks, one epoch of 8 steps,
as ``hvdkit run`` starts it, each rank in a memory cgroup of 4 GiB (nothing is reclaimed under
it, so the cgroup's peak is the rank's own), ``--no-memory-check`` so that both trees do the same
work. ``--rounds`` rounds, both backends in each. Appends one JSON line per run to
OUT/runs.jsonl.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, required=True, help="the checkout whose hvdkit runs")
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", type=Path, default=Path("bench-results/zero-kept"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    tree = args.tree.resolve()
    sys.path[:0] = [str(tree / "tests"), str(tree)]
    from helpers import run_in_budgets  # that tree's: its hvdkit, its cgroup wrapper

    user = tree / "tests" / "userland" / "userland.py"
    args.out.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.rounds):
        for backend in ("horovod", "ddp"):
            with tempfile.TemporaryDirectory() as scratch:
                proc, figures = run_in_budgets(Path(scratch), 2, backend, 4 << 30, [
                    "--model", f"{user}:wide_mlp", "--model-arg", "width=2896", "--dataset", f"{user}:vectors",
                    "--dataset-arg", "width=2896", "--dataset-arg", "samples=32", "--batch-size", "4",
                    "--optimizer", "adamw", "--lr", "1e-4", "--epochs", "1", "--log-every", "1",
                    "--shard", "optimizer", "--no-memory-check"])
            if proc.returncode != 0:
                raise SystemExit(f"{args.label} {backend} failed:\n{proc.stderr[-2000:]}")
            row = {"label": args.label, "round": round_, "backend": backend,
                   "cgroup_peak_mib": [f["peak"] >> 20 for f in figures]}
            print(json.dumps(row), flush=True)
            with (args.out / "runs.jsonl").open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
