"""Issue 34, item 6: where a repeated two-rank W1 call goes (gear_mpi/distributed/repeat.py): the whole
``Replay.sample(32, 1000, "head", out=)`` call, its gather kernel, its waits on the node board, and the rest
(Python, draws, choices), medians over 3 x 400 calls a rank; beside them a ``local`` call and its one kernel.
Prioritized, as W1; one numba thread per rank.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py docs/benchmarks/issue34_w1_phases.py
"""
import time

import numpy as np
from mpi4py import MPI

from gear_mpi.distributed import repeat
from gear_mpi.kernels import gather as gather_kernels
from gear_mpi.kernels import local_sample

from issue34_w1_data import HOPPER_T, w1_replay

comm = MPI.COMM_WORLD
k, rank = comm.size, comm.rank
spent = {"kernel": 0.0}


class Timed:
    """A stand-in for a kernel module whose one kernel adds its time to ``spent["kernel"]``."""

    def __init__(self, module, name):
        self.module, self.name = module, name
        self.fn = getattr(module, name)

    def __getattr__(self, attr):
        return getattr(self.module, attr)

    def timed(self, *args):
        t0 = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            spent["kernel"] += time.perf_counter() - t0


def install():
    g = Timed(gather_kernels, "gather_rows_from_owners")
    setattr(g, "gather_rows_from_owners", g.timed)
    repeat.gather_kernels = g
    loc = Timed(local_sample, "_sample_kernel")
    local_sample._sample_kernel = loc.timed


res = {}
for mode in ("decentralized", "local"):
    rp, b = w1_replay(comm, mode)
    if mode == "decentralized":
        install()
    rows = []
    for rnd in range(3):
        comm.Barrier()
        call, kern, wait = [], [], []
        for _ in range(400):
            w0, spent["kernel"] = rp.comm.waited, 0.0
            t0 = time.perf_counter()
            rp.sample(32, HOPPER_T, "head", out=b)
            call.append(time.perf_counter() - t0)
            kern.append(spent["kernel"])
            wait.append(rp.comm.waited - w0)
        call, kern, wait = (np.array(x) * 1e3 for x in (call, kern, wait))
        rows.append((np.median(call), np.median(kern), np.median(wait), np.median(call - kern - wait)))
    res[mode] = np.array(rows)
    rp.close()
if rank == 0:
    print("load", [round(x, 2) for x in __import__("os").getloadavg()])
    print(f"K={k} ms, medians of 3 x 400 calls (per round: call / kernel / board waits / rest)")
    for m, v in res.items():
        per = "  ".join(f"{a:.3f}/{b:.3f}/{c:.3f}/{d:.3f}" for a, b, c, d in v)
        med = np.median(v, 0)
        print(f"{m:14s} {per}  -> call {med[0]:.3f} kernel {med[1]:.3f} waits {med[2]:.3f} rest {med[3]:.3f}"
              f"  ({k * 32 * 1000 * 61 / med[0] / 1e6:.2f} GB/s)")
