"""Checkpoints at scale, before and after: every rank's memory peak during a save and during a
restore, above the training state it holds, and the save's and restore's throughput against
the disk's sequential bandwidth measured in the same run.

    python benchmarks/scale.py --before /path/to/older/checkout OUT_DIR

For each backend and sharding mode, and for each checkout (``--before``, and this one), a
GPT-style model (vocabulary 50304, tied head, ``--n-embd`` x ``--n-layer``) takes one AdamW
step on 2 ranks and is saved and restored (benchmarks/scale_worker.py, the public API only).
The page cache is dropped before each restore and before the disk's read is timed (root).
Writes OUT_DIR/scale.json (every rank's figures), scale.md (the table) and scale.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = [("horovod", "none"), ("horovod", "optimizer"), ("ddp", "none"), ("ddp", "optimizer"), ("ddp", "full")]


def disk_bandwidth(directory: Path, size: int = 2 << 30, block: int = 8 << 20) -> dict[str, float]:
    """Sequential write (fsync'd) and cold read of one file of ``size`` bytes, bytes/s."""
    path = directory / "bandwidth.bin"
    data = os.urandom(block)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for _ in range(size // block):
        os.write(fd, data)
    os.fsync(fd)
    os.close(fd)
    write = size / (time.perf_counter() - started)
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    started = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    while os.read(fd, block):
        pass
    os.close(fd)
    read = size / (time.perf_counter() - started)
    path.unlink()
    return {"write": write, "read": read}


def measure(tree: Path, backend: str, shard: str, out: Path, n_embd: int, n_layer: int) -> dict | None:
    ck = out / f"ck-{tree.name}-{backend}-{shard}"
    result = out / f"{tree.name}-{backend}-{shard}.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "HVDKIT_NETWORK_BENCH": "", "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.run([sys.executable, "-m", "hvdkit", "run", "-np", "2", "--backend", backend, "--",
                           sys.executable, str(ROOT / "benchmarks" / "scale_worker.py"), str(result), str(ck), shard,
                           str(n_embd), str(n_layer)], env=env, cwd=tree, capture_output=True, text=True, timeout=3000)
    subprocess.run(["rm", "-rf", str(ck)], check=True)
    if proc.returncode != 0 or not result.exists():
        print(f"{tree.name} {backend} {shard}: failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return {"failed": proc.returncode, "stderr": proc.stderr[-2000:]}
    return json.loads(result.read_text())


def table(runs: dict, disk: dict) -> str:
    lines = ["| checkout | backend | shard | params | file GiB | worst rank extra at save (B/param) | "
             "worst rank extra at restore (B/param) | save GB/s (x disk write) | restore GB/s (x disk read) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, r in runs.items():
        tree, backend, shard = key.split("|")
        if "failed" in r:
            lines.append(f"| {tree} | {backend} | {shard} | | | failed (exit {r['failed']}) | | | |")
            continue
        n, size = r["params"], r["file_bytes"]
        save_extra = max(x["save_extra"] for x in r["ranks"])
        restore_extra = max(x["restore_extra"] for x in r["ranks"])
        save_s = max(x["save_s"] for x in r["ranks"])
        restore_s = max(x["restore_s"] for x in r["ranks"])
        lines.append(f"| {tree} | {backend} | {shard} | {n / 1e6:.0f}M | {size / 2**30:.2f} | "
                     f"{save_extra / 2**20:.0f} MiB ({save_extra / n:.1f}) | "
                     f"{restore_extra / 2**20:.0f} MiB ({restore_extra / n:.1f}) | "
                     f"{size / save_s / 1e9:.2f} ({size / save_s / disk['write']:.2f}x) | "
                     f"{size / restore_s / 1e9:.2f} ({size / restore_s / disk['read']:.2f}x) |")
    return "\n".join(lines)


def plot(runs: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    labels = [f"{b}\n{s}" for b, s in MODES]
    for ax, phase in zip(axes, ("save_extra", "restore_extra")):
        for k, tree in enumerate(sorted({key.split("|")[0] for key in runs})):
            values = []
            for backend, shard in MODES:
                r = runs.get(f"{tree}|{backend}|{shard}", {})
                values.append(max(x[phase] for x in r["ranks"]) / 2**20 if "ranks" in r else 0)
            ax.bar([i + 0.4 * k for i in range(len(MODES))], values, width=0.4, label=tree)
        ax.set_xticks([i + 0.2 for i in range(len(MODES))], labels)
        ax.set_title(f"worst rank's memory above its training state: {phase.split('_')[0]}")
        ax.set_ylabel("MiB")
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scale.png", dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--before", type=Path, required=True, help="an older checkout (a git worktree)")
    parser.add_argument("--n-embd", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    disk = disk_bandwidth(args.out)
    print(f"disk: write {disk['write'] / 1e9:.2f} GB/s, read {disk['read'] / 1e9:.2f} GB/s", flush=True)
    runs = {}
    for tree, name in ((args.before.resolve(), "before"), (ROOT, "after")):
        for backend, shard in MODES:
            r = measure(tree, backend, shard, args.out, args.n_embd, args.n_layer)
            runs[f"{name}|{backend}|{shard}"] = r
            print(table({f"{name}|{backend}|{shard}": r}, disk).splitlines()[-1], flush=True)
    (args.out / "scale.json").write_text(json.dumps({"disk": disk, "runs": runs, "n_embd": args.n_embd,
                                                     "n_layer": args.n_layer}, indent=1))
    (args.out / "scale.md").write_text(table(runs, disk) + "\n")
    plot(runs, args.out)


if __name__ == "__main__":
    main()
