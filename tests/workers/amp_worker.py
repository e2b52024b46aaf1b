"""Worker: two mixed-precision optimizer steps on this rank's slice of a fixed global batch.

usage: amp_worker.py BACKEND OUT_DIR PRECISION ORDER
ORDER: backend  -- hvdkit's Backend.optimizer_step (what training uses)
       manual   -- Horovod's documented AMP pattern, written out here
       wrong    -- scaler.step(optimizer) alone: unscales before Horovod reduces
Writes OUT_DIR/rank<r>.pt with the weights after each step and the scaler's scale.
"""

import sys
from pathlib import Path

import torch

from hvdkit import BackendConfig, build_model, create_backend
from hvdkit.precision import autocast

backend_name, out_dir, precision, order = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
MICRO = 4

backend = create_backend(BackendConfig(name=backend_name))
rank, size = backend.rank, backend.size
model = build_model("tiny", seed=100 + rank)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model, opt = backend.wrap(model, opt)
backend.broadcast_state(model, opt)
# a small initial scale, so that no step is skipped for overflow and every step counts
scaler = torch.amp.GradScaler("cpu", init_scale=256.0) if precision == "fp16" else None

gen = torch.Generator().manual_seed(7)
steps = []
for _ in range(2):
    X = torch.randn(size * MICRO, 8, generator=gen)
    Y = torch.randint(0, 4, (size * MICRO,), generator=gen)
    x, y = X[rank * MICRO:(rank + 1) * MICRO], Y[rank * MICRO:(rank + 1) * MICRO]
    with autocast(precision, torch.device("cpu")):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    (scaler.scale(loss) if scaler else loss).backward()
    if order == "backend" or scaler is None:
        backend.optimizer_step(opt, scaler)
    elif order == "manual":  # https://horovod.readthedocs.io/en/stable/pytorch.html (AMP)
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    else:
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()
    steps.append({k: v.clone() for k, v in backend.unwrap(model).state_dict().items()})

out_dir.mkdir(parents=True, exist_ok=True)
torch.save({"rank": rank, "steps": steps, "scale": scaler.get_scale() if scaler else None},
           out_dir / f"rank{rank}.pt")
backend.shutdown()
