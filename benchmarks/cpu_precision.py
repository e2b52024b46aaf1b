"""Step time of the example char GPT in fp32, bf16 and fp16 autocast on this CPU, one process.

Why: bf16/fp16 autocast on a CPU without native support (no AVX512_BF16/AMX for bf16, no
AVX512_FP16/AMX-FP16 for fp16) is emulated by oneDNN and much slower than fp32. hvdkit
warns at start with the slowdown measured here (hvdkit/precision.py, MEASURED_SLOWDOWN).
A CPU that has the features can show what one without them does: oneDNN honours
ONEDNN_MAX_CPU_ISA (and ATen ATEN_CPU_CAPABILITY), which is what ``--emulate avx2`` sets.

    python benchmarks/cpu_precision.py --out docs/bench/precision/cpu.json [--emulate avx2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(precision: str, steps: int, repeats: int) -> list[float]:
    """Seconds per training step, ``repeats`` timings of ``steps`` steps each (after a warm-up)."""
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from models import gpt

    from hvdkit.precision import autocast

    torch.manual_seed(0)
    torch.set_num_threads(1)  # one rank of the 2-rank tests owns one of 2 cores
    model = gpt(vocab_size=96, n_layer=6, block_size=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 96, (32, 32))
    cpu = torch.device("cpu")

    def step() -> None:
        with autocast(precision, cpu):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.float().view(-1, 96), x.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        out.append((time.perf_counter() - t0) / steps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--emulate", choices=["avx2"], default=None,
                    help="cap oneDNN and ATen at AVX2 (what a CPU without AVX-512/AMX runs)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--one", choices=["fp32", "bf16", "fp16"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:  # the child: one precision, in its own process (the ISA cap is read at start)
        print(json.dumps(measure(a.one, a.steps, a.repeats)))
        return
    env = dict(os.environ)
    if a.emulate:
        env.update(ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    report: dict = {"machine": platform.processor() or platform.machine(), "emulate": a.emulate,
                    "support": {}, "seconds_per_step": {}}
    probe = subprocess.run([sys.executable, "-c", "import json; from hvdkit.precision import lowp_support;"
                            "print(json.dumps({p: lowp_support(p).__dict__ for p in ('bf16', 'fp16')}))"],
                           env=env, capture_output=True, text=True, check=True, timeout=120)
    report["support"] = json.loads(probe.stdout)
    for precision in ("fp32", "bf16", "fp16"):
        proc = subprocess.run([sys.executable, __file__, "--one", precision, "--steps", str(a.steps),
                               "--repeats", str(a.repeats)], env=env, capture_output=True, text=True,
                              check=True, timeout=1800)
        report["seconds_per_step"][precision] = json.loads(proc.stdout.splitlines()[-1])
    best = {p: min(v) for p, v in report["seconds_per_step"].items()}
    report["slowdown_vs_fp32"] = {p: round(best[p] / best["fp32"], 2) for p in ("bf16", "fp16")}
    print(json.dumps(report, indent=2))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
