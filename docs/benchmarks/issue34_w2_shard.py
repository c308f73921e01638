"""Issue 34, item 3: the W2 shard the probe scripts time (issue34_w2_probe.py, issue34_w2_parts.py,
issue34_w2_update.py) and the bare-gather floor beside it.

One-step items of 4104 bytes (obs uint8[4096], action, reward), Prioritized(0.6, 0.4), filled with seed 0.
"""
import ctypes

import numpy as np

import gear_mpi as gm
from gear_mpi.kernels import gather


def w2_shard(n: int, b: int):
    """(shard, new priorities for b items, a first batch of b, its keys): the same draws as before, seed 0."""
    spec = gm.TrajectorySpec({"obs": ((4096,), "uint8"), "action": ((), "float32"), "reward": ((), "float32")},
                             max_length=1)
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=0)
    rng = np.random.default_rng(0)
    shard.insert_packed({"obs": rng.integers(0, 255, (n, 4096), dtype=np.uint8),
                         "action": rng.random(n, dtype=np.float32), "reward": rng.random(n, dtype=np.float32)},
                        np.ones(n, np.int64), rng.random(n) + 0.01)
    new_p = rng.random(b) + 0.01
    batch = shard.sample(b, 1)
    return shard, new_p, batch, batch.keys.numpy().copy()


def w2_floor(shard, batch, b: int):
    """compare_peers' floor: a callable gathering ``b`` random rows of ``shard`` into ``batch``'s buffers
    with the bare gather kernel (400 fixed row sets, seed 4, taken in turn)."""
    cap = shard.store.capacity
    sizes = shard.spec.step_bytes_array
    rings = tuple(np.frombuffer((ctypes.c_uint8 * int(cap * sz)).from_address(int(a)), np.uint8)
                  for a, sz in zip(shard.column_addresses()[0], sizes))
    rows, one, zero = np.arange(b, dtype=np.int64), np.ones(b, np.int64), np.zeros(b, np.int64)
    outs, no_mask = batch.byte_views(), np.zeros((0, 1), np.bool_)
    pool = np.random.default_rng(4).integers(0, len(shard), (400, b))
    turn = [0]

    def floor():
        turn[0] = (turn[0] + 1) % len(pool)
        gather.gather_columns(rings, sizes, cap, pool[turn[0]], one, zero, rows, outs, 1, no_mask)
    return floor

