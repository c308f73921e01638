"""The names of the API on K ranks: a per-call sampling mode, the collective get, the stats schema.

Run by tests/test_replay_mpi.py on 1-4 ranks; by hand:
``mpiexec -n 3 python -m pytest tests/mpi/test_api.py``. Shards are uneven with an
empty one (rank 1).

- ``sample(..., mode=M)`` on a replay built with another mode draws exactly what a
  replay built with mode M draws (the same seeds, shards and calls): the same rows,
  probabilities, weights and counters; ranks asking for different modes all get the
  same ValueError.
- ``get_many(keys)`` returns whole trajectories of any rank's keys in the caller's
  order (duplicates, no keys on some rank, stale keys as None); a foreign key on one
  rank raises InvalidKeyError on every rank.
- ``stats()`` has the one schema of gear_mpi.stats; ``ranks`` counts ranks and the
  deprecated ``size`` still does, with a DeprecationWarning.
- ``sample(0)`` of a replay with nothing to draw (empty, cleared, every priority 0) is an
  empty batch in every mode.
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi import stats as stats_schema
from replay_checks import (COMM, RANK, SIZE, SPEC, check_windows, expect_same_error, fill, make_replay, owner_of,
                           same_batch, shard_sizes)

MODES = ("decentralized", "centralized", "local")
SELECTORS = {"Prioritized": lambda: gm.Prioritized(0.7, 0.5), "Fifo": lambda: gm.Fifo()}


def fill_in_turn(replays: list, n: int, seed: int) -> dict:
    """``fill`` each replay with the same trajectories, one rank after the other, so that insertion
    stamps order the shards the same way in every replay (Fifo/Lifo merge shards by stamp)."""
    ref = {}
    for r in range(SIZE):
        for replay in replays:
            got = fill(replay, n if r == RANK else 0, seed)  # fill gathers every rank's inserts
            if replay is replays[0]:
                ref.update(got)
    return ref


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("mode", MODES)
def test_per_call_mode_draws_what_a_replay_built_with_that_mode_draws(mode, selector, force):
    built = "local" if mode != "local" else "decentralized"  # a replay whose own mode is another one
    other = make_replay(SELECTORS[selector](), built, force=force)
    ref_replay = make_replay(SELECTORS[selector](), mode, force=force)
    sizes = shard_sizes()
    ref = fill_in_turn([other, ref_replay], sizes[RANK], seed=11)
    for call, (align, window) in enumerate((("random", 5), ("head", 12), ("tail", 7), ("random", 3))):
        # local: a rank with an empty shard asks for nothing (it would raise EmptyReplayError on that rank)
        ask = 0 if (mode == "local" and sizes[RANK] == 0) else 2 + RANK + call
        got = other.sample(ask, window, align, mode=mode)
        want = ref_replay.sample(ask, window, align)
        check_windows(got, ref, window, align)
        same_batch(got, want, f"{mode} per call on a {built} replay, call {call}", keys="untagged")
        if mode == "local":
            assert all(owner_of(k) == RANK for k in got.meta_numpy()[0].tolist())
        keys = got.meta_numpy()[0]
        new = np.linspace(0.5, 2.0, len(keys))
        assert other.update_priorities(keys, new) == ref_replay.update_priorities(want.meta_numpy()[0], new)
    a, b = other.stats(), ref_replay.stats()
    assert a["mode"] == built and b["mode"] == mode
    assert a["per_rank"] == b["per_rank"] and a["total"] == b["total"], (a, b)
    # the replay's own mode is unchanged by the per-call ones
    assert other.mode == built
    other.close()
    ref_replay.close()


def test_ranks_asking_for_different_modes_fail_on_every_rank(force):
    replay = make_replay(gm.Prioritized(0.6, 0.4), force=force)
    fill(replay, shard_sizes()[RANK], seed=12)
    last = SIZE - 1
    if SIZE > 1:
        expect_same_error(lambda: replay.sample(2, 3, mode="centralized" if RANK == last else None), ValueError,
                          "mode must be the same on every rank")
        expect_same_error(lambda: replay.sample(2, 3, mode="local" if RANK == last else "decentralized"),
                          ValueError, "mode must be the same on every rank")
    expect_same_error(lambda: replay.sample(2, 3, mode="global" if RANK == last else None), ValueError,
                      f"rank {last}: mode must be one of")
    # nothing broke: every mode still works per call, in any order
    for mode in ("centralized", "local", "decentralized"):
        ask = 0 if (mode == "local" and len(replay) == 0) else 2
        assert len(replay.sample(ask, 3, mode=mode)) == ask
    replay.close()


def test_get_many_returns_any_ranks_trajectories_in_the_callers_order(force):
    replay = make_replay(gm.Uniform(), force=force)
    ref = fill(replay, shard_sizes()[RANK], seed=13)
    everyone = sorted(ref)
    rng = np.random.default_rng(RANK)
    if RANK == 1 % SIZE and SIZE > 1:
        asked = []  # a rank with no keys still takes part
    else:
        asked = list(rng.permutation(everyone)) + everyone[:2]  # every rank's keys, shuffled, with duplicates
    got = replay.get_many(np.array(asked, np.int64))
    assert len(got) == len(asked)
    for key, traj in zip(asked, got):
        data, _ = ref[int(key)]
        assert set(traj) == set(SPEC.names)
        for name in SPEC.names:
            assert traj[name].dtype == data[name].dtype
            np.testing.assert_array_equal(traj[name], data[name], err_msg=f"{key} {name}")
    # a local key still works with the local get; a key of another rank is still refused by it
    mine = [k for k in everyone if owner_of(k) == RANK]
    if mine:
        np.testing.assert_array_equal(replay.get(mine[0])["step"], ref[mine[0]][0]["step"])
    theirs = [k for k in everyone if owner_of(k) != RANK]
    if theirs:
        with pytest.raises(gm.InvalidKeyError):
            replay.get(theirs[0])
    # the replay still samples afterwards
    assert len(replay.sample(2, 4)) == 2
    replay.close()


def test_routed_updates_keep_the_highest_ranks_value_and_count_each_ranks_keys(force):
    """``update_priorities`` of every rank's keys (on one node through the node board's pairs; with ``force`` the
    windows take MPI): of a key given by several ranks the highest rank's value stays, within a rank the last one;
    each rank is told how many of its own keys were applied (every one here: all live), a rank with none too."""
    replay = make_replay(gm.Prioritized(0.7, 0.5), force=force)
    everyone = sorted(fill(replay, shard_sizes()[RANK], seed=17))
    rng = np.random.default_rng(100 + RANK)
    asked = [] if RANK == 1 % SIZE and SIZE > 1 else list(rng.permutation(everyone)) + everyone[:3]
    values = rng.random(len(asked)) + 0.5 + RANK
    want = {}
    for keys, vals in COMM.allgather((asked, values.tolist())):  # rank order, then each rank's order
        want.update(zip((int(k) for k in keys), vals))
    assert replay.update_priorities(np.array(asked, np.int64), values) == len(asked)
    mine = np.array([k for k in everyone if owner_of(k) == RANK], np.int64)
    # (the table keeps raw priorities in 32 bits: within 2 ulp; the values given for one key differ far more)
    np.testing.assert_allclose(replay.shard.priorities(mine), [want[int(k)] for k in mine], rtol=2.5e-7)
    assert len(replay.sample(2, 4)) == 2  # and the replay samples on
    replay.close()


def test_get_many_gives_none_for_stale_keys_and_agrees_on_bad_keys(force):
    replay = make_replay(gm.Uniform(), force=force)
    ref = fill(replay, shard_sizes()[RANK], seed=14)
    old = sorted(ref)
    rng = np.random.default_rng(100 + RANK)
    if RANK == 0:  # overwrite rank 0's whole ring (400 steps): every old key of rank 0 goes stale
        for _ in range(35):
            replay.insert({"obs": rng.random((12, 3)), "step": np.zeros(12, np.int64),
                           "flag": np.zeros((12, 2), np.uint8)})
    got = replay.get_many(old)
    for key, traj in zip(old, got):
        if owner_of(key) == 0:
            assert traj is None, key
        else:
            np.testing.assert_array_equal(traj["obs"], ref[key][0]["obs"])
    assert replay.get_many([]) == []
    foreign = [int(old[0]) ^ (1 << 62)] if RANK == SIZE - 1 else []  # another tag: not this replay's key
    expect_same_error(lambda: replay.get_many(foreign), gm.InvalidKeyError, "not issued by this replay")
    expect_same_error(lambda: replay.get_many([1.5] if RANK == SIZE - 1 else []), TypeError, f"rank {SIZE - 1}")
    assert len(replay.get_many(old[:1])) == 1
    replay.close()


def test_stats_schema_and_names_of_counts(force):
    replay = make_replay(gm.Prioritized(1.0, 0.4), force=force)
    ref = fill(replay, shard_sizes()[RANK], seed=15)
    replay.sample(3, 4)
    st = replay.stats()
    assert set(st) == {"ranks", "mode", "balance", "total", "per_rank", "sample_to_insert_ratio", "rate_limiter",
                       "activity"}, st
    assert st["rate_limiter"] == "None"
    assert st["sample_to_insert_ratio"] == st["total"]["sampled"] / st["total"]["inserted"]
    assert st["ranks"] == SIZE and st["mode"] == "decentralized"
    assert tuple(st["per_rank"]) == tuple(st["total"]) == stats_schema.REPLAY_FIGURES
    for k, values in st["per_rank"].items():
        if k in stats_schema.LARGEST:  # an age: the stalest rank's, inf without writers (these have none)
            assert values == [float("inf")] * SIZE and st["total"][k] == float("inf"), k
            continue
        assert len(values) == SIZE and st["total"][k] == pytest.approx(sum(values), rel=1e-12), k
    assert (st["total"]["staged"], st["total"]["staged_steps"], st["total"]["writers_draining"]) == (0, 0, 0)
    assert st["per_rank"]["items"] == shard_sizes() and st["total"]["items"] == len(ref)
    # index weights are held rounded to float32 (issue 34): their sum within float32 precision
    assert st["total"]["weight"] == pytest.approx(sum(p for _, p in ref.values()), rel=2.0 ** -22)
    assert st["total"]["sampled"] == 3 * SIZE
    # a shard reports the same figures under the same names
    own = replay.shard.stats()
    assert set(own) == {"rank"} | set(stats_schema.SHARD_FIGURES)
    for k in stats_schema.SHARD_FIGURES:
        assert own[k] == st["per_rank"][k][RANK], k
    # ranks, items: each under its own name; size is the deprecated name of ranks
    assert replay.ranks == SIZE and len(replay) == shard_sizes()[RANK]
    with pytest.warns(DeprecationWarning, match="Replay.ranks"):
        assert replay.size == SIZE
    replay.close()


@pytest.mark.parametrize("mode", MODES)
def test_sample_out_refills_the_callers_batch_with_what_a_new_one_would_hold(mode, force):
    a = make_replay(gm.Prioritized(0.6, 0.4), mode, force=force)
    b = make_replay(gm.Prioritized(0.6, 0.4), mode, force=force)
    sizes = shard_sizes()
    fill_in_turn([a, b], sizes[RANK], seed=13)
    ask = 0 if (mode == "local" and sizes[RANK] == 0) else 3
    out = a.sample(ask, 6, "random")
    b.sample(ask, 6, "random")
    for call in range(3):
        got = a.sample(ask, 6, "random", out=out)
        assert got is out  # the same buffers, filled again
        same_batch(got, b.sample(ask, 6, "random"), f"{mode} out= call {call}", keys="untagged")
    wrong = gm.Batch.empty(SPEC, ask + (1 if RANK == SIZE - 1 else 0), 6)
    if mode == "local" and a.mode == "local":  # no communication: this rank's own error only
        if RANK == SIZE - 1:
            with pytest.raises(ValueError, match="out= does not fit"):  # Shard.sample's check
                a.sample(ask, 6, out=wrong)
    else:
        expect_same_error(lambda: a.sample(ask, 6, out=wrong), ValueError, "out= must be a host batch")
    a.close()
    b.close()


def test_clear_empties_every_shard_and_later_inserts_sample_alone(force):
    """``clear()`` is collective: afterwards every shard is empty, the old keys are stale everywhere, the
    counters say the items were removed, and a sample draws only what was inserted after it."""
    with make_replay(gm.Prioritized(0.6, 0.4), force=force) as replay:
        ref = fill(replay, shard_sizes()[RANK], seed=5)
        before = replay.stats()["total"]
        replay.clear()
        assert len(replay) == 0
        after = replay.stats()["total"]
        assert after["items"] == 0 and after["removed"] - before["removed"] == before["items"]
        expect_same_error(lambda: replay.sample(4, 3), gm.EmptyReplayError, "empty")
        old = np.array(sorted(ref), np.int64)
        assert replay.update_priorities(old[[owner_of(k) == RANK for k in old]], np.ones(
            sum(owner_of(k) == RANK for k in old))) == 0  # stale: nothing applied
        new = fill(replay, 2, seed=6)
        batch = replay.sample(16, 3)
        assert set(batch.meta_numpy()[0].tolist()) <= set(new)
        check_windows(batch, new, 3, "random")


@pytest.mark.parametrize("state", ["empty", "cleared", "priority 0"])
def test_sample_of_nothing_from_a_replay_with_nothing_to_draw_is_an_empty_batch(state, force):
    """``sample(0)`` (every rank asking for nothing) of a replay holding nothing it can draw returns an empty
    batch in every mode; a sample that asks for items raises EmptyReplayError on every rank. Decentralized drew
    its count rows over 0/0 shares ("p < 0, p > 1 or p is NaN" on every rank); centralized indexed an empty
    weight table on rank 0 (IndexError) while the others waited for its choices until the timeout."""
    for sampler in (gm.Uniform(), gm.Prioritized(0.6, 0.4)):
        with make_replay(sampler, force=force) as replay:
            if state == "cleared":
                fill(replay, 3, seed=2)
                replay.clear()
            elif state == "priority 0":
                replay.insert_many([{"obs": np.zeros((2, 3), np.float32), "step": np.zeros(2, np.int64),
                                     "flag": np.zeros((2, 2), np.uint8)}], [0.0])
            for mode in MODES:
                for window, align in ((None, "random"), (1, "head"), (3, "tail")):
                    batch = replay.sample(0, window, align, mode=mode)
                    assert len(batch) == 0 and batch.mask_numpy().shape[0] == 0, (mode, window, align)
                if state != "priority 0" or isinstance(sampler, gm.Prioritized):
                    expect_same_error(lambda: replay.sample(2, 3, mode=mode), gm.EmptyReplayError,
                                      "empty" if state != "priority 0" else "priority 0")
            assert replay.stats()["total"]["sampled"] == 0
