"""Issue 34, item 5: the W3 shard the probe scripts time (issue34_w3_parts.py, issue34_w3_update.py):
compare_peers' W3 shard, N one-float items, Prioritized(0.6, 0.4), priorities uniform in [0.5, 2) (seed 7).
"""
import numpy as np

import gear_mpi as gm


def w3_shard(n: int, b: int):
    """(shard, new priorities for b items from rng(3), a first batch of b sampled from it)."""
    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=0)
    shard.insert_packed({"x": np.arange(n, dtype=np.float32)}, np.ones(n, np.int64),
                        np.random.default_rng(7).uniform(0.5, 2, n))
    new_p = np.random.default_rng(3).random(b) + 0.01
    return shard, new_p, shard.sample(b, 1)
