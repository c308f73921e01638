"""An invalid argument on one rank raises the same error on every rank; nothing changes.

An empty replay raises everywhere; a bad batch size, window, align, priority (NaN,
negative) or a foreign key on the last rank raises the same message on every rank;
afterwards the priorities are untouched and the replay still samples.
"""
from __future__ import annotations

import numpy as np

import gear_mpi as gm
from replay_checks import RANK, SIZE, expect_same_error, fill, make_replay, owner_of, shard_sizes


def test_invalid_arguments_fail_on_every_rank(force):
    replay = make_replay(gm.Prioritized(0.6, 0.4), force=force)
    expect_same_error(lambda: replay.sample(4, 3), gm.EmptyReplayError, "empty on every rank")
    ref = fill(replay, shard_sizes()[RANK], seed=5)
    bad = SIZE - 1
    expect_same_error(lambda: replay.sample(-1 if RANK == bad else 2, 3), ValueError, f"rank {bad}: batch_size")
    expect_same_error(lambda: replay.sample(2, 3 + (RANK == bad)), ValueError, "window and align")
    expect_same_error(lambda: replay.sample(2, 3, "middle" if RANK == bad else "head"), ValueError, "align")
    batch = replay.sample(2, 3)
    pr = np.ones(len(batch))
    if RANK == bad:
        pr[0] = np.nan
    expect_same_error(lambda: replay.update_priorities(batch.keys, pr), gm.InvalidPriorityError, "finite")
    if RANK == bad:
        pr[0] = -1.0
    expect_same_error(lambda: replay.update_priorities(batch.keys, pr), gm.InvalidPriorityError, "non-negative")
    other = make_replay(gm.Prioritized(0.6, 0.4), force=force)
    other_key = other.insert({"obs": np.zeros((2, 3)), "step": np.zeros(2, np.int64),
                              "flag": np.zeros((2, 2), np.uint8)})
    if other.shard.tag == replay.shard.tag:
        other_key = int(other_key) ^ (1 << 62)  # same random tag (1 in 256): make it foreign anyway
    foreign = [other_key] if RANK == bad else []
    expect_same_error(lambda: replay.update_priorities(foreign, np.ones(len(foreign))), gm.InvalidKeyError,
                      "not issued by this replay")
    other.close()
    # nothing was changed by the failed calls, and the replay still works
    before = {k: p for k, (_, p) in ref.items() if owner_of(k) == RANK}
    if before:
        # a Prioritized index gives raw priorities back within an ulp or two (gear_mpi.storage.table)
        np.testing.assert_allclose(replay.shard.priorities(list(before)), list(before.values()), rtol=1e-15, atol=0)
    batch = replay.sample(3, 4)
    assert len(batch) == 3
    replay.close()
