"""Worker: PowerSGD steps on 2 ranks, as torch's own DDP hook or as hvdkit's backends run them.

usage: powersgd_worker.py MODE OUT_DIR
  MODE torch:   DistributedDataParallel + torch's powerSGD_hook and PowerSGDState (the reference;
                hvdkit only forms the process group), under mpirun
  MODE ddp:     hvdkit's DDP backend with --compression powersgd, under mpirun
  MODE horovod: hvdkit's Horovod backend (its own PowerSGD on the bucket engine), under horovodrun
Writes OUT_DIR/MODE-rank<r>.pt: the parameters after every step, and the last PowerSGD state.
"""

import sys
from pathlib import Path

import torch
from torch import nn

from hvdkit.backends import create_backend
from hvdkit.config import BackendConfig, DDPOptions, HorovodOptions

RANK, START, STEPS, BATCH = 2, 3, 8, 8


def model() -> nn.Module:
    """One bucket (< 1 MiB). Compressed: 32x20 and two 32x32 (grouped by shape, as torch
    groups them); sent whole: 4x32 (too small to gain at rank 2) and the biases."""
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(20, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32),
                         nn.Tanh(), nn.Linear(32, 4))


def main() -> None:
    mode, out = sys.argv[1], Path(sys.argv[2])
    spec = f"powersgd:rank={RANK},start={START}"
    name = "horovod" if mode == "horovod" else "ddp"
    config = BackendConfig(name=name, horovod=HorovodOptions(compression=spec if mode == "horovod" else "none"),
                           ddp=DDPOptions(compression=spec if mode == "ddp" else "none"))
    backend = create_backend(config)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    if mode == "torch":
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        net = DistributedDataParallel(net)
        state = PowerSGDState(None, matrix_approximation_rank=RANK, start_powerSGD_iter=START,
                              min_compression_rate=2, use_error_feedback=True, warm_start=True, random_seed=0)
        net.register_comm_hook(state, powerSGD_hook)
    else:
        net, opt = backend.wrap(net, opt)
    gen = torch.Generator().manual_seed(100 + backend.rank)  # each rank its own data
    after = []
    for _ in range(STEPS):
        x = torch.randn(BATCH, 20, generator=gen)
        y = torch.randint(0, 4, (BATCH,), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        after.append([p.detach().clone() for p in net.parameters()])
    psgd = state if mode == "torch" else backend.strategy.powersgd.state
    torch.save({"after": after, "iter": psgd.iter, "errors": {k: v.clone() for k, v in psgd.error_dict.items()},
                "before": psgd.total_numel_before_compression, "sent": psgd.total_numel_after_compression},
               out / f"{mode}-rank{backend.rank}.pt")
    backend.shutdown()


if __name__ == "__main__":
    main()
