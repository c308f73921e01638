"""Bit-exact windows, global weights and order, priority updates and the window path, on K ranks.

Run by tests/test_replay_mpi.py on 1-4 ranks (``--force-alltoallv`` sends every remote
window through MPI); by hand: ``mpiexec -n 4 python -m pytest tests/mpi/test_windows.py``.
Shards are uneven with an empty one (rank 1), batch sizes differ per rank (the last
rank asks for 0), and windows are aligned at the head, the tail and at random.
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.kernels import leaf_values
from replay_checks import COMM, RANK, SIZE, check_windows, fill, make_replay, owner_of, shard_sizes

SELECTORS = {"Uniform": lambda: gm.Uniform(), "Prioritized": lambda: gm.Prioritized(0.7, 0.5),
             "Fifo": lambda: gm.Fifo(), "Lifo": lambda: gm.Lifo(), "MaxPriority": lambda: gm.MaxPriority(),
             "MinPriority": lambda: gm.MinPriority()}


@pytest.mark.parametrize("selector", list(SELECTORS))
@pytest.mark.parametrize("mode", ["decentralized", "centralized"])
def test_exact_windows_weights_and_order(mode, selector, force):
    """Every rank's windows are exact; probabilities and weights are the global ones
    (proportional selectors), or the batch is the globally best items (ordered ones)."""
    sizes = shard_sizes()
    sel = SELECTORS[selector]()
    replay = make_replay(sel, mode, force=force)
    ref = fill(replay, sizes[RANK], seed=1)
    live = len(ref)
    for align, window in (("random", 5), ("head", 12), ("tail", 7)):
        ask = 0 if RANK == SIZE - 1 and SIZE > 1 else 3 + RANK
        batch = replay.sample(ask, window, align)
        assert len(batch) == ask and batch.numpy()["obs"].shape == (ask, window, 3)
        check_windows(batch, ref, window, align)
        keys, probabilities, weights, _ = batch.meta_numpy()
        rows = COMM.allgather(list(zip(keys.tolist(), probabilities.tolist(), weights.tolist())))
        flat = [r for part in rows for r in part]
        if sel.proportional:
            # the weights as the index holds them: p ** alpha rounded to float32 (gear_mpi.kernels.leaf_values)
            w = {k: (1.0 if not sel.uses_importance_weights else float(leaf_values(np.array([p ** sel.alpha]))[0]))
                 for k, (_, p) in ref.items()}
            total = sum(w.values())
            for k, prob, weight in flat:
                assert abs(prob - w[k] / total) < 1e-12, (k, prob, w[k] / total)
                if sel.uses_importance_weights:
                    assert abs(weight - (min(w.values()) / w[k]) ** sel.beta) < 1e-6
                else:
                    assert weight == 1.0
        else:
            check_global_order(sel, ref, [k for k, _, _ in flat], rows)
    st = replay.stats()
    assert st["per_rank"]["items"] == sizes and st["total"]["items"] == live, st
    if force:
        assert st["total"]["windows_shared"] == 0, st
    replay.close()


def check_global_order(sel, ref: dict, picked: list[int], rows) -> None:
    """Ordered selectors: the batch over all ranks is the globally best items, dealt in rank order."""
    keys = list(ref)
    if isinstance(sel, (gm.MaxPriority, gm.MinPriority)):
        sign = -1 if isinstance(sel, gm.MaxPriority) else 1
        # ties are impossible with random float priorities
        best = sorted(keys, key=lambda k: sign * ref[k][1])
    else:
        # insertion order within a shard is exact; across shards the stamps order them
        best = None
    btot = len(picked)
    if best is not None:
        # requester r gets the next B_r of the global order; its rows are grouped by owner rank
        expect = (best * (btot // max(len(best), 1) + 1))[:btot]
        start = 0
        for part in rows:
            got = [k for k, _, _ in part]
            assert sorted(got) == sorted(expect[start:start + len(got)]), (got, expect[start:start + len(got)])
            start += len(got)
    else:
        per_owner = {}
        for k in picked[:min(btot, len(keys))]:
            per_owner.setdefault(owner_of(k), []).append(k)
        for o, ks in per_owner.items():
            mine = [k for k in keys if owner_of(k) == o]  # ref keeps each rank's insertion order
            if isinstance(sel, gm.Lifo):
                mine = mine[::-1]
            assert ks == mine[:len(ks)], (o, ks, mine)
        assert len(set(picked[:min(btot, len(keys))])) == min(btot, len(keys))


def test_priority_updates_reach_owners_and_stale_keys_are_dropped(force):
    replay = make_replay(gm.Prioritized(1.0, 0.4), capacity=60, force=force)
    ref = fill(replay, shard_sizes()[RANK], seed=2)
    batch = replay.sample(4, 4)
    new = np.arange(len(batch), dtype=np.float64) + 10.0 * (RANK + 1)
    keys = batch.meta_numpy()[0]
    applied = replay.update_priorities(keys, new)
    # duplicates within and across ranks: the highest rank's last value wins
    final = {}
    for part in COMM.allgather(list(zip(keys.tolist(), new.tolist()))):
        for k, p in part:
            final[k] = p
    assert applied == len(batch), (applied, len(batch))
    mine = [k for k in final if owner_of(k) == RANK]
    if mine:
        np.testing.assert_array_equal(replay.shard.priorities(mine), [final[k] for k in mine])
    # stale keys: overwrite the whole ring so every old key is evicted, then update them
    old = [k for k in ref if owner_of(k) == RANK]
    rng = np.random.default_rng(RANK)
    for _ in range(7):
        replay.insert({"obs": rng.random((12, 3)), "step": np.zeros(12, np.int64), "flag": np.zeros((12, 2), np.uint8)})
    everyone_old = [k for part in COMM.allgather(old) for k in part]
    asked = everyone_old if RANK == 0 else []
    applied = replay.update_priorities(asked, np.ones(len(asked)))
    assert applied == 0, applied
    st = replay.stats()
    assert st["total"]["stale_updates"] == len(everyone_old), st
    replay.close()


def test_window_path_is_node_shared_memory_or_mpi_when_forced(force):
    """Which path windows took: shared memory on a node, MPI when forced."""
    replay = make_replay(gm.Uniform(), force=force)
    fill(replay, 5, seed=3)
    for _ in range(3):
        replay.sample(8, 4)
    st = replay.stats()
    if SIZE > 1:
        if force:
            assert st["total"]["windows_shared"] == 0 and st["total"]["windows_mpi"] > 0, st
        else:
            assert st["total"]["windows_mpi"] == 0 and st["total"]["windows_shared"] > 0, st
    replay.close()


@pytest.mark.skipif(SIZE != 1, reason="the one-rank job (no mpiexec) only")
@pytest.mark.parametrize("mode", ["decentralized", "centralized", "local"])
def test_one_rank_in_every_mode(mode, force):
    """A single process (an MPI singleton when started without mpiexec) is a 1-rank job."""
    replay = make_replay(gm.Prioritized(0.6, 0.4), mode, force=force)
    ref = fill(replay, 6, seed=8)
    batch = replay.sample(5, 6, "head")
    check_windows(batch, ref, 6, "head")
    assert replay.update_priorities(batch.meta_numpy()[0], np.full(5, 2.0)) == 5
    replay.close()
