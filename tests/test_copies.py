"""Copies (``copy.copy``, ``copy.deepcopy``, ``pickle``) of batches, shards and replays.

- A deep copy or an unpickled batch kept the original's column addresses (the batch caches them for the gather
  kernels): ``sample(out=the_copy)`` wrote into the original batch's memory, leaving the copy as it was (or, in
  another process, into whatever lay at those addresses). A copy now keeps its buffers only; its tensors,
  addresses and fit are made again from them.
- A Shard could not be pickled ("cannot pickle '_Pages' object") and a shallow copy shared its memory and its
  closing; any copy is now a new, independent shard holding the same items, keys and stream.
- A Replay (its shards on MPI ranks) refuses any copy with a TypeError that says what to use instead; so do the
  objects that own something live: a ``batches()`` iterator (a shallow copy, once garbage-collected, closed
  the iterator's shared state from the copy and waited forever for the original's thread), a Writer (a
  shallow copy shared its mapping of the rank's staging memory), ParallelGroups and a ReplicaSampler.
"""
from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap

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


@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_shard_copy_is_independent_and_draws_what_the_original_would(how):
    shard = filled_shard(3)
    shard.sample(4, 2)  # the stream moved, and a repeat record left
    dup = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": lambda s: pickle.loads(pickle.dumps(s))}[how](shard)
    assert dup is not shard and len(dup) == len(shard) and repr(dup) == repr(shard)
    a, b = shard.sample(7, 3), dup.sample(7, 3)
    assert all(np.array_equal(x, y) for x, y in zip(rows(a), rows(b)))  # same items, keys and stream
    keys = a.meta_numpy()[0]
    np.testing.assert_array_equal(dup.priorities(keys), shard.priorities(keys))
    dup.update_priorities(keys, np.full(len(keys), 9.0))
    dup.insert({"obs": np.ones((4, 3), np.float32), "action": np.zeros(4, np.int64)}, 1.0)
    assert len(dup) == len(shard) + 1 and not np.any(shard.priorities(keys) == 9.0)
    dup.close()
    assert len(shard.sample(3, 1)) == 3  # the original is open and unchanged
    shard.close()
    with pytest.raises(RuntimeError, match="closed"):
        pickle.dumps(shard)


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy, pickle.dumps])
def test_a_replay_refuses_copies_and_says_what_to_use(how):
    from mpi4py import MPI
    with gm.Replay(SPEC, 64, comm=MPI.COMM_SELF) as replay:
        with pytest.raises(TypeError, match=r"a Replay \(its shards live on MPI ranks\) cannot be pickled or "
                                            r"copied: save it with replay.save\(path\)"):
            how(replay)
        assert len(pickle.loads(pickle.dumps(replay.shard))) == 0


COPIES = [copy.copy, copy.deepcopy, pickle.dumps]


def test_live_objects_refuse_copies_and_say_what_to_use():
    from mpi4py import MPI
    with gm.Replay(SPEC, 64, comm=MPI.COMM_SELF) as replay:
        with gm.Writer(replay.writer_address()) as writer:
            for how in COPIES:
                with pytest.raises(TypeError, match=r"a Writer .* cannot be pickled or copied: pass "
                                                     r"replay.writer_address\(\)"):
                    how(writer)
        groups = gm.parallel_groups(MPI.COMM_SELF)
        sampler = gm.ReplicaSampler(replay, groups, spec=SPEC)
        for obj, what in ((groups, "ParallelGroups"), (sampler, "a ReplicaSampler")):
            for how in COPIES:
                with pytest.raises(TypeError, match=f"{what} .* cannot be pickled or copied"):
                    how(obj)
        sampler.close()
        groups.free()


ITERATOR = textwrap.dedent("""
    import copy, pickle
    import numpy as np
    import gear_mpi as gm
    from mpi4py import MPI
    spec = gm.TrajectorySpec({"obs": ((3,), "float32")}, max_length=4)
    with gm.Replay(spec, 64, comm=MPI.COMM_SELF) as replay:
        replay.insert({"obs": np.ones((4, 3), np.float32)})
        it = replay.batches(2, window=1, prefetch=1, limit=4)
        for how in (copy.copy, copy.deepcopy, pickle.dumps):
            try:
                how(it)  # (a copy made here and dropped used to hang this process in its __del__)
                print("copied", how.__name__)
            except TypeError as e:
                print("refused", how.__name__, e)
        print("batches", sum(1 for _ in it))
""")


def test_a_batches_iterator_refuses_copies_instead_of_hanging_at_their_collection():
    proc = subprocess.run([sys.executable, "-c", ITERATOR], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for how in ("copy", "deepcopy", "dumps"):
        assert f"refused {how} a batches() iterator (it runs a thread over the replay) cannot be pickled" \
            in proc.stdout, proc.stdout
    assert "batches 4" in proc.stdout, proc.stdout
