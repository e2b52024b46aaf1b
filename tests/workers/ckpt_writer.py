"""Worker: save checkpoints of a ~50 MB model in a loop (rank 0 writes), or restore one.

usage: ckpt_writer.py BACKEND DIR save|restore
"""

import os
import sys

import torch

from hvdkit import BackendConfig, CheckpointManager, create_backend

backend = create_backend(BackendConfig(name=sys.argv[1]))
directory, mode = sys.argv[2], sys.argv[3]
model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(12)])  # ~50 MB
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = backend.wrap(model, opt)
mgr = CheckpointManager(directory, backend, keep=2)
if mode == "save":
    print(f"rank {backend.rank} pid {os.getpid()}", flush=True)
    for step in range(1, 10_000):
        with torch.no_grad():
            for p in backend.unwrap(model).parameters():
                p.fill_(step)
        mgr.save(step, {"model": model, "optimizer": opt})
        if backend.is_master:
            print(f"saved {step}", flush=True)
else:
    restored = mgr.restore({"model": model, "optimizer": opt})
    value = next(backend.unwrap(model).parameters()).flatten()[0].item()
    print(f"rank {backend.rank} restored step {restored.step} value {value}", flush=True)
backend.shutdown()
