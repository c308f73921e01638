"""Issue 34, item 6: W1 at K ranks, the time of a Replay.sample(32, 1000, "head", out=) call in modes
decentralized and local (3 x 400 calls, medians), and with --prof a cProfile of 1000 decentralized calls
on rank 0.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 mpiexec -n 2 python -m mpi4py docs/benchmarks/issue34_w1_calls.py --prof
"""
import cProfile, pstats, sys, time, io
import numpy as np
from mpi4py import MPI
import gear_mpi as gm
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))
from scripts.peers._common import HOPPER, HOPPER_T, hopper_trajectory, hopper_priorities
comm = MPI.COMM_WORLD
k, rank = comm.size, comm.rank
mine = 1024 // k
spec = gm.TrajectorySpec(HOPPER, max_length=HOPPER_T)
traj = [hopper_trajectory(rank * 100_000 + i) for i in range(16)]
trajs = [traj[i % 16] for i in range(mine)]
prio = hopper_priorities(1024)[rank::k][:mine]
res = {}
for mode in ("decentralized", "local"):
    rp = gm.Replay(spec, mine * HOPPER_T, gm.Prioritized(0.6, 0.4), mode=mode, comm=comm, seed=0, timeout=300)
    rp.insert_many(trajs, prio)
    b = None
    for _ in range(50):
        b = rp.sample(32, HOPPER_T, "head", out=b)
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
