"""The memory preflight on the 1.01B-parameter GPT: what it says before step 1, against what each
mode then really peaks at.

    python benchmarks/preflight.py --out docs/bench/preflight [--backends horovod,ddp]

For each backend and each ``--shard`` mode, ``benchmarks/billion.py``'s command (2 ranks, AdamW,
fp32, ``--activation-checkpointing``) as a user types it, for one step, each rank in a memory
cgroup of half this machine (so a mode that does not fit ends in its own cgroup, not by the
machine's OOM killer). Records whether the preflight refused it (and how fast, and what it
named), or its estimate, the step it took and every rank's peak RSS. Writes preflight.json and
preflight.md; each command's output stays in OUT/logs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from billion import GPT, HVDKIT, ROOT, prepare  # the same model, command and text

GIB = 2**30
CGROUPS = Path("/sys/fs/cgroup/memory")


def node_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) << 10
    raise SystemExit("no MemTotal in /proc/meminfo")


def one(out: Path, backend: str, shard: str, budget: int) -> dict:
    name = f"{backend}-{shard}"
    metrics = out / f"{name}.json"
    metrics.unlink(missing_ok=True)
    tag = uuid.uuid4().hex[:8]
    argv = [*HVDKIT, "run", "-np", "2", "--launcher", "mpirun", "--backend", backend, "--log-dir",
            str(out / "logs" / name), "--", str(ROOT / "tests" / "workers" / "memory_budget.sh"), str(budget),
            *HVDKIT, "train", "--backend", backend, *GPT, "--data", str(out / "text" / "train.h5"), "--shard", shard,
            "--activation-checkpointing", "--max-steps", "1", "--metrics-file", str(metrics)]
    (out / "logs" / name).mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "HVDKIT_BUDGET_TAG": tag, "MALLOC_MMAP_THRESHOLD_": "131072"})
    wall = time.perf_counter() - started
    text = proc.stdout + proc.stderr
    (out / "logs" / f"{name}.out").write_text(text)
    peaks, killed = [], 0
    for cg in sorted(CGROUPS.glob(f"hvdkit-budget-{tag}-*")):
        peaks.append(int((cg / "memory.max_usage_in_bytes").read_text()))
        oom = dict(line.split() for line in (cg / "memory.oom_control").read_text().splitlines())
        killed += int(oom.get("oom_kill", 0))
        while (cg / "cgroup.procs").read_text().strip():
            time.sleep(0.1)
        cg.rmdir()
    said = next((line for line in text.splitlines() if "a rank needs ~" in line), "")
    row = {"backend": backend, "shard": shard, "rc": proc.returncode, "wall_s": wall, "said": said,
           "refused": "HINT:" in said, "named": (re.search(r"use --shard (\w+)", said) or [None, None])[1],
           "cgroup_peaks": peaks, "oom_kills": killed, "argv": argv[2:]}
    if metrics.exists():
        got = json.loads(metrics.read_text())
        row["peak_rss"] = [m["peak_rss"] for m in got["memory"]]
        row["steps"] = got.get("global_step")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench-results/preflight"))
    parser.add_argument("--backends", default="horovod,ddp")
    parser.add_argument("--shards", default="none,optimizer,full")
    args = parser.parse_args()
    out = args.out.resolve()
    prepare(out)
    budget = node_bytes() // 2
    rows = [one(out, b, s, budget) for b in args.backends.split(",") for s in args.shards.split(",")]
    report = {"machine": platform.node(), "node_bytes": node_bytes(), "budget_per_rank": budget, "rows": rows}
    (out / "preflight.json").write_text(json.dumps(report, indent=1))
    lines = [f"Each rank in a cgroup of {budget / GIB:.1f} GiB (half of this node's {node_bytes() / GIB:.1f} GiB).",
             "", "| backend | --shard | outcome | wall s | what the preflight said | cgroup peak per rank GiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        outcome = ("refused, named --shard " + str(r["named"]) if r["refused"] else
                   f"step {r.get('steps')}" if r["rc"] == 0 else
                   f"failed rc {r['rc']}" + (f", {r['oom_kills']} OOM kill(s)" if r["oom_kills"] else ""))
        said = r["said"].split("] ", 1)[-1].split(" [full output")[0]
        lines.append(f"| {r['backend']} | {r['shard']} | {outcome} | {r['wall_s']:.0f} | {said} "
                     f"| {', '.join(f'{p / GIB:.1f}' for p in r['cgroup_peaks'])} |")
    (out / "preflight.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
