"""Diagnosis for before_after_issue15.md (run under flock; PYTHONPATH=<library root>, NUMBA_NUM_THREADS=1 or 2).
Split sample / update_priorities times of the W2 and W3 Shard steps (compare_peers' cases), one library."""
import json, os, sys, time
import numpy as np
import gear_mpi as gm

def fill(shard, cols, n):
    put = getattr(shard, "insert_packed", None) or shard.store_packed
    put(cols, np.ones(n, np.int64), np.random.default_rng(1).random(n) + 0.01)

def case(name, spec, cols, n, b, reps):
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=0)
    fill(shard, cols, n)
    new_p = np.random.default_rng(3).random(b) + 0.01
    batch = shard.sample(b, 1)
    ts, tu = [], []
    for i in range(reps + 5):
        t0 = time.perf_counter(); shard.sample(b, 1, out=batch); t1 = time.perf_counter()
        shard.update_priorities(batch.keys, new_p); t2 = time.perf_counter()
        if i >= 5:
            ts.append(t1 - t0); tu.append(t2 - t1)
    shard.close()
    print(json.dumps({"case": name, "threads": os.environ.get("NUMBA_NUM_THREADS"), "lib": gm.__file__,
                      "sample_ms": 1e3 * float(np.median(ts)), "update_ms": 1e3 * float(np.median(tu)),
                      "sample_min": 1e3 * min(ts), "update_min": 1e3 * min(tu)}), flush=True)

n = 100_000
case("W3 N=1e5 B=65536", gm.TrajectorySpec({"x": ((), "float32")}, max_length=1),
     {"x": np.arange(n, dtype=np.float32)}, n, 65536, 60)
case("W3 N=1e7 B=65536", gm.TrajectorySpec({"x": ((), "float32")}, max_length=1),
     {"x": np.arange(10_000_000, dtype=np.float32)}, 10_000_000, 65536, 40)
spec = gm.TrajectorySpec({"obs": ((4096,), "uint8"), "action": ((), "float32"), "reward": ((), "float32")}, max_length=1)
cols = {"obs": np.random.default_rng(0).integers(0, 255, (n, 4096), dtype=np.uint8),
        "action": np.zeros(n, np.float32), "reward": np.zeros(n, np.float32)}
case("W2 B=1024", spec, cols, n, 1024, 300)
case("W2 B=256", spec, cols, n, 256, 600)
