"""Diagnosis for before_after_issue15.md (run under flock; PYTHONPATH=<library root>, NUMBA_NUM_THREADS=1 or 2).
after's library: the one-call sample kernel against the chain path (fused off) and the index draw alone."""
import json, os, time
import numpy as np
import gear_mpi as gm

def med(f, reps):
    for _ in range(5): f()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(ts))

for n in (100_000, 10_000_000):
    b = 65536
    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    sh = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=0)
    sh.insert_packed({"x": np.arange(n, dtype=np.float32)}, np.ones(n, np.int64), np.random.default_rng(1).random(n) + 0.01)
    batch = sh.sample(b, 1)
    out = np.empty(b, np.int64); u = np.random.default_rng(2).random(b)
    r = {"N": n, "threads": os.environ.get("NUMBA_NUM_THREADS")}
    r["one_call"] = med(lambda: sh.sample(b, 1, out=batch), 40)
    r["index_draw"] = med(lambda: sh.index.draw(u, out), 40)
    sh._fused = False
    r["chain"] = med(lambda: sh.sample(b, 1, out=batch), 40)
    sh._fused = None
    r["one_call_again"] = med(lambda: sh.sample(b, 1, out=batch), 40)
    print(json.dumps(r), flush=True)
    sh.close()
