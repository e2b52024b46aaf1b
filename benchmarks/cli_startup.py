"""Wall time of the commands a login node runs, next to 'import torch' measured in the same run.

    python benchmarks/cli_startup.py [--runs 15] [--out docs/bench/cli_startup.json]

Each command runs ``--runs`` times in a fresh interpreter; the JSON holds every sample,
the table shows median [min, max]. The target (issue 14) is under 0.3 s for
``hvdkit slurm ... -o x.sbatch``; before the CLI became torch-free it took about 3 s,
nearly all of it importing torch.
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


def sample(argv: list[str], runs: int, cwd: str) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, cwd=cwd, timeout=120)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    py = sys.executable
    hvdkit = [py, "-m", "hvdkit"]
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([py, "-c", "from hvdkit.checkpoint import Snapshot, write_checkpoint\n"
                        "from hvdkit.models import build_model\n"
                        "write_checkpoint('c.h5', Snapshot(model=build_model('tiny').state_dict()))"],
                       check=True, cwd=tmp, timeout=120)
        commands = {
            "hvdkit slurm -o x.sbatch": [*hvdkit, "slurm", "-o", "x.sbatch", "--nodes", "2", "--", "--epochs", "3"],
            "hvdkit run --dry-run": [*hvdkit, "run", "--dry-run", "-np", "2", "--", "--epochs", "1"],
            "hvdkit ckpt show": [*hvdkit, "ckpt", "show", "c.h5"],
            "hvdkit --help": [*hvdkit, "--help"],
            "python -c 'import torch' (reference)": [py, "-c", "import torch"],
        }
        results = {name: sample(argv, args.runs, tmp) for name, argv in commands.items()}
    print(f"{'command':40s} median s  [min, max]  ({args.runs} runs each)")
    for name, xs in results.items():
        print(f"{name:40s} {statistics.median(xs):7.3f}  [{min(xs):.3f}, {max(xs):.3f}]")
    if args.out:
        args.out.write_text(json.dumps({"host": platform.node(), "python": platform.python_version(),
                                        "runs": args.runs, "seconds": results}, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
