"""Issue 34, item 3: the W2 step against its floor in one process, phases alternated, medians of rounds.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 python docs/benchmarks/issue34_w2_probe.py 3 0.4 step,floor,sample,update

Arguments: rounds, seconds per phase, phases (step = Shard.sample(256, 1, out=) + update_priorities of the
batch's keys; floor = compare_peers' bare gather of 256 random rows; sample; update). The shard is W2's:
100,000 one-step items of 4104 bytes (obs uint8[4096], action, reward), Prioritized(0.6, 0.4).
"""
import sys, os
import numpy as np
import numba
from issue34_w2_shard import w2_floor, w2_shard
from probe_timing import median_time

N, B = 100_000, 256
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PH = float(sys.argv[2]) if len(sys.argv) > 2 else 0.4
shard, new_p, batch, keys = w2_shard(N, B)

floor = w2_floor(shard, batch, B)
def step():
    shard.sample(B, 1, out=batch)
    shard.update_priorities(batch.keys, new_p)
def sample():
    shard.sample(B, 1, out=batch)
def update():
    shard.update_priorities(keys, new_p)
phases = dict(step=step, floor=floor, sample=sample, update=update)
sel = sys.argv[3].split(",") if len(sys.argv) > 3 else list(phases)
res = {k: [] for k in sel}
for f in [phases[k] for k in sel]:
    for _ in range(50): f()
for r in range(ROUNDS):
    for name in sel:
        f = phases[name]
        res[name].append(median_time(f, PH) * 1e6)
print("threads", numba.get_num_threads(), "load", os.getloadavg())
for k, v in res.items():
    print(f"{k:14s} med {np.median(v):7.1f} us  rounds {' '.join(f'{x:.1f}' for x in v)}")
