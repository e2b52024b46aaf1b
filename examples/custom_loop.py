"""Your own training loop on hvdkit's backend API; it never branches on the backend.

    python examples/custom_loop.py --backend local
    horovodrun -np 2 -H localhost:2 --gloo python examples/custom_loop.py --backend horovod
    mpirun -np 2 python examples/custom_loop.py --backend ddp
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from hvdkit import BackendConfig, build_model, create_backend, synthetic_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="local", choices=["horovod", "ddp", "local"])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--accumulation-steps", type=int, default=2)
args = parser.parse_args()

k = args.accumulation_steps
backend = create_backend(BackendConfig(name=args.backend, accumulation_steps=k))
master = backend.is_master  # global rank 0: the only rank that prints

model = build_model("mlp")
# one worker's LR, scaled by how many micro-batches make up the global batch
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * backend.size * k, momentum=0.9)
model, optimizer = backend.wrap(model, optimizer)
backend.broadcast_state(model, optimizer)  # every rank starts from rank 0's weights

dataset = synthetic_dataset("mlp", 2048)
sampler = DistributedSampler(dataset, num_replicas=backend.size, rank=backend.rank, drop_last=True)
loader = DataLoader(dataset, batch_size=32, sampler=sampler, drop_last=True)
for epoch in range(args.epochs):
    sampler.set_epoch(epoch)
    total, batches = torch.zeros(()), 0
    for i, (x, y) in enumerate(loader):
        x, y = x.to(backend.device), y.to(backend.device)
        last = (i + 1) % k == 0
        with backend.accumulate(model, sync=last):  # communicate on the last micro-batch only
            loss = F.cross_entropy(model(x), y) / k
            loss.backward()
        total += loss.detach().cpu() * k
        batches += 1
        if last:
            optimizer.step()
            optimizer.zero_grad()
    mean_loss = backend.allreduce_metric(total / max(batches, 1))
    if master:
        print(f"epoch {epoch} loss {mean_loss:.4f} ({backend.size} ranks, {args.backend})")
backend.shutdown()
