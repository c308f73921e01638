"""Issue 34, item 3: compare_peers' W2 floor (the bare gather of 256 random rows) in other forms, beside the
sample it is the floor of, in one process; medians of rounds.

    PYTHONPATH=. NUMBA_NUM_THREADS=1 python docs/benchmarks/issue34_w2_floor_forms.py [rounds] [seconds]

Forms: floor (gather.gather_columns over compare_peers' 400 fixed row sets, as issue34_w2_shard.w2_floor);
floor_sorted (each row set sorted); one_run (gather._gather_run per column over all rows from a plain @njit
loop, no parallel region); chunked (the same in the eight runs gather_columns makes); sample
(Shard.sample(256, 1, out=): draw, placement and copy).
"""
import ctypes
import sys
import time

import numpy as np
from numba import njit

from gear_mpi.kernels import gather
from issue34_w2_shard import w2_shard

N, B = 100_000, 256
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
PH = float(sys.argv[2]) if len(sys.argv) > 2 else 0.4
shard, new_p, batch, keys = w2_shard(N, B)
cap = shard.store.capacity
sizes = shard.spec.step_bytes_array
rings = tuple(np.frombuffer((ctypes.c_uint8 * int(cap * sz)).from_address(int(a)), np.uint8)
              for a, sz in zip(shard.column_addresses()[0], sizes))
addrs = np.array([r.ctypes.data for r in rings], np.int64)
rows, one, zero = np.arange(B, dtype=np.int64), np.ones(B, np.int64), np.zeros(B, np.int64)
outs, no_mask = batch.byte_views(), np.zeros((0, 1), np.bool_)
pool = np.random.default_rng(4).integers(0, len(shard), (400, B))
sorted_pool = np.sort(pool, axis=1)


@njit(nogil=True)
def one_run(addrs, sizes, cap, starts, nv, pf, rows, outs):
    for c in range(len(outs)):
        gather._gather_run(addrs[c], cap, sizes[c], starts, nv, pf, rows, outs[c], sizes[c], 0, starts.shape[0])


@njit(nogil=True)
def chunked(addrs, sizes, cap, starts, nv, pf, rows, outs):
    b = starts.shape[0]
    for c in range(len(outs)):
        for t in range(8):
            gather._gather_run(addrs[c], cap, sizes[c], starts, nv, pf, rows, outs[c], sizes[c], t * b // 8,
                        (t + 1) * b // 8)


def in_turn(call, sets):
    turn = [0]

    def f():
        turn[0] = (turn[0] + 1) % len(sets)
        call(sets[turn[0]])
    return f


forms = {
    "floor": in_turn(lambda s: gather.gather_columns(rings, sizes, cap, s, one, zero, rows, outs, 1, no_mask), pool),
    "floor_sorted": in_turn(lambda s: gather.gather_columns(rings, sizes, cap, s, one, zero, rows, outs, 1, no_mask),
                            sorted_pool),
    "one_run": in_turn(lambda s: one_run(addrs, sizes, cap, s, one, zero, rows, outs), pool),
    "chunked": in_turn(lambda s: chunked(addrs, sizes, cap, s, one, zero, rows, outs), pool),
    "sample": lambda: shard.sample(B, 1, out=batch),
}
for f in forms.values():
    f()
res = {k: [] for k in forms}
for _ in range(ROUNDS):
    for k, f in forms.items():
        t0, ts = time.perf_counter(), []
        while time.perf_counter() - t0 < PH:
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        res[k].append(np.median(ts) * 1e6)
for k, v in res.items():
    print(f"{k:14s} med {np.median(v):7.1f} us  rounds " + " ".join(f"{x:.1f}" for x in v))
