"""Issue 34, item 6: W1 at K ranks, the time of a Replay.sample(32, 1000, "head", out=) call in modes
decentralized and local (3 x 400 calls, medians), and with --prof a cProfile of 1000 decentralized calls
on rank 0.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py docs/benchmarks/issue34_w1_calls.py --prof
"""
import cProfile, pstats, sys, time, io
import numpy as np
from mpi4py import MPI
from issue34_w1_data import HOPPER_T, w1_replay
comm = MPI.COMM_WORLD
k, rank = comm.size, comm.rank
res = {}
for mode in ("decentralized", "local"):
    rp, b = w1_replay(comm, mode)
    meds = []
    for rnd in range(3):
        comm.Barrier()
        ts = []
        for _ in range(400):
            t0 = time.perf_counter(); rp.sample(32, HOPPER_T, "head", out=b); ts.append(time.perf_counter() - t0)
        meds.append(np.median(ts) * 1e3)
    res[mode] = meds
    if mode == "decentralized" and "--prof" in sys.argv:
        pr = cProfile.Profile()
        comm.Barrier()
        pr.enable()
        for _ in range(1000):
            rp.sample(32, HOPPER_T, "head", out=b)
        pr.disable()
        if rank == 0:
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
            print(s.getvalue())
    rp.close()
if rank == 0:
    print("load", __import__("os").getloadavg())
    for m, v in res.items():
        print(f"K={k} {m:14s} ms/call medians {' '.join(f'{x:.3f}' for x in v)}  -> {np.median(v):.3f} ms, "
              f"{k * 32 * 1000 * 61 / np.median(v) / 1e6:.2f} GB/s")
