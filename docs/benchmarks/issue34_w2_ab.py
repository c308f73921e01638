"""Issue 34, item 3: the W2 step of this tree against a base tree's, alternated in one process, with the floor.

    PYTHONPATH=$PWD NUMBA_NUM_THREADS=2 python docs/benchmarks/issue34_w2_ab.py BASE 9 0.3

BASE: a copy of the base tree (``git archive``); its sampling kernel runs beside this tree's on W2's shard
(issue34_ab.py, issue34_w2_shard.py). Phases: step (Shard.sample(256, 1, out=) + update_priorities of the
batch's keys) "new" and "base" (the update is this tree's in both; AB_KERNEL_ONLY=1: the base's uniforms drawn
as this tree draws them), and compare_peers' floor. Medians of rounds, in microseconds.
"""
import os
import sys

import numba
import numpy as np

from issue34_ab import base_sample, load_base
from issue34_w2_shard import w2_floor, w2_shard
from probe_timing import median_time

KERNEL_ONLY = os.environ.get("AB_KERNEL_ONLY") == "1"
base = load_base(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 9
PH = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3
N, B = 100_000, 256
shard, new_p, batch, keys = w2_shard(N, B)
floor = w2_floor(shard, batch, B)
shard.sample(B, 1, out=batch)
shard.sample(B, 1, out=batch)
phases = {
    "step new": lambda: (shard.sample(B, 1, out=batch), shard.update_priorities(batch.keys, new_p)),
    "step base": lambda: (base_sample(base, shard, batch, B, KERNEL_ONLY), shard.update_priorities(batch.keys, new_p)),
    "floor": floor,
}
for f in phases.values():
    for _ in range(50):
        f()
res = {k: [] for k in phases}
for r in range(ROUNDS):
    for name, fn in phases.items():
        res[name].append(median_time(fn, PH) * 1e6)
print("threads", numba.get_num_threads(), "load", os.getloadavg())
for k, v in res.items():
    print(f"{k:10s} med {np.median(v):7.1f} us  rounds {' '.join(f'{x:.1f}' for x in v)}")
fl = np.array(res["floor"])
for k in ("step new", "step base"):
    print(f"{k} / floor: median {np.median(np.array(res[k]) / fl):.2f}")
