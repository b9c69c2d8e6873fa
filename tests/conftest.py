import os

# One intra-op thread per process: distributed tests run several workers on 2 cores, and
# forked workers must not inherit a live OpenMP pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)
