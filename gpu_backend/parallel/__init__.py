"""Tensor parallelism: one model split over the GPUs of one host (`--tensor-parallel-size N`).

`shard.py` says how the weights split (heads and MLP columns per rank); `runner.py` is the runner the engines
see (one scheduler, one ring, one step buffer pushed to every rank); the kernels that join the ranks inside
the captured graphs (all-reduce, announce, wait, the followers' loop) are kernels/csrc/tp_comm.cu.
"""
