"""Worker: time a large gloo allreduce between two nodes' fabric interfaces.

usage: link_allreduce.py RANK STORE_FILE MIB REPS      (one process on each of two nodes)
Rendezvous through a FileStore on the shared file system (no port to choose); gloo sends over
eth1, the fabric. Rank 0 prints one JSON line: {"busbw": [bytes/s per repetition]}, where
busbw = bytes x 2(n-1)/n / seconds, the rate each rank's link must carry.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

rank, store, mib, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth1")
dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
tensor = torch.ones(mib * 2**20 // 4)
dist.all_reduce(tensor)  # warm-up: the pairs' connections are made here
seconds = []
for _ in range(reps):
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(tensor)
    seconds.append(time.perf_counter() - start)
if rank == 0:
    world, nbytes = 2, tensor.numel() * 4
    print(json.dumps({"busbw": [nbytes * 2 * (world - 1) / world / s for s in seconds]}), flush=True)
dist.destroy_process_group()
