"""Worker: every rank starts from its own weights and optimizer state, then takes rank 1's.

usage: root_worker.py BACKEND SHARD OUT_DIR
Writes OUT_DIR/rank<r>.pt: rank 1's own outputs before the broadcast (``expected``), and this
rank's after it, before and after one more identical step (``after``), so a strategy that
ignored ``root`` (rank 0's state went out) or scattered only part of the state shows.
"""

import copy
import sys
from pathlib import Path

import torch

from hvdkit import BackendConfig, build_model, create_backend

backend_name, shard, out_dir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
backend = create_backend(BackendConfig(name=backend_name, shard=shard))
rank = backend.rank
X = torch.randn(16, 8, generator=torch.Generator().manual_seed(3))
Y = torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(4))


def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(X), Y).backward()
    opt.step()


model = build_model("tiny", seed=100 + rank)  # a different start on every rank
opt = torch.optim.Adam(model.parameters(), lr=0.01)
step(model, opt)  # a different Adam state on every rank, too, held through the wrap
# this rank's own continuation, computed alone: what every rank must compute after taking rank 1's
alone = copy.deepcopy(model)
alone_opt = torch.optim.Adam(alone.parameters(), lr=0.01)
# Adam's moments and step count, by parameter index; copied: load_state_dict would share them
alone_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
with torch.no_grad():
    own_before = alone(X)
# every rank feeds the same batch, so the data-parallel step (gradients averaged) is this step
step(alone, alone_opt)
with torch.no_grad():
    own_after = alone(X)

model, opt = backend.wrap(model, opt)
backend.broadcast_state(model, opt, root=1)
with torch.no_grad():
    before = model(X)
step(model, opt)
with torch.no_grad():
    after = model(X)
torch.save({"own": (own_before, own_after), "got": (before, after)}, out_dir / f"rank{rank}.pt")
backend.shutdown()
