"""Benchmarks: Horovod vs DDP, tensor fusion, scaling, allreduce bandwidth, checkpoint I/O."""
