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


def w3_setup(args: list):
    """The probes' arguments ``N ROUNDS PH`` (defaults 1e7, 5, 0.3 s) and their W3 shard, B = 65536, sampled
    once into its batch: ``(N, ROUNDS, PH, B, shard, new priorities, batch)``."""
    n = int(float(args[0])) if len(args) > 0 else 10_000_000
    rounds = int(args[1]) if len(args) > 1 else 5
    ph = float(args[2]) if len(args) > 2 else 0.3
    b = 65536
    shard, new_p, batch = w3_shard(n, b)
    shard.sample(b, 1, out=batch)
    return n, rounds, ph, b, shard, new_p, batch
