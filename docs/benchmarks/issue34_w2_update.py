"""Issue 34, item 3: the W2 step (Shard.sample(256, 1, out=) + update_priorities(batch.keys)) with the update
through the sample's sorted draw ("sorted", gear_mpi.selection.sampled_update) against the general small update
("general": that path turned off), and the bare-gather floor, alternated in one process; medians of rounds.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 python docs/benchmarks/issue34_w2_update.py 5 0.4

Arguments: rounds, seconds per phase. The shard is W2's (issue34_w2_shard.py); the floor is compare_peers'.
"""
import ctypes
import os
import sys
import time

import numba
import numpy as np

from gear_mpi.kernels import gather
from gear_mpi.selection import sampled_update
from issue34_w2_shard import w2_shard

N, B = 100_000, 256
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PH = float(sys.argv[2]) if len(sys.argv) > 2 else 0.4
shard, new_p, batch, keys = w2_shard(N, B)
cap = shard.store.capacity
addrs = shard.column_addresses()[0]
sizes = shard.spec.step_bytes_array
rows = np.arange(B, dtype=np.int64)
one, zero = np.ones(B, np.int64), np.zeros(B, np.int64)
outs = batch.byte_views()
rings = tuple(np.frombuffer((ctypes.c_uint8 * int(cap * sz)).from_address(int(a)), np.uint8)
              for a, sz in zip(addrs, sizes))
pool = np.random.default_rng(4).integers(0, N, (400, B))
turn = [0]
no_mask = np.zeros((0, 1), np.bool_)
real = sampled_update.update_batch


def floor():
    turn[0] = (turn[0] + 1) % len(pool)
    gather.gather_columns(rings, sizes, cap, pool[turn[0]], one, zero, rows, outs, 1, no_mask)


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
        ts = []
        t_end = time.perf_counter() + PH
        while time.perf_counter() < t_end:
            t0 = time.perf_counter()
            (floor if name == "floor" else step)()
            ts.append(time.perf_counter() - t0)
        res[name].append(np.median(ts) * 1e6)
sampled_update.update_batch = real
print("threads", numba.get_num_threads(), "load", os.getloadavg())
for k, v in res.items():
    print(f"{k:13s} med {np.median(v):7.1f} us  rounds {' '.join(f'{x:.1f}' for x in v)}")
fl = np.array(res["floor"])
for k in ("step sorted", "step general"):
    print(f"{k} / floor per round: {' '.join(f'{x:.2f}' for x in np.array(res[k]) / fl)}"
          f"  median {np.median(np.array(res[k]) / fl):.2f}")
