"""Worker: broadcast, then two optimizer steps on this rank's slice of a fixed global batch.

usage: step_worker.py BACKEND OUT_DIR ACCUM [OPTIMIZER]
Writes OUT_DIR/rank<r>.pt with the weights at each stage.
"""

import sys
from pathlib import Path

import torch

from hvdkit import BackendConfig, build_model, create_backend

backend_name, out_dir, accum = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
opt_name = sys.argv[4] if len(sys.argv) > 4 else "sgd"
MICRO = 4  # samples per rank per micro-batch

backend = create_backend(BackendConfig(name=backend_name, accumulation_steps=accum))
rank, size = backend.rank, backend.size
model = build_model("tiny", seed=100 + rank)  # a different start on every rank
initial = {k: v.clone() for k, v in model.state_dict().items()}
if opt_name == "sgd":
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
else:
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)
model, opt = backend.wrap(model, opt)
backend.broadcast_state(model, opt)
after_broadcast = {k: v.clone() for k, v in backend.unwrap(model).state_dict().items()}

gen = torch.Generator().manual_seed(7)
steps = []
for _ in range(2):
    X = torch.randn(size * accum * MICRO, 8, generator=gen)
    Y = torch.randint(0, 4, (size * accum * MICRO,), generator=gen)
    for micro in range(accum):
        # rank r, micro m gets a contiguous slice: together they cover the global batch
        lo = (rank * accum + micro) * MICRO
        x, y = X[lo:lo + MICRO], Y[lo:lo + MICRO]
        with backend.accumulate(model, sync=micro == accum - 1):
            loss = torch.nn.functional.cross_entropy(model(x), y) / accum
            loss.backward()
    opt.step()
    opt.zero_grad()
    steps.append({k: v.clone() for k, v in backend.unwrap(model).state_dict().items()})

out_dir.mkdir(parents=True, exist_ok=True)
env_name = getattr(getattr(backend, "env", None), "name", None)
torch.save({"rank": rank, "size": size, "initial": initial, "after_broadcast": after_broadcast,
            "steps": steps, "env": env_name}, out_dir / f"rank{rank}.pt")
backend.shutdown()
