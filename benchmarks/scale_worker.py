"""One rank of benchmarks/scale.py: a GPT-style model, one AdamW step, then a checkpoint save and
a restore, each with this rank's memory peak above what it held before (VmHWM, reset just
before) and its seconds. Uses only the public API (create_backend, wrap, CheckpointManager),
so the same file measures an older checkout (PYTHONPATH) as well.

    hvdkit run -np 2 --backend B -- python benchmarks/scale_worker.py OUT.json CKPT_DIR SHARD N_EMBD N_LAYER
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

import hvdkit

ROOT = Path(__file__).resolve().parents[1]


def status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def reset_peak() -> int:
    """Start VmHWM again from the current RSS; returns that RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status_kib("VmRSS") * 1024


def main() -> None:
    out, ck, shard, n_embd, n_layer = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
    spec = importlib.util.spec_from_file_location("models", ROOT / "examples" / "models.py")
    models = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(models)  # type: ignore[union-attr]
    backend = hvdkit.create_backend(hvdkit.BackendConfig(shard=shard))
    torch.manual_seed(0)
    model = models.gpt(vocab_size=50304, block_size=64, n_layer=n_layer, n_head=16, n_embd=n_embd, dropout=0.0)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = backend.wrap(model, optimizer)
    backend.broadcast_state(model, optimizer)
    tokens = torch.randint(0, 50304, (1, 65), generator=torch.Generator().manual_seed(backend.rank))
    with backend.accumulate(model, sync=True):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    backend.optimizer_step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    states = {"model": model, "optimizer": optimizer}
    manager = hvdkit.CheckpointManager(ck, backend, keep=1)
    backend.barrier()

    held = reset_peak()
    started = time.perf_counter()
    path = manager.save(1, states)
    save_s = time.perf_counter() - started
    save_extra = status_kib("VmHWM") * 1024 - held
    backend.barrier()
    if backend.rank == 0:  # the restore reads from the disk, not from the page cache
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    backend.barrier()

    held_restore = reset_peak()
    started = time.perf_counter()
    manager.restore(states)
    restore_s = time.perf_counter() - started
    restore_extra = status_kib("VmHWM") * 1024 - held_restore
    mine = {"rank": backend.rank, "held": held, "save_extra": save_extra, "restore_extra": restore_extra,
            "save_s": save_s, "restore_s": restore_s}
    every = backend.gather_objects(mine)
    if backend.rank == 0:
        largest = max(p.numel() * p.element_size() for p in backend.unwrap(model).parameters())
        Path(out).write_text(json.dumps({"params": params, "file_bytes": os.path.getsize(path), "largest_tensor":
                                         largest, "ranks": every}, indent=1))
    backend.shutdown()


if __name__ == "__main__":
    main()
