"""A/B of one compressed replay's sample (twenty-sixth session): mpiexec -n 2 python -m mpi4py THIS_FILE.

Replay.sample(32, 1) over zstd-compressed 84x84 uint8 frames (chunks of 4) with 4-frame stacks, 5,000 steps a
rank; rank 0 prints the median and spread of 5 runs of 100 calls (docs/BENCHMARKS.md).
"""
import time, numpy as np, gear_mpi as gm
from mpi4py import MPI
comm = MPI.COMM_WORLD
spec = gm.TrajectorySpec({"frame": ((84, 84), "uint8", gm.Compressed(chunk=4)), "r": ((), "float32"),
                          "obs": gm.FrameStack("frame", 4, "first")}, max_length=200)
rng = np.random.default_rng(comm.rank)
r = gm.Replay(spec, 6000, gm.Uniform(), seed=1, timeout=60)
for i in range(25):
    n = 200
    base = rng.integers(0, 255, (n, 84, 84), dtype=np.uint8) // 64 * 64  # compressible
    r.insert({"frame": base, "r": rng.random(n).astype(np.float32)})
for _ in range(20):
    r.sample(32, 1)
res = []
for rep in range(5):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(100):
        r.sample(32, 1)
    res.append((time.perf_counter() - t0) / 100 * 1e6)
if comm.rank == 0:
    print(f"{comm.size} ranks: Replay.sample(32, 1) compressed frames + stacks: median {np.median(res):.0f} us "
          f"(min {min(res):.0f}, max {max(res):.0f})")
r.close()
