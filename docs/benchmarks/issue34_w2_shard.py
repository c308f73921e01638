"""Issue 34, item 3: the W2 shard both probe scripts time (issue34_w2_probe.py, issue34_w2_parts.py).

One-step items of 4104 bytes (obs uint8[4096], action, reward), Prioritized(0.6, 0.4), filled with seed 0.
"""
import numpy as np

import gear_mpi as gm


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
