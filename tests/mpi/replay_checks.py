"""What the multi-rank replay tests share: the spec, uneven shards, filling and window checks.

Every function runs on every rank (SPMD); those that gather use ``MPI.COMM_WORLD``.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

import gear_mpi as gm

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "step": ((), "int64"), "flag": ((2,), "uint8")}, max_length=12)
#: the collective deadline of the replays built here: short, so that a rank left waiting
#: for a failed one fails too within seconds (a failing rank also aborts the job, see conftest.py)
TIMEOUT = 20.0


def owner_of(key: int) -> int:
    """The rank whose shard issued ``key``."""
    return int(gm.keys.decode(np.array([key]))[1][0])


def shard_sizes() -> list[int]:
    """Uneven shards: rank 1 is empty (when there are 2+ ranks), others differ."""
    return [0 if (r == 1 and SIZE > 1) else 4 + 3 * r for r in range(SIZE)]


def make_replay(sampler, mode="decentralized", capacity=400, force=False, **kw) -> gm.Replay:
    return gm.Replay(SPEC, capacity, sampler, mode=mode, seed=7, timeout=TIMEOUT, force_alltoallv=force, **kw)


def insert_random(replay: gm.Replay, n: int, rng: np.random.Generator) -> dict[int, tuple[dict, float]]:
    """Insert ``n`` random trajectories of SPEC (lengths 1..max_length, steps naming rank and item) on this rank;
    return {key: (data, priority)} of them."""
    mine = {}
    for i in range(n):
        length = int(rng.integers(1, SPEC.max_length + 1))
        data = {"obs": rng.standard_normal((length, 3)).astype(np.float32),
                "step": np.arange(length, dtype=np.int64) + 100_000 * RANK + 1000 * i,
                "flag": rng.integers(0, 255, (length, 2)).astype(np.uint8)}
        prio = float(rng.uniform(0.1, 3.0))
        mine[replay.insert(data, priority=prio)] = (data, prio)
    return mine


def fill(replay: gm.Replay, n: int, seed: int) -> dict[int, tuple[dict, float]]:
    """Insert ``n`` trajectories on this rank; return {key: (data, priority)} of every rank's inserts."""
    mine = insert_random(replay, n, np.random.default_rng(1000 * seed + RANK))
    ref = {}
    for m in COMM.allgather(mine):
        ref.update(m)
    return ref


def check_windows(batch: gm.Batch, ref: dict, window: int, align: str) -> None:
    """Every row equals the window its key must contain; padding is zero; mask and lengths agree."""
    cols, mask = batch.numpy(), batch.mask_numpy()  # numpy: a rank that reads no tensor never imports torch
    keys, _, _, lengths = batch.meta_numpy()
    for i, key in enumerate(keys.tolist()):
        data, _ = ref[key]
        length = len(data["step"])
        n = min(length, window)
        assert lengths[i] == n, (key, lengths[i], n)
        pad = window - n if (align == "tail" and length < window) else 0
        assert mask[i].tolist() == [pad <= t < pad + n for t in range(window)], (key, mask[i])
        got_steps = cols["step"][i, pad:pad + n]
        offset = int(got_steps[0] - data["step"][0])
        if align == "head":
            assert offset == 0
        elif align == "tail":
            assert offset == length - n
        assert 0 <= offset <= length - n
        for name in SPEC.names:
            np.testing.assert_array_equal(cols[name][i, pad:pad + n], data[name][offset:offset + n], err_msg=name)
            assert not cols[name][i, :pad].any() and not cols[name][i, pad + n:].any(), f"padding of {name}"


META = ("mask", "keys", "probabilities", "weights", "lengths")


def arrays(batch: gm.Batch) -> dict[str, np.ndarray]:
    """Every array of ``batch`` by name -- its columns and :data:`META` -- as numpy: a host batch's own buffers
    (no tensor made, so a rank that reads batches this way never imports torch: about 1.7 s of CPU a process),
    a device batch's tensors copied to the host."""
    try:
        out = dict(batch.numpy())
        out["mask"], (out["keys"], out["probabilities"], out["weights"], out["lengths"]) = \
            batch.mask_numpy(), batch.meta_numpy()
    except RuntimeError:  # a device batch
        out = {name: t.cpu().numpy() for name, t in batch.data.items()}
        out.update((name, getattr(batch, name).cpu().numpy()) for name in META)
    return out


#: a key without its replay's tag (the top bits of its 63): owner, generation and slot
NO_TAG = (1 << (gm.keys.RANK_BITS + gm.keys.GEN_BITS + gm.keys.SLOT_BITS)) - 1


def same_batch(a: gm.Batch, b: gm.Batch, what: str = "", names=None, keys: str | None = "exact") -> None:
    """Assert that two batches are the same, bit for bit and dtype for dtype: their columns (``names``; default:
    every column, and both batches must have the same ones), mask, probabilities, weights, lengths, and keys as
    ``keys`` says: ``"exact"``, ``"untagged"`` (two replays with different tags: :data:`NO_TAG`) or None (not
    compared). ``what`` names the comparison in the failure's message. Reads numpy (:func:`arrays`)."""
    x, y = arrays(a), arrays(b)
    columns = [n for n in x if n not in META]
    if names is None:
        assert sorted(columns) == sorted(n for n in y if n not in META), (what, "columns", columns, list(y))
        names = columns
    for name in (*names, "mask", "probabilities", "weights", "lengths"):
        assert x[name].dtype == y[name].dtype and np.array_equal(x[name], y[name]), (what, name, x[name], y[name])
    if keys is not None:
        ka, kb = (x["keys"], y["keys"]) if keys == "exact" else (x["keys"] & NO_TAG, y["keys"] & NO_TAG)
        assert np.array_equal(ka, kb), (what, "keys", ka, kb)


def keys_of(batch: gm.Batch):
    """A host batch's keys array (what ``update_priorities`` takes as the batch's own keys), without torch; a
    device batch's keys tensor."""
    try:
        return batch.meta_numpy()[0]
    except RuntimeError:  # a device batch
        return batch.keys


def close_replica(replay, sampler, groups) -> None:
    """Close what a model-parallel test built: its ReplicaSampler, its replay (None on ranks without one), then
    free its groups."""
    sampler.close()
    if replay is not None:
        replay.close()
    groups.free()


def expect_same_error(fn, cls, what: str) -> None:
    """``fn()`` raises ``cls`` on this rank, with the same message on every rank, containing ``what``."""
    try:
        fn()
    except cls as e:
        msgs = COMM.allgather(str(e))
        assert len(set(msgs)) == 1, msgs
        assert what in msgs[0], (what, msgs[0])
        return
    raise AssertionError(f"expected {cls.__name__} on rank {RANK}")
