"""A node of several processes (the GPUs of one workstation) acting as one peer: `worker` (ranks 1..N−1, which
train beside rank 0 and do nothing else) and `launcher` (`peer --workers N`). The data-parallel group itself, which
the inner phase uses, is maths/data_parallel.py."""
