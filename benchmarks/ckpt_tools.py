"""The offline tools on a 1B-parameter checkpoint: peak RSS and seconds of ``hvdkit ckpt
verify``, ``ckpt show`` and ``ckpt export`` (safetensors and torch), as users type them.

    python benchmarks/ckpt_tools.py OUT_DIR [--keep]

The checkpoint is that of a GPT of 1.01B parameters (d=2048, 18 layers, vocabulary 50304,
256 positions, tied head: the model of issue #43) with AdamW's state (two moments and a
step per parameter): 12 GB. It is written through hvdkit's own writer with every tensor made
when the writer reaches it (seeded), so writing it needs one tensor, not the model. The
page cache is dropped before each tool (root). Writes OUT_DIR/tools.json and tools.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

N_EMBD, N_LAYER, VOCAB, BLOCK = 2048, 18, 50304, 256


def gpt_shapes() -> list[tuple[str, tuple[int, ...]]]:
    """The GPT's state_dict names and shapes (the head is tied to wte: not stored twice)."""
    d = N_EMBD
    shapes = [("transformer.wte.weight", (VOCAB, d)), ("transformer.wpe.weight", (BLOCK, d))]
    for i in range(N_LAYER):
        h = f"transformer.h.{i}."
        shapes += [(h + "ln_1.weight", (d,)), (h + "ln_1.bias", (d,)),
                   (h + "attn.c_attn.weight", (3 * d, d)), (h + "attn.c_attn.bias", (3 * d,)),
                   (h + "attn.c_proj.weight", (d, d)), (h + "attn.c_proj.bias", (d,)),
                   (h + "ln_2.weight", (d,)), (h + "ln_2.bias", (d,)),
                   (h + "mlp.c_fc.weight", (4 * d, d)), (h + "mlp.c_fc.bias", (4 * d,)),
                   (h + "mlp.c_proj.weight", (d, 4 * d)), (h + "mlp.c_proj.bias", (d,))]
    return shapes + [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]


def write(path: Path) -> tuple[int, float]:
    """The 12 GB checkpoint, one generated tensor at a time; (parameters, seconds)."""
    import torch

    from hvdkit.checkpoint import Snapshot, write_checkpoint
    from hvdkit.h5tree import Deferred

    shapes = gpt_shapes()

    def tensor(seed: int, shape: tuple[int, ...]) -> Deferred:
        return Deferred(lambda: torch.randn(shape, generator=torch.Generator().manual_seed(seed)), shape,
                        torch.float32)

    model = {name: tensor(k, shape) for k, (name, shape) in enumerate(shapes)}
    n = len(shapes)
    state = {i: {"step": torch.tensor(100.0), "exp_avg": tensor(n + i, shape), "exp_avg_sq": tensor(2 * n + i, shape)}
             for i, (_, shape) in enumerate(shapes)}
    groups = [{"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "params": list(range(n))}]
    started = time.perf_counter()
    write_checkpoint(path, Snapshot(states={"model": model, "optimizer": {"state": state, "param_groups": groups}},
                                    meta={"step": 100, "world_size": 2,
                                          "states": {"model": "module", "optimizer": "optimizer"}}))
    params = sum(int(torch.Size(s).numel()) for _, s in shapes)
    return params, time.perf_counter() - started


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def tool(argv: list[str]) -> dict:
    """One command as a user types it: its exit status, seconds and peak RSS (its own process)."""
    drop_caches()
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "hvdkit", "ckpt", *argv], capture_output=True, text=True,
                          timeout=3600)
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if peak <= before:  # the children's maximum did not move: this child stayed below an earlier one
        raise SystemExit("run each tool in a fresh process to read its own peak (see main)")
    return {"argv": argv, "rc": proc.returncode, "seconds": seconds, "peak_rss": peak * 1024,
            "stderr": proc.stderr[-500:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep the 12 GB checkpoint and the exports")
    parser.add_argument("--tool", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)  # one tool, its own process
    args = parser.parse_args()
    if args.tool:  # a fresh process per tool, so RUSAGE_CHILDREN is that tool's peak alone
        print(json.dumps(tool(args.tool)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    ck = args.out / "ckpt-000000100.h5"
    params, write_s = write(ck)
    size = ck.stat().st_size
    print(f"wrote {params / 1e9:.2f}B parameters with AdamW state: {size / 1e9:.1f} GB in {write_s:.0f} s", flush=True)
    runs = {}
    for name, argv in (("verify", ["verify", str(ck)]), ("show", ["show", str(ck)]),
                       ("export safetensors", ["export", str(ck), str(args.out / "w.safetensors")]),
                       ("export torch", ["export", str(ck), str(args.out / "w.pt"), "--format", "torch"])):
        out = subprocess.run([sys.executable, __file__, str(args.out), "--tool", *argv], capture_output=True,
                             text=True, timeout=3600)
        runs[name] = json.loads(out.stdout.strip().splitlines()[-1])
        r = runs[name]
        print(f"{name}: rc {r['rc']}, {r['seconds']:.1f} s, peak RSS {r['peak_rss'] / 2**20:.0f} MiB", flush=True)
    largest = VOCAB * N_EMBD * 4
    report = {"params": params, "file_bytes": size, "write_s": write_s, "largest_tensor": largest, "tools": runs}
    (args.out / "tools.json").write_text(json.dumps(report, indent=1))
    lines = [f"A {params / 1e9:.2f}B-parameter GPT checkpoint with AdamW state ({size / 1e9:.1f} GB; largest "
             f"tensor {largest / 2**20:.0f} MiB), page cache dropped before each command:", "",
             "| command | exit | seconds | GB/s of the file | peak RSS (MiB) |", "|---|---|---|---|---|"]
    for name, r in runs.items():
        lines.append(f"| hvdkit ckpt {name} | {r['rc']} | {r['seconds']:.1f} | {size / r['seconds'] / 1e9:.2f} | "
                     f"{r['peak_rss'] / 2**20:.0f} |")
    (args.out / "tools.md").write_text("\n".join(lines) + "\n")
    if not args.keep:
        for leftover in (ck, args.out / "w.safetensors", args.out / "w.pt"):
            leftover.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
