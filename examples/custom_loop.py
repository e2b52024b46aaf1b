"""Your own training loop, with what `hvdkit train` guarantees: preemption, exact resume, exact metrics.

    python examples/custom_loop.py --backend local
    hvdkit run -np 2 -- python examples/custom_loop.py --backend horovod --checkpoint-dir ck
    hvdkit slurm --backend ddp --tasks-per-node 2 --submit -- python examples/custom_loop.py --backend ddp --checkpoint-dir ck

Killed, preempted (SIGUSR1/USR2/TERM) or requeued at any step, it continues from its last
checkpoint and ends with the same weights as a run that was never interrupted.
"""

import argparse
import logging

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, random_split

import hvdkit

parser = argparse.ArgumentParser()
parser.add_argument("--backend", default="horovod", choices=["horovod", "ddp", "local"])
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--accumulation-steps", type=int, default=2)
parser.add_argument("--checkpoint-dir", default=None)
parser.add_argument("--checkpoint-every", type=int, default=10)
args = parser.parse_args()
# hvdkit is a library here: its lines (resume, preemption) reach this application's logging
logging.basicConfig(level=logging.INFO, format="%(message)s")

k, batch = args.accumulation_steps, 32
with hvdkit.create_backend(hvdkit.BackendConfig(name=args.backend, accumulation_steps=k)) as backend:
    master = backend.is_master  # global rank 0: the only rank that prints
    model = hvdkit.build_model("mlp", seed=backend.rank)  # different per rank until restore() syncs them
    # one worker's LR, scaled by how many micro-batches make up the global batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * backend.size * k, momentum=0.9)
    model, optimizer = backend.wrap(model, optimizer)

    data = hvdkit.synthetic_dataset("mlp", 2560)
    train, val = random_split(data, [2048, 512], generator=torch.Generator().manual_seed(0))
    sampler = hvdkit.ShardSampler(len(train), backend.size, backend.rank, seed=0)  # resumable position
    states = {"model": model, "optimizer": optimizer, "sampler": sampler, "step": 0}
    ckpt = hvdkit.CheckpointManager(args.checkpoint_dir, backend) if args.checkpoint_dir else None
    if ckpt is not None:
        ckpt.restore(states)  # the newest valid checkpoint, or rank 0's fresh weights, on every rank
    else:
        backend.broadcast_state(model, optimizer)  # every rank starts from rank 0's weights
    # From here on USR1/USR2/TERM are caught; check() makes every rank stop at the same step,
    # saves `states`, asks Slurm to requeue, and exits (0 if requeued, else 75).
    preemption = hvdkit.Preemption(backend, checkpoint=ckpt, states=states) if ckpt else hvdkit.Preemption(backend)
    task = hvdkit.make_task("classification")

    with preemption:
        while sampler.epoch < args.epochs:
            loader = DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True)
            # whole optimizer steps only, as hvdkit train: micro-batches left over at the end
            # would carry into the next epoch's first step (backend.accumulate refuses that)
            micro_batches = len(loader) // k * k
            for i, batch_xy in enumerate(loader):
                if i == micro_batches:
                    break
                x, y = (t.to(backend.device) for t in batch_xy)
                last = (i + 1) % k == 0
                with backend.accumulate(model, sync=last):  # communicate on the last micro-batch only
                    (F.cross_entropy(model(x), y) / k).backward()
                sampler.advance(batch * backend.size)  # global samples consumed: where a resume starts
                if not last:
                    continue
                backend.optimizer_step(optimizer)  # the order each backend needs (fp16, clipping)
                optimizer.zero_grad()
                states["step"] += 1
                preemption.check(states["step"])  # collective, one tiny allreduce
                if ckpt and states["step"] % args.checkpoint_every == 0:
                    ckpt.save(states["step"], states)
            sampler.set_epoch(sampler.epoch + 1)
            # every validation sample once, whatever the world size (no DistributedSampler padding)
            metrics = hvdkit.evaluate(backend, model, val, task, batch_size=64)
            if ckpt:
                ckpt.save(states["step"], states, metrics)
            if master:
                print(f"epoch {sampler.epoch - 1} val_loss {metrics['loss']:.4f} val_accuracy "
                      f"{metrics['accuracy']:.4f} ({backend.size} ranks, {args.backend})", flush=True)
    backend.sync_buffers(model)
    digest = hvdkit.param_digest(backend.unwrap(model))
    if master:
        print(f"done: step {states['step']} digest {digest}", flush=True)
