"""The global distribution of the decentralized and centralized modes is exactly p_i / sum p.

Chi-square over all shards (uneven, one empty), fixed seeds; rank 0 tests the counts of
every rank's draws. Always over node shared memory (the window path does not change
which items are drawn; tests/mpi/test_windows.py covers both paths).
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, fill, make_replay, shard_sizes

SELECTORS = {"Prioritized": lambda: gm.Prioritized(0.8, 0.4), "Uniform": lambda: gm.Uniform()}


def chisquare_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare
    return float(chisquare(counts, probs * counts.sum()).pvalue)


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("mode", ["decentralized", "centralized"])
def test_global_distribution_is_exact(mode, selector, record_property):
    sel = SELECTORS[selector]()
    replay = make_replay(sel, mode)
    ref = fill(replay, shard_sizes()[RANK], seed=4)
    drawn = []
    for _ in range(60):
        drawn.extend(replay.sample(40 + 10 * RANK, 1).meta_numpy()[0].tolist())
    parts = COMM.gather(drawn, root=0)
    replay.close()
    if RANK == 0:
        everything = [k for part in parts for k in part]
        keys = sorted(ref)
        w = np.array([ref[k][1] ** sel.alpha if sel.proportional and hasattr(sel, "alpha") else 1.0 for k in keys])
        index = {k: i for i, k in enumerate(keys)}
        counts = np.bincount([index[k] for k in everything], minlength=len(keys))
        p = chisquare_p(counts, w / w.sum())
        record_property("chisquare_p", f"{p:.3g}")
        record_property("draws", int(counts.sum()))
        # significance 1e-3 with fixed seeds: a wrong distribution fails by many orders of magnitude
        assert p > 1e-3, (mode, selector, p, counts)
