"""Issue 34, item 5: a W3 step (Shard.sample(B, 1, out=) + update_priorities(batch.keys)) with the update through
the sample's sorted draw (gear_mpi.selection.sampled_update, "sorted") against the general update ("general":
the same call with that path turned off), alternated in one process; medians of rounds, and the update alone.

    PYTHONPATH=. NUMBA_NUM_THREADS=2 python docs/benchmarks/issue34_w3_update.py 1e7 5 0.5 65536

Arguments: N list, rounds, seconds per phase, B. The shard is compare_peers' W3 shard: N one-float items,
Prioritized(0.6, 0.4), priorities uniform in [0.5, 2) (seed 7); new priorities rng(3).random(B) + 0.01.
"""
import os
import sys

import numba
import numpy as np

import gear_mpi as gm
from gear_mpi.selection import sampled_update
from issue34_w3_shard import w3_shard
from probe_timing import median_time

Ns = [int(float(x)) for x in (sys.argv[1] if len(sys.argv) > 1 else "1e7").split(",")]
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 5
PH = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
B = int(sys.argv[4]) if len(sys.argv) > 4 else 65536
real = sampled_update.update_batch
print("threads", numba.get_num_threads(), "load", os.getloadavg(), gm.__file__)
for n in Ns:
    sh, new_p, batch = w3_shard(n, B)

    def step():
        sh.sample(B, 1, out=batch)
        sh.update_priorities(batch.keys, new_p)

    def update():
        sh.update_priorities(batch.keys, new_p)

    res = {f"{p} {m}": [] for p in ("step", "update") for m in ("sorted", "general")}
    for r in range(ROUNDS):
        for mode in ("sorted", "general"):
            sampled_update.update_batch = real if mode == "sorted" else (lambda *a: None)
            for name, fn in (("step", step), ("update", update)):
                sh.sample(B, 1, out=batch)
                for _ in range(2):
                    fn()
                res[f"{name} {mode}"].append(median_time(fn, PH, 5) * 1e3)
    sampled_update.update_batch = real
    for k, v in res.items():
        print(f"N={n:.0e} B={B} {k:15s} med {np.median(v):7.3f} ms  rounds {' '.join(f'{x:.3f}' for x in v)}")
    print("load", os.getloadavg())
    sh.close()
