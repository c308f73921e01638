"""A host batch makes its tensors at their first read: a process that never reads one never imports torch.

Writers, actors and numpy consumers of a replay (``Batch.numpy``, ``Batch.mask_numpy``, ``Batch.meta_numpy``)
then start without torch's import (about 1.4 s a process here); a sample makes no tensor, and each column's
tensor, made at its first read, is one object however it is reached (``batch[name]``, ``batch.data``).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "action": ((), "int64")}, max_length=4)

NO_TORCH = textwrap.dedent("""
    import sys
    import numpy as np
    import gear_mpi as gm
    from mpi4py import MPI
    spec = gm.TrajectorySpec({"obs": ((3,), "float32"), "action": ((), "int64")}, max_length=4)
    step = {"obs": np.ones((4, 3), np.float32), "action": np.arange(4)}
    for selector in (gm.Prioritized(0.6, 0.4), gm.Uniform(), gm.Fifo()):
        with gm.Replay(spec, 64, selector, comm=MPI.COMM_SELF) as replay:
            replay.insert(step, 1.0)
            for window in (1, 2):
                batch = replay.sample(4, window)
                batch = replay.sample(4, window, out=batch)
                replay.update_priorities(batch.meta_numpy()[0], np.ones(4))
            with replay.batches(4, window=2, prefetch=1, limit=6) as it:  # (recycle="auto": references())
                for batch in it:
                    it.update_priorities(batch.meta_numpy()[0], np.ones(4))
        shard = gm.Shard(spec, 64, selector)
        shard.insert(step, 1.0)
        for _ in range(3):
            batch = shard.sample(4, 1, squeeze=True)
        shard.update_priorities(batch.meta_numpy()[0], np.ones(4))
        assert batch.numpy()["obs"].shape == (4, 3) and batch.columns == ("obs", "action")
        assert batch.mask_numpy().shape == (4, 1) and batch.mask_numpy().all()
        assert len(batch) == 4 and batch.window == 1 and "obs" in batch and list(batch) == ["obs", "action"]
        assert batch.nbytes == 4 * (12 + 8) + 4 + 4 * 28, batch.nbytes
        assert repr(batch) == "Batch(B=4, W=1, obs: (4, 3) float32, action: (4,) int64, squeezed)", repr(batch)
        shard.close()
    print("torch imported:", "torch" in sys.modules)
""")


def test_sampling_and_updating_through_numpy_never_import_torch():
    proc = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch imported: False" in proc.stdout, proc.stdout + proc.stderr


@pytest.fixture
def batch():
    shard = gm.Shard(SPEC, 64, gm.Prioritized(0.6, 0.4), seed=3)
    rng = np.random.default_rng(0)
    shard.insert({"obs": rng.random((4, 3), np.float32), "action": np.arange(4)}, 1.0)
    yield shard.sample(5, 2)
    shard.close()


@pytest.mark.parametrize("first", ["item", "data"])
def test_a_column_tensor_is_one_object_over_the_batch_memory(batch, first):
    import torch
    one = batch["obs"] if first == "item" else batch.data["obs"]
    assert batch["obs"] is one and batch.data["obs"] is one
    assert list(batch.data) == ["obs", "action"] and batch.data["action"] is batch["action"]
    array = batch.numpy()["obs"]
    assert one.shape == (5, 2, 3) and one.dtype == torch.float32
    assert one.data_ptr() == array.ctypes.data  # no copy
    array[0, 0, 0] = 42.0
    assert one[0, 0, 0].item() == 42.0
    assert batch.keys.data_ptr() == batch.meta_numpy()[0].ctypes.data
    assert batch.mask.data_ptr() == batch.mask_numpy().ctypes.data and batch.mask_numpy().dtype == np.bool_


def test_a_batch_of_tensors_has_no_numpy_buffers():
    import torch
    b = gm.Batch.from_tensors({"obs": torch.zeros(2, 1, 3)}, torch.ones(2, 1, dtype=torch.bool),
                              torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.ones(2),
                              torch.ones(2, dtype=torch.int64))
    for read in (b.numpy, b.mask_numpy, b.meta_numpy):
        with pytest.raises(RuntimeError, match="lives on a device; use its tensors"):
            read()
    assert repr(b) == "Batch(B=2, W=1, obs: (2, 1, 3) float32)", repr(b)  # the same words as a host batch's


def test_unknown_column_names_the_columns(batch):
    with pytest.raises(KeyError, match=r"no column 'nope' in this batch; it has \['obs', 'action'\]"):
        batch["nope"]
    assert "nope" not in batch


def test_size_and_shape_without_tensors_match_the_tensors(batch):
    nbytes, columns = batch.nbytes, batch.columns  # before any tensor is made
    tensors = [batch.data[c] for c in columns]
    assert nbytes == (sum(t.numel() * t.element_size() for t in tensors) + batch.mask.numel()
                      + 28 * len(batch))
    assert (batch.batch_size, batch.window) == tuple(batch.mask.shape)


def test_references_ignore_tensors_made_at_a_read_and_see_every_holder(batch):
    """``batches(recycle="auto")`` refills a batch whose references read as they did when it was handed over:
    a tensor the batch made at a read since, and holds alone, must not count (the batch would never be
    refilled), and anything kept outside must (it would be overwritten)."""
    # (each count read in a statement of its own: pytest's rewritten assert would hold a bound method of the batch)
    before = batch.references()
    batch["obs"], batch.keys, batch.data, batch.mask  # made, held by the batch alone
    after = batch.references()
    assert after == before
    holders = [lambda: batch["obs"], lambda: batch["action"][1:], lambda: batch.weights.numpy(),
               lambda: batch.numpy()["obs"], lambda: batch.numpy()["obs"][2:], lambda: batch.numpy(),
               lambda: batch.meta_numpy(), lambda: batch.meta_numpy()[0], lambda: batch.mask_numpy(),
               lambda: batch.mask_numpy()[1:], lambda: batch]
    for make in holders:
        kept = make()
        held = batch.references()
        del kept
        after = batch.references()
        assert held != before and after == before, make


def test_a_new_batchs_column_arrays_are_made_at_their_first_read_over_its_memory(batch):
    """``Batch.empty`` makes no column array (the kernels fill the columns through their addresses): each is made
    at its first read, once, where the addresses say, and holds what the sample wrote (the fixture's rows are
    uniforms in (0, 1); the padding of short windows is 0)."""
    import copy
    import pickle
    columns = batch._np
    assert list(columns) == ["obs", "action"] and len(columns) == 2 and columns._arrays == {}
    obs = batch.numpy()["obs"]
    assert list(columns._arrays) == ["obs"] and batch.numpy()["obs"] is obs and batch._np["obs"] is obs
    assert [columns[n].ctypes.data for n in ("obs", "action")] == batch.column_addresses().tolist()
    real = batch.mask_numpy()
    assert real.any() and (obs[real] > 0).all() and (obs[~real] == 0).all()  # the rows the sample wrote, padding 0
    with pytest.raises(KeyError):
        columns["nope"]
    assert "nope" not in columns and dict(columns).keys() == {"obs", "action"}
    for twin in (copy.deepcopy(batch), pickle.loads(pickle.dumps(batch))):  # copies of the buffers, not views
        assert type(twin._np) is dict
        for name in ("obs", "action"):
            np.testing.assert_array_equal(twin.numpy()[name], batch.numpy()[name])
            assert not np.shares_memory(twin.numpy()[name], batch.numpy()[name])
