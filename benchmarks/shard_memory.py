"""Per-rank memory of each ``--shard`` mode at 1, 2 and 4 ranks, on the example GPT.

    python benchmarks/shard_memory.py --out docs/bench/shard

Each run is what a user types (``hvdkit run -np N --backend B -- ... --shard S``, a few
steps); the figures are those the training loop writes into its metrics file
(:mod:`hvdkit.memory`): bytes of parameters, of the gradients a rank holds when it steps,
and of optimizer state, per rank, and each rank's peak RSS. Writes ``memory.json`` (every
command and figure) and ``memory.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HVDKIT = [sys.executable, "-m", "hvdkit"]
GPT = ["--model", f"{ROOT / 'examples' / 'models.py'}:gpt", "--model-arg", "vocab_size=96", "--model-arg",
       "n_layer=6", "--model-arg", "n_embd=256", "--model-arg", "n_head=8", "--model-arg", "block_size=64",
       "--task", "language-model", "--optimizer", "adamw", "--batch-size", "8", "--epochs", "1",
       "--max-steps", "3", "--log-every", "0"]
MODES = [("ddp", "none"), ("ddp", "optimizer"), ("horovod", "optimizer"), ("ddp", "full")]
MB = 1e6


def run(data: Path, out: Path, backend: str, shard: str, np: int) -> dict:
    metrics = out / f"m-{backend}-{shard}-{np}.json"
    argv = [*HVDKIT, "run", "-np", str(np), "--backend", backend, "--", *GPT,
            "--data", str(data / "train.h5"), "--shard", shard, "--metrics-file", str(metrics)]
    subprocess.run(argv, check=True, capture_output=True, timeout=600)
    got = json.loads(metrics.read_text())
    metrics.unlink()
    return {"backend": backend, "shard": shard, "np": np, "argv": argv[2:], "memory": got["memory"]}


def table(rows: list[dict]) -> str:
    """One line per mode and world size: the largest rank's figures (MB) and the sum over ranks."""
    lines = ["| backend | --shard | ranks | params/rank MB | grads/rank MB | optimizer state/rank MB "
             "| optimizer state, all ranks MB | peak RSS/rank MB |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mem = r["memory"]

        def most(key: str) -> float:
            return max(m[key] for m in mem) / MB

        lines.append(f"| {r['backend']} | {r['shard']} | {r['np']} | {most('params'):.2f} | {most('grads'):.2f} "
                     f"| {most('optimizer_state'):.2f} | {sum(m['optimizer_state'] for m in mem) / MB:.2f} "
                     f"| {most('peak_rss'):.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results"))
    parser.add_argument("--data", type=Path, default=Path("/tmp/hvdkit-shard-memory-data"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.data / "train.h5").exists():
        subprocess.run([*HVDKIT, "data", "import-text", str(args.data), "--block", "64"], check=True,
                       capture_output=True, timeout=600)
    rows = [run(args.data, args.out, b, s, n) for b, s in MODES for n in (1, 2, 4)]
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    (args.out / "memory.json").write_text(json.dumps({"when": when, "machine": platform.platform(),
                                                      "runs": rows}, indent=1) + "\n")
    (args.out / "memory.md").write_text(
        f"Per-rank memory of the example GPT (4.8M parameters, AdamW), {when}, "
        f"`python benchmarks/shard_memory.py`; the largest rank's figures:\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
