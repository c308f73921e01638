"""An insert's index weights: ``insert_packed`` of 2**18 prioritized one-float items into a full shard of 2**21
(every insert evicts as many), medians of 60 inserts after 10 untimed ones.

    NUMBA_NUM_THREADS=1 PYTHONPATH=. python docs/benchmarks/issue34_insert_leaves.py

Run it with ``PYTHONPATH`` set to another checkout to compare versions.
"""
import os
import time

import numba
import numpy as np

import gear_mpi as gm

n = 1 << 18
spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
shard = gm.Shard(spec, 1 << 21, gm.Prioritized(0.6, 0.4), seed=0)
rng = np.random.default_rng(0)
x, lengths, priorities = rng.random(n, dtype=np.float32), np.ones(n, np.int64), rng.random(n) + 0.01
for _ in range(10):
    shard.insert_packed({"x": x}, lengths, priorities)
ts = []
for _ in range(60):
    t0 = time.perf_counter()
    shard.insert_packed({"x": x}, lengths, priorities)
    ts.append(time.perf_counter() - t0)
ts = np.array(ts) * 1e3
print(os.environ.get("PYTHONPATH", ".").split(":")[0], f"{numba.get_num_threads()} thread(s): insert of 2**18 into a full "
      f"2**21 shard: median {np.median(ts):.2f} ms, min {ts.min():.2f}, p75 {np.percentile(ts, 75):.2f}")
