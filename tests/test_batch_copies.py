"""Copies of a batch (``copy.copy``, ``copy.deepcopy``, ``pickle``) and ``out=``.

A deep copy or an unpickled batch kept the original's column addresses (the batch caches them for the gather
kernels): ``sample(out=the_copy)`` wrote into the original batch's memory, leaving the copy as it was (or, in
another process, into whatever lay at those addresses). A copy now keeps its buffers only; its tensors,
addresses and fit are made again from them.
"""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest
import torch

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "action": ((), "int64")}, max_length=4)


def filled_shard(seed: int) -> gm.Shard:
    shard = gm.Shard(SPEC, 256, gm.Prioritized(0.6, 0.4), seed=seed)
    rng = np.random.default_rng(5)
    for i in range(20):
        n = 1 + i % 4
        shard.insert({"obs": rng.random((n, 3), np.float32), "action": rng.integers(0, 9, n)}, 1.0 + i % 3)
    return shard


def rows(batch: gm.Batch, keys: bool = True) -> list[np.ndarray]:
    meta = batch.meta_numpy()
    return [a.copy() for a in (*batch.numpy().values(), batch.mask.numpy(), *(meta if keys else meta[1:]))]


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_sampling_into_a_deep_copy_fills_the_copy_and_leaves_the_original(how):
    shard, twin = filled_shard(1), filled_shard(1)
    original = shard.sample(6, 2)
    twin.sample(6, 2)
    original["obs"], original.keys  # tensors made (and addresses cached) before the copy
    before = rows(original)
    dup = copy.deepcopy(original) if how == "deepcopy" else pickle.loads(pickle.dumps(original))
    assert all(np.array_equal(x, y) for x, y in zip(rows(dup), before))
    got = shard.sample(6, 2, out=dup)
    assert got is dup
    want = twin.sample(6, 2)
    # the copy holds the new rows (the keys' heads differ: each shard has its own tag)
    assert all(np.array_equal(x, y) for x, y in zip(rows(dup, keys=False), rows(want, keys=False)))
    assert all(np.array_equal(x, y) for x, y in zip(rows(original), before))  # the original is untouched
    # the copy's tensors are over its own buffers
    assert dup["obs"].data_ptr() == dup.numpy()["obs"].ctypes.data != original["obs"].data_ptr()
    assert torch.equal(dup.keys, torch.from_numpy(dup.meta_numpy()[0]))
    np.testing.assert_array_equal(gm.keys.decode(dup.meta_numpy()[0])[-1], gm.keys.decode(want.meta_numpy()[0])[-1])
    shard.close()
    twin.close()


def test_a_shallow_copy_shares_the_buffers():
    shard = filled_shard(2)
    original = shard.sample(5, 3)
    same = copy.copy(original)
    assert same["obs"].data_ptr() == original["obs"].data_ptr()
    np.testing.assert_array_equal(same.column_addresses(), original.column_addresses())
    shard.sample(5, 3, out=same)
    assert all(np.array_equal(x, y) for x, y in zip(rows(same), rows(original)))
    shard.close()


def test_a_device_batch_keeps_its_tensors_through_a_pickle():
    data = {"obs": torch.arange(12.0).reshape(2, 2, 3), "action": torch.ones(2, 2, dtype=torch.int64)}
    batch = gm.Batch.from_tensors(data, torch.ones(2, 2, dtype=torch.bool), torch.tensor([4, 5]),
                                  torch.full((2,), 0.5, dtype=torch.float64), torch.ones(2), torch.full((2,), 2))
    again = pickle.loads(pickle.dumps(batch))
    assert torch.equal(again["obs"], data["obs"]) and torch.equal(again.keys, batch.keys)
    assert again.columns == ("obs", "action") and (again.batch_size, again.window) == (2, 2)
