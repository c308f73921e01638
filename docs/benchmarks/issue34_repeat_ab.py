"""Issue 34: in-process A/B, Shard.sample(256, 64, out=batch) of hopper rows through the full path (record dropped before each
call) against the repeat path, alternated; and W2's 4 KiB one-step rows likewise.

    PYTHONPATH=. NUMBA_NUM_THREADS=2 python docs/benchmarks/issue34_repeat_ab.py
"""
import time, os
import numpy as np, numba
import gear_mpi as gm
def run(spec, items, L, B, W):
    sh = gm.Shard(spec, items * L, gm.Prioritized(0.6, 0.4), seed=0)
    rng = np.random.default_rng(0)
    cols = {c.name: (rng.random((items * L,) + c.shape) * 100).astype(c.dtype) for c in spec.columns}
    sh.insert_packed(cols, np.full(items, L, np.int64), rng.random(items) + 0.1)
    out = sh.sample(B, W)
    def full():
        sh._repeat = None
        sh.sample(B, W, out=out)
    def again():
        sh.sample(B, W, out=out)
    res = {"full": [], "again": []}
    for f in (full, again):
        for _ in range(20): f()
    for r in range(7):
        for name, f in (("full", full), ("again", again)) if r % 2 == 0 else (("again", again), ("full", full)):
            ts = []
            t_end = time.perf_counter() + 0.3
            while time.perf_counter() < t_end:
                t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
            res[name].append(np.median(ts) * 1e6)
    for k, v in res.items():
        print(f"  {k:6s} med {np.median(v):8.1f} us  rounds {' '.join(f'{x:.1f}' for x in v)}")
    sh.close()
print("threads", numba.get_num_threads(), "load", os.getloadavg(), gm.__file__)
print("hopper B=256 W=64 (1000 trajectories of 100 steps)")
run(gm.TrajectorySpec({"obs": ((11,), "float32"), "action": ((3,), "float32"), "reward": ((), "float32"), "done": ((), "bool")}, max_length=100), 1000, 100, 256, 64)
print("W2 rows B=256 W=1 (100000 one-step 4104-byte items)")
run(gm.TrajectorySpec({"obs": ((4096,), "uint8"), "action": ((), "float32"), "reward": ((), "float32")}, max_length=1), 100000, 1, 256, 1)
