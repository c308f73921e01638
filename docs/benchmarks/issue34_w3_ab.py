"""Issue 34, item 5: the W3 step of this tree against a base tree's, alternated in one process; medians of rounds.

    PYTHONPATH=$PWD GEAR_MPI_COLLAPSE=1 NUMBA_NUM_THREADS=2 python docs/benchmarks/issue34_w3_ab.py BASE 1e7 5 0.3

BASE: a copy of the base tree (``git archive``); its sampling kernel runs beside this tree's on the same shard
(issue34_ab.py). Phases: step (Shard.sample(65536, 1, out=) + update_priorities of the batch's keys) and sample,
each "new" (this tree) and "base"; the update is this tree's in both. Prints medians and each round.
With AB_KERNEL_ONLY=1 the base draws its uniforms as this tree does, so that only the kernels differ.
"""
import os
import sys

import numba
import numpy as np

from issue34_ab import base_sample, load_base
from issue34_w3_shard import w3_setup
from probe_timing import median_time

KERNEL_ONLY = os.environ.get("AB_KERNEL_ONLY") == "1"  # base drawn with this tree's uniforms: kernels alone
base = load_base(sys.argv[1])
N, ROUNDS, PH, B, sh, new_p, batch = w3_setup(sys.argv[2:])
phases = {
    "step new": lambda: (sh.sample(B, 1, out=batch), sh.update_priorities(batch.keys, new_p)),
    "step base": lambda: (base_sample(base, sh, batch, B, KERNEL_ONLY), sh.update_priorities(batch.keys, new_p)),
    "sample new": lambda: sh.sample(B, 1, out=batch),
    "sample base": lambda: base_sample(base, sh, batch, B, KERNEL_ONLY),
}
for f in phases.values():
    f()
res = {k: [] for k in phases}
for r in range(ROUNDS):
    for name, fn in phases.items():
        res[name].append(median_time(fn, PH, 5) * 1e3)
print("threads", numba.get_num_threads(), "N", N, "load", os.getloadavg())
for k, v in res.items():
    print(f"{k:12s} med {np.median(v):7.3f} ms  rounds {' '.join(f'{x:.3f}' for x in v)}")
