"""Batch.to_tensordict(): a sampled batch as a TensorDict over the same memory.

``[B, W]`` (default) with per-window metadata expanded along W, or ``[B]``; column names split into nested
keys at a separator; a column that would clash with the metadata refused, naming it.
"""
from __future__ import annotations

import numpy as np
import pytest

import gear_mpi as gm

pytest.importorskip("tensordict")


def test_to_tensordict_wraps_the_batch_without_a_copy(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 64, gm.Prioritized(0.6, 0.4))
    shard.insert_many([make_traj(n) for n in (3, 9, 5)], [1.0, 2.0, 3.0])
    batch = shard.sample(4, 6)
    td = batch.to_tensordict()
    assert td.batch_size == (4, 6)
    for name in spec.names:
        assert td[name].data_ptr() == batch[name].data_ptr() and td[name].shape == batch[name].shape
    assert td["mask"].data_ptr() == batch.mask.data_ptr()
    for name in ("keys", "probabilities", "weights", "lengths"):
        meta = getattr(batch, name)
        assert td[name].shape == (4, 6) and (td[name] == meta[:, None]).all() and td[name].data_ptr() == meta.data_ptr()
    flat = batch.to_tensordict(batch_dims=1)
    assert flat.batch_size == (4,) and flat["keys"].shape == (4,) and flat["obs"].shape == (4, 6, 3, 2)
    batch["obs"][0, 0, 0, 0] = 123.0
    assert td["obs"][0, 0, 0, 0] == 123.0  # the same memory
    td[0]  # indexable as any TensorDict


def test_to_tensordict_nests_names_and_refuses_clashes(shard_factory):
    spec = gm.TrajectorySpec({"obs": ((2,), np.float32), "next.obs": ((2,), np.float32),
                              "next.reward": ((), np.float32)}, max_length=4)
    shard = shard_factory(spec, 32)
    shard.insert({"obs": np.ones((3, 2)), "next.obs": np.full((3, 2), 2.0), "next.reward": np.arange(3.0)})
    batch = shard.sample(2, 3)
    td = batch.to_tensordict(separator=".")
    assert td["next", "obs"].shape == (2, 3, 2) and (td["next", "obs"] == 2).all()
    assert td["next", "reward"].shape == (2, 3) and td["next"].batch_size == (2, 3)
    assert "next.obs" in batch.to_tensordict().keys()  # no separator: names as they are
    with pytest.raises(ValueError, match="batch_dims"):
        batch.to_tensordict(batch_dims=3)
    clash = gm.TrajectorySpec({"mask": ((), np.float32)}, max_length=2)
    other = shard_factory(clash, 8)
    other.insert({"mask": np.zeros(2)})
    with pytest.raises(ValueError, match="column 'mask'.*clashes"):
        other.sample(1, 2).to_tensordict()
