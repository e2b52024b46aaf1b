"""Baseline for hvdkit's overhead: the same training in plain ``horovod.torch``.

Written the way Horovod's examples/pytorch do it: init, threads, scale LR,
DistributedOptimizer, broadcast, DistributedSampler, a bare loop. It shares
only the *workload* with hvdkit (model and synthetic data from
``hvdkit.models``, so both runs compute exactly the same); none of hvdkit's
training machinery (backends, sampler, scheduler, preemption flag, checks) runs.
It sits with the backends because it is Horovod-only code; ``hvdkit bench`` launches it.

usage: python -m hvdkit.backends.raw_horovod MODEL EPOCHS NUM_SAMPLES BATCH OUT.json
"""

import json
import os
import sys
import time

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from hvdkit.models import build_model, synthetic_dataset

model_name, out = sys.argv[1], sys.argv[5]
epochs, num_samples, batch = (int(a) for a in sys.argv[2:5])
hvd.init()
torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // hvd.local_size()))  # as hvdkit does
model = build_model(model_name, seed=0)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
dataset = synthetic_dataset(model_name, num_samples)
sampler: DistributedSampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(),
                                                 shuffle=True, seed=0, drop_last=True)
loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True)
rates = []
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    t0 = time.perf_counter()
    steps = 0
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        steps += 1
    elapsed = hvd.allreduce(torch.tensor(time.perf_counter() - t0), op=hvd.Max, name=f"t{epoch}").item()
    rates.append(steps * batch * hvd.size() / elapsed)
if hvd.rank() == 0:
    with open(out, "w") as f:
        json.dump({"samples_per_sec": rates}, f)
hvd.shutdown()
