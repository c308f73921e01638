"""Issue 34, item 3: the W2 step (Shard.sample(256, 1, out=) + update_priorities(batch.keys)) with the update
through the sample's sorted draw ("sorted", gear_mpi.selection.sampled_update) against the general small update
("general": that path turned off), and the bare-gather floor, alternated in one process; medians of rounds.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 python docs/benchmarks/issue34_w2_update.py 5 0.4

Arguments: rounds, seconds per phase. The shard is W2's (issue34_w2_shard.py); the floor is compare_peers'.
"""
import os
import sys

import numba
import numpy as np

from gear_mpi.selection import sampled_update
from issue34_w2_shard import w2_floor, w2_shard
from probe_timing import median_time

N, B = 100_000, 256
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PH = float(sys.argv[2]) if len(sys.argv) > 2 else 0.4
shard, new_p, batch, keys = w2_shard(N, B)
floor = w2_floor(shard, batch, B)
real = sampled_update.update_batch


def step():
    shard.sample(B, 1, out=batch)
    shard.update_priorities(batch.keys, new_p)


res = {"step sorted": [], "step general": [], "floor": []}
for _ in range(50):
    step()
    floor()
for r in range(ROUNDS):
    for name in res:
        sampled_update.update_batch = (lambda *a: None) if name == "step general" else real
        res[name].append(median_time(floor if name == "floor" else step, PH) * 1e6)
sampled_update.update_batch = real
print("threads", numba.get_num_threads(), "load", os.getloadavg())
for k, v in res.items():
    print(f"{k:13s} med {np.median(v):7.1f} us  rounds {' '.join(f'{x:.1f}' for x in v)}")
fl = np.array(res["floor"])
for k in ("step sorted", "step general"):
    print(f"{k} / floor per round: {' '.join(f'{x:.2f}' for x in np.array(res[k]) / fl)}"
          f"  median {np.median(np.array(res[k]) / fl):.2f}")
