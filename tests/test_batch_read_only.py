"""What a batch hands out cannot be replaced: a later ``sample(out=batch)`` refills the batch's own buffers.

A loop that normalised a column in place of the batch's own (``batch.numpy()["obs"] = obs / 255``, or
``batch.data["obs"] = batch["obs"].float() / 255``) and then sampled into the same batch again got the new rows in
the batch's buffers, while the batch went on handing out the replaced, stale column: silent wrong data. The
mappings are read-only now and the public attributes cannot be rebound; a copy of one's own is a ``dict()`` away.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "action": ((), "int64")}, max_length=1)


@pytest.fixture
def shard():
    shard = gm.Shard(SPEC, 64, gm.Uniform(), seed=0)
    rng = np.random.default_rng(1)
    shard.insert_packed({"obs": rng.random((40, 3), np.float32), "action": np.arange(40)}, np.ones(40, np.int64))
    yield shard
    shard.close()


def test_columns_cannot_be_replaced_and_a_refill_is_what_the_batch_hands_out(shard):
    batch = shard.sample(8, 1)
    with pytest.raises(TypeError):
        batch.numpy()["obs"] = batch.numpy()["obs"] / 2
    with pytest.raises(TypeError):
        batch.data["obs"] = batch["obs"] * 2
    for name in ("data", "mask", "keys", "probabilities", "weights", "lengths", "squeezed"):
        with pytest.raises(AttributeError, match=f"batch.{name} is read-only: a later sample"):
            setattr(batch, name, None)
    mine = dict(batch.numpy())  # a dict of one's own takes anything
    mine["obs"] = mine["obs"] / 2
    again = shard.sample(8, 1, out=batch)
    assert again is batch
    np.testing.assert_array_equal(batch["obs"].numpy(), batch.numpy()["obs"])  # the refilled rows, both ways
    assert batch["obs"].data_ptr() == batch.numpy()["obs"].ctypes.data
    batch._note = 1  # a private attribute is set as usual


def test_a_device_batch_is_read_only_too():
    data = {"obs": torch.zeros(2, 1, 3)}
    batch = gm.Batch.from_tensors(data, torch.ones(2, 1, dtype=torch.bool), torch.tensor([1, 2]),
                                  torch.ones(2, dtype=torch.float64), torch.ones(2), torch.ones(2, dtype=torch.int64))
    with pytest.raises(TypeError):
        batch.data["obs"] = torch.ones(2, 1, 3)
    with pytest.raises(AttributeError, match="batch.keys is read-only"):
        batch.keys = torch.tensor([3, 4])
    assert batch.squeeze().squeezed and batch.squeeze()["obs"].shape == (2, 3)
