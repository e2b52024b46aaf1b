"""A 1.01B-parameter GPT trains, saves and resumes to the same bits on 2 ranks of one machine.

    python benchmarks/billion.py --out docs/bench/billion [--backend ddp] [--steps 3]

The model is issue #43's: the shipped example GPT (examples/models.py:gpt) at d=2048, 18
layers, 16 heads, vocabulary 50304 (tied head), 256 tokens, batch 1 per rank, AdamW. It
trains on real text (the Python standard library's source, ``hvdkit data import-text``).
Three commands, each typed as a user would (``hvdkit run -np 2 --backend B -- ...``):

1. straight: ``--steps`` steps;
2. first: ``--steps - 1`` steps with ``--checkpoint-dir`` (the checkpoint at ``--max-steps``);
3. resumed: the same directory and ``--max-steps STEPS``: it resumes and takes the last step.

The resumed run must end on the straight run's ``param_digest``. Writes billion.json (every
command, its wall time, every rank's peak RSS and the figures the loop reports) and
billion.md. Each command's log stays in OUT/logs.
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
GPT = ["--model", f"{ROOT / 'examples' / 'models.py'}:gpt", "--model-arg", "vocab_size=50304",
       "--model-arg", "n_embd=2048", "--model-arg", "n_layer=18", "--model-arg", "n_head=16",
       "--model-arg", "block_size=256", "--task", "language-model", "--optimizer", "adamw", "--lr", "1e-4",
       "--batch-size", "1", "--log-every", "1"]
GIB = 2**30


def prepare(out: Path) -> None:
    """OUT/logs, and the text (the Python standard library's source) as OUT/text/train.h5."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if not (out / "text" / "train.h5").exists():
        subprocess.run([*HVDKIT, "data", "import-text", str(out / "text"), "--block", "256", "--max-bytes",
                        "4000000"], check=True, capture_output=True, timeout=600)


def run(name: str, out: Path, backend: str, extra: list[str]) -> dict:
    metrics = out / f"{name}.json"
    (out / "logs" / name).mkdir(parents=True, exist_ok=True)
    argv = [*HVDKIT, "run", "-np", "2", "--backend", backend, "--log-dir", str(out / "logs" / name), "--",
            *GPT, "--data", str(out / "text" / "train.h5"), *extra, "--metrics-file", str(metrics)]
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - started
    (out / "logs" / f"{name}.out").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-3000:]}")
    got = json.loads(metrics.read_text())
    return {"argv": argv[2:], "wall_s": wall, "metrics": got}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/billion"))
    parser.add_argument("--backend", default="ddp")
    parser.add_argument("--shard", default="full")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    out = args.out.resolve()
    prepare(out)
    mode = ["--shard", args.shard, "--activation-checkpointing"]
    ck = out / "ck"
    subprocess.run(["rm", "-rf", str(ck)], check=True)
    runs = {"straight": run("straight", out, args.backend, [*mode, "--max-steps", str(args.steps)])}
    runs["first"] = run("first", out, args.backend, [*mode, "--max-steps", str(args.steps - 1),
                                                     "--checkpoint-dir", str(ck)])
    files = sorted(ck.glob("ckpt-*.h5"))
    runs["resumed"] = run("resumed", out, args.backend, [*mode, "--max-steps", str(args.steps),
                                                         "--checkpoint-dir", str(ck)])
    digest = {k: r["metrics"]["param_digest"] for k, r in runs.items()}
    report = {"machine": platform.node(), "backend": args.backend, "shard": args.shard, "steps": args.steps,
              "checkpoint_bytes": files[-1].stat().st_size if files else None,
              "same_bits": digest["straight"] == digest["resumed"], "digests": digest, "runs": runs}
    subprocess.run(["rm", "-rf", str(ck)], check=True)
    (out / "billion.json").write_text(json.dumps(report, indent=1, default=str))
    lines = ["| command | wall s | built RSS per rank GiB | peak RSS per rank GiB | sum GiB | parameters (fp32) "
             "| final loss | digest |", "|---|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        m = r["metrics"]
        peaks = [x["peak_rss"] / GIB for x in m["memory"]]
        built = [x.get("built_rss", 0) / GIB for x in m["memory"]]  # once made and sharded, before any step
        params = sum(x["params"] for x in m["memory"]) / 4 / 1e9
        lines.append(f"| {name} | {r['wall_s']:.0f} | {', '.join(f'{b:.1f}' for b in built)} "
                     f"| {', '.join(f'{p:.1f}' for p in peaks)} | {sum(peaks):.1f} "
                     f"| {params:.3f}B | {m.get('final_loss')} | {m['param_digest']} |")
    lines.append(f"\nresumed == straight: {report['same_bits']}; checkpoint "
                 f"{(report['checkpoint_bytes'] or 0) / 1e9:.1f} GB")
    (out / "billion.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if not report["same_bits"]:
        raise SystemExit("the resumed run did not end on the straight run's bits")


if __name__ == "__main__":
    main()
