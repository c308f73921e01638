"""What an adapter of a framework's buffer needs from a Shard (issue 31): ``clear()``, read (and writable) views
of the column rings, squeezed one-step samples, lossy casts on request, a bare shard saved and loaded, and
``Batch.empty`` carved from one aligned allocation."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.batch import LINE_ALIGN, PAGE_ALIGN

SPEC = gm.TrajectorySpec({"obs": ((4,), "float32"), "action": ((1,), "int64"), "reward": ((), "float32")},
                         max_length=1)
LONG = gm.TrajectorySpec({"x": ((3,), "float32"), "t": ((), "int32")}, max_length=6)


def steps(n: int, first: int = 0) -> dict[str, np.ndarray]:
    i = np.arange(first, first + n)
    return {"obs": np.repeat(i[:, None], 4, 1).astype(np.float32), "action": i[:, None].astype(np.int64),
            "reward": i.astype(np.float32)}


def insert_steps(shard: gm.Shard, n: int, first: int = 0, priorities=None) -> np.ndarray:
    return shard.insert_packed(steps(n, first), np.ones(n, np.int64), priorities)


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.7, 0.5), gm.Fifo()])
def test_clear_leaves_an_empty_shard_whose_ring_starts_again_at_step_zero(sampler):
    with gm.Shard(SPEC, 10, sampler, seed=1) as shard:
        old = np.concatenate([insert_steps(shard, 7), insert_steps(shard, 6, first=7)])  # wrapped, 3 evicted
        assert shard.locate(old[-1:])[0][0] == 2
        shard.clear()
        assert len(shard) == 0 and shard.total_weight == 0
        s = shard.stats()
        assert (s["items"], s["live_steps"], s["steps_used"], s["removed"]) == (0, 0, 0, 10)
        assert s["inserted"] == 13 and s["evicted"] == 3
        with pytest.raises(gm.EmptyReplayError):
            shard.sample(2, 1)
        with pytest.raises(gm.StaleKeyError):
            shard.get(int(old[-1]))
        assert shard.update_priorities(old[-3:], [1.0, 2.0, 3.0]) == 0  # stale: nothing applied
        new = insert_steps(shard, 4, first=100)
        assert shard.locate(new)[0].tolist() == [0, 1, 2, 3]  # as in a new shard
        assert not set(new.tolist()) & set(old.tolist())
        batch = shard.sample(64, 1)
        assert set(batch.keys.numpy().tolist()) <= set(new.tolist())
        assert set(batch.numpy()["reward"][:, 0].tolist()) <= {100.0, 101.0, 102.0, 103.0}
        shard.clear()
        shard.clear()  # twice: nothing left to remove
        assert shard.stats()["removed"] == 14


def test_clear_of_a_closed_shard_raises():
    shard = gm.Shard(SPEC, 4)
    shard.close()
    with pytest.raises(RuntimeError, match="closed"):
        shard.clear()
    with pytest.raises(RuntimeError, match="closed"):
        shard.columns()


def test_columns_are_the_rings_read_only_unless_asked():
    with gm.Shard(LONG, 20, max_items=8) as shard:
        keys = np.array([shard.insert({"x": np.full((5, 3), k, np.float32), "t": np.arange(5, dtype=np.int32)})
                         for k in range(5)])  # 25 steps into 20: wraps, evicts
        cols = shard.columns()
        assert cols["x"].shape == (20, 3) and cols["t"].shape == (20,) and cols["x"].dtype == np.float32
        assert not cols["x"].flags.writeable
        with pytest.raises(ValueError):
            cols["x"][0] = 1
        start, length = shard.locate(keys)
        for k, s, n in zip(keys, start, length):
            if n:  # live: its steps are the ring rows from its start, wrapping
                rows = (s + np.arange(n)) % 20
                np.testing.assert_array_equal(cols["x"][rows], shard.get(int(k))["x"])
        w = shard.columns(writable=True)
        w["t"][int(start[-1])] = 77  # writes the step in place
        assert shard.get(int(keys[-1]))["t"][0] == 77


def test_squeezed_samples_hold_what_unsqueezed_ones_hold():
    with gm.Shard(SPEC, 50, gm.Prioritized(0.6, 0.4), seed=3, tag=5) as a, \
            gm.Shard(SPEC, 50, gm.Prioritized(0.6, 0.4), seed=3, tag=5) as b:
        for shard in (a, b):
            insert_steps(shard, 30, priorities=np.arange(1, 31, dtype=np.float64))
        sq, plain = a.sample(40, 1, squeeze=True), b.sample(40, 1)
        assert sq.squeezed and not plain.squeezed
        assert sq["obs"].shape == (40, 4) and sq["action"].shape == (40, 1) and sq["reward"].shape == (40,)
        assert sq.mask.shape == (40, 1) and sq.window == 1
        for name in SPEC.names:
            np.testing.assert_array_equal(sq.numpy()[name], plain.numpy()[name][:, 0])
        np.testing.assert_array_equal(sq.keys.numpy(), plain.keys.numpy())
        np.testing.assert_array_equal(sq.weights.numpy(), plain.weights.numpy())
        view = plain.squeeze()
        assert view.squeezed and view["obs"].data_ptr() == plain["obs"].data_ptr()
        assert view.squeeze() is view
        again = a.sample(40, None, out=sq, squeeze=True)  # None: max_length 1; a squeezed out= refilled
        assert again is sq
        with pytest.raises(ValueError, match="squeeze"):
            a.sample(40, 1, out=sq)  # a squeezed batch is not an unsqueezed one's out=
        with pytest.raises(ValueError, match="squeeze"):
            a.sample(4, 1, out=plain, squeeze=True)


def test_squeeze_needs_one_step_windows():
    with gm.Shard(LONG, 30) as shard:
        shard.insert({"x": np.zeros((4, 3)), "t": np.zeros(4, np.int32)})
        with pytest.raises(ValueError, match="window=1"):
            shard.sample(2, 3, squeeze=True)
        with pytest.raises(ValueError, match="W=3"):
            shard.sample(2, 3).squeeze()
        assert shard.sample(2, 1, squeeze=True)["x"].shape == (2, 3)


def test_batch_buffers_are_aligned_and_disjoint():
    spec = gm.TrajectorySpec({"img": ((32, 32), "uint8"), "a": ((), "int64"), "b": ((3,), "float16")}, max_length=1)
    for b in (1, 7, 64):
        batch = gm.Batch.empty(spec, b, 1)
        arrays = [*batch.numpy().values(), batch._mask_np, *batch.meta_numpy()]
        spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
        assert all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:]))  # no overlap
        for a in arrays:
            assert a.flags.c_contiguous and a.ctypes.data % (PAGE_ALIGN if a.nbytes >= PAGE_ALIGN else LINE_ALIGN) == 0
        assert batch["img"].shape == (b, 1, 32, 32) and batch.keys.shape == (b,)
    with pytest.raises(ValueError, match="window=1"):
        gm.Batch.empty(spec, 4, 2, squeeze=True)


def test_lossy_casts_are_refused_unless_asked():
    with gm.Shard(SPEC, 10) as shard:
        lossy = {**steps(2), "action": np.array([[1.7], [-2.2]])}
        with pytest.raises(gm.InvalidTrajectoryError, match="casting='unsafe'"):
            shard.insert_packed(lossy, [1, 1])
        with pytest.raises(gm.InvalidTrajectoryError, match="cannot be cast"):
            shard.insert_many([{**steps(1), "action": np.array([[1.5]])}])
        with pytest.raises(ValueError, match="casting must be one of"):
            shard.insert_packed(lossy, [1, 1], casting="lossy")
        assert len(shard) == 0  # nothing stored by the refusals
        keys = shard.insert_packed(lossy, [1, 1], casting="unsafe")
        assert [int(shard.get(int(k))["action"][0, 0]) for k in keys] == [1, -2]  # as numpy's assignment casts
        k = shard.insert({**steps(1), "obs": np.full((1, 4), 2**40)}, casting="same_kind")  # int64 -> float32
        assert shard.get(k)["obs"][0, 0] == np.float32(2**40)
        with pytest.raises(gm.InvalidTrajectoryError, match="same_kind"):
            shard.insert({**steps(1), "action": np.array([[1.5]])}, casting="same_kind")  # float -> int: no


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.7, 0.5), gm.Lifo()])
def test_saved_shard_loads_exactly_and_draws_what_the_saved_one_would(tmp_path, sampler):
    with gm.Shard(LONG, 40, sampler, max_items=9, seed=11) as shard:
        rng = np.random.default_rng(0)
        keys = np.concatenate([shard.insert_many([{"x": rng.standard_normal((n, 3)), "t": np.arange(n, dtype=np.int32)}
                                                  for n in rng.integers(1, 7, 7)], rng.random(7) + 0.1)
                               for _ in range(3)])  # wrapped and evicted
        live = shard.live_keys()
        path = tmp_path / "shard.npz"
        gm.save_shard(shard, path)
        with gm.load_shard(path) as back:
            assert back.stats() == shard.stats() and back.spec == shard.spec and back.rank == shard.rank
            np.testing.assert_array_equal(back.live_keys(), live)
            for k in live:
                got, want = back.get(int(k)), shard.get(int(k))
                for name in want:
                    np.testing.assert_array_equal(got[name], want[name])
            np.testing.assert_array_equal(back.priorities(live), shard.priorities(live))
            a, b = shard.sample(16, 4), back.sample(16, 4)
            for name in LONG.names:
                np.testing.assert_array_equal(a.numpy()[name], b.numpy()[name])
            np.testing.assert_array_equal(a.keys.numpy(), b.keys.numpy())
            with pytest.raises(gm.StaleKeyError):
                back.get(int(keys[0]))  # evicted before the save: stale after the load too
        in_memory = pickle.loads(pickle.dumps(gm.shard_arrays(shard)))
        with gm.shard_from_arrays(in_memory) as again:
            np.testing.assert_array_equal(again.live_keys(), live)


def test_loading_what_is_not_a_saved_shard_raises_checkpoint_error(tmp_path):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file")
    with pytest.raises(gm.CheckpointError, match="cannot read"):
        gm.load_shard(bad)
    with pytest.raises(gm.CheckpointError, match="cannot read"):
        gm.load_shard(tmp_path / "missing.npz")
    np.savez(tmp_path / "other.npz", meta=np.frombuffer(b'{"format": "x"}', np.uint8))
    with pytest.raises(gm.CheckpointError, match="not a saved gear_mpi shard"):
        gm.load_shard(tmp_path / "other.npz")
    with gm.Shard(SPEC, 10) as shard:
        insert_steps(shard, 5)
        arrays = gm.shard_arrays(shard)
    arrays["column/0"] = arrays["column/0"][:-4]  # a truncated column
    with pytest.raises(gm.CheckpointError, match="does not fit"):
        gm.shard_from_arrays(arrays)
