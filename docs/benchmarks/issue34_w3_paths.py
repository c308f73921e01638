"""Issue 34, item 5: a W3 step (Shard.sample(65536, 1, out=) + update_priorities) through the one-call kernel
against the plain chain, alternated in one process (``Shard._fused``, which also keeps the repeated call's
record out of the chain's turns), per N; medians of 5 rounds of 0.5 s and minor page faults a step. (Until
2026-12-06 it switched ``local_sample.ONE_CALL_MIN_CAPACITY``, which the repeated call's record bypassed once
the one-call path had run: both modes then timed the one call.)

    PYTHONPATH=. NUMBA_NUM_THREADS=2 python docs/benchmarks/issue34_w3_paths.py 1e5,1e6
"""
import sys, time, os, resource
import numpy as np
import numba
import gear_mpi as gm
B = 65536
Ns = [int(float(x)) for x in (sys.argv[1] if len(sys.argv) > 1 else "1e5,1e6").split(",")]
rounds = 5
print("threads", numba.get_num_threads(), "load", os.getloadavg(), gm.__file__)
for n in Ns:
    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    sh = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=0)
    sh.insert_packed({"x": np.arange(n, dtype=np.float32)}, np.ones(n, np.int64), np.random.default_rng(7).uniform(0.5, 2, n))
    new_p = np.random.default_rng(3).random(B) + 0.01
    batch = sh.sample(B, 1)
    def step():
        sh.sample(B, 1, out=batch)
        sh.update_priorities(batch.keys, new_p)
    res = {"one_call": [], "chain": []}
    flt = {"one_call": [], "chain": []}
    for r in range(rounds):
        for mode in res:
            sh._fused = mode == "one_call"
            for _ in range(2): step()
            ts = []
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t_end = time.perf_counter() + 0.5
            while time.perf_counter() < t_end or len(ts) < 5:
                t0 = time.perf_counter(); step(); ts.append(time.perf_counter() - t0)
            flt[mode].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / len(ts))
            res[mode].append(np.median(ts) * 1e3)
    sh._fused = None
    for m, v in res.items():
        print(f"N={n:.0e} {m:9s} med {np.median(v):6.2f} ms rounds {' '.join(f'{x:.2f}' for x in v)}  faults/step {np.median(flt[m]):.0f}")
    sh.close()
