"""Samples into the same ``out=`` batch again (gear_mpi.selection.one_call.Repeat): the same rows, keys,
probabilities, weights, masks and data as a twin shard sampling into new batches with the same seed, and
every argument that would fail the checks still fails them (nothing drawn, nothing changed)."""
import gc

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.errors import EmptyReplayError
from gear_mpi.kernels import local_sample
from gear_mpi.shard import Shard


def _shard(sel, maxlen=5):
    """A shard whose ring has wrapped (windows that wrap, evicted items)."""
    spec = gm.TrajectorySpec({"obs": ((3,), "float32"), "r": ((), "int32")}, max_length=maxlen)
    sh = Shard(spec, 1500, sel, seed=5, tag=7, rank=3)
    for seed in (0, 1):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, maxlen + 1, 400)
        sh.insert_packed({"obs": rng.standard_normal((lengths.sum(), 3)).astype(np.float32),
                          "r": np.arange(lengths.sum(), dtype=np.int32)}, lengths, rng.random(400) + 0.1)
    return sh


def _same(got, want):
    for name in got.data:
        np.testing.assert_array_equal(got[name].numpy(), want[name].numpy())
    for name in ("mask", "keys", "lengths", "probabilities", "weights"):
        np.testing.assert_array_equal(getattr(got, name).numpy(), getattr(want, name).numpy())


@pytest.mark.parametrize("sel", [gm.Prioritized(0.6, 0.4), gm.Uniform()], ids=["prioritized", "uniform"])
@pytest.mark.parametrize("b", [1, 40, 700])
def test_repeated_out_matches_new_batches(sel, b, monkeypatch):
    for window, align, squeeze in ((1, "random", False), (1, "head", True), (3, "random", False), (5, "tail", False)):
        again, fresh = _shard(sel), _shard(sel)
        out = again.sample(b, window, align, squeeze=squeeze)
        fresh.sample(b, window, align, squeeze=squeeze)
        for step in range(4):
            got = again.sample(b, window, align, out=out, squeeze=squeeze)
            assert got is out
            assert again._repeat is not None and again._repeat.same(out, b, window, align, squeeze)
            _same(got, fresh.sample(b, window, align, squeeze=squeeze))
            new = np.random.default_rng(step).random(b) + 0.01
            assert again.update_priorities(out.keys, new) == fresh.update_priorities(out.keys.clone(), new)
        np.testing.assert_array_equal(again.index.leaves, fresh.index.leaves)
        assert again.stats() == fresh.stats()
        assert again.rng.random() == fresh.rng.random()  # the streams stayed together


def test_other_arguments_still_checked():
    sh = _shard(gm.Prioritized(0.6, 0.4))
    out = sh.sample(8, 2)
    sh.sample(8, 2, out=out)
    assert sh._repeat is not None
    state = sh.rng.bit_generator.state
    for bad in (dict(batch_size=8.0), dict(batch_size=True), dict(batch_size=9), dict(window=2.0), dict(window=3),
                dict(align="middle")):
        kw = dict(batch_size=8, window=2, out=out) | bad
        with pytest.raises(ValueError):
            sh.sample(**kw)
    assert sh.rng.bit_generator.state == state  # nothing drawn
    other = sh.sample(8, 2)  # another batch of the same shape: checked and recorded in its turn
    assert sh.sample(8, 2, out=other) is other and sh._repeat.same(other, 8, 2, "random", False)
    assert sh.sample(8, 2, out=out) is out


def test_empty_closed_and_dropped():
    sh = _shard(gm.Uniform())
    out = sh.sample(16, 1)
    sh.sample(16, 1, out=out)
    sh.clear()
    with pytest.raises(EmptyReplayError):
        sh.sample(16, 1, out=out)
    _shard_refill = _shard(gm.Uniform())
    batch = _shard_refill.sample(16, 1)
    _shard_refill.sample(16, 1, out=batch)
    ref = _shard_refill._repeat
    del batch
    gc.collect()
    assert ref.batch() is None  # the shard does not keep the caller's batch alive
    assert _shard_refill.sample(16, 1).keys.shape == (16,)
    _shard_refill.close()
    with pytest.raises(RuntimeError, match="closed"):
        _shard_refill.sample(16, 1)
    sh2 = _shard(gm.Uniform())
    out2 = sh2.sample(16, 1)
    sh2.sample(16, 1, out=out2)
    sh2.store.arena, arena = None, sh2.store.arena  # closed under the record (close() drops it as well)
    with pytest.raises(RuntimeError, match="closed"):
        sh2.sample(16, 1, out=out2)
    sh2.store.arena = arena
    sh2.close()


def test_general_path_switch_is_honoured():
    fast, slow = _shard(gm.Prioritized(0.6, 0.4)), _shard(gm.Prioritized(0.6, 0.4))
    out = fast.sample(32, 2)
    slow.sample(32, 2)
    fast.sample(32, 2, out=out)
    slow.sample(32, 2)
    fast._fused = False  # the general path from now on, record or not: the same draws still
    _same(fast.sample(32, 2, out=out), slow.sample(32, 2))


@pytest.mark.parametrize("b", [64, 256, 300])
def test_wide_rows_match_the_general_path(b):
    """Batches of 64-511 windows of 4 KiB rows (W2's), whose copy runs in parallel from ``COPY_THREADS_BYTES``
    (256 rows), first and again into ``out=``: the same rows, keys, weights and data as the general path."""
    spec = gm.TrajectorySpec({"obs": ((4096,), "uint8"), "a": ((), "float32")}, max_length=3)
    shards = []
    for _ in range(2):
        sh = Shard(spec, 3000, gm.Prioritized(0.6, 0.4), seed=9, tag=3)
        rng = np.random.default_rng(2)
        lengths = rng.integers(1, 4, 1500)  # 1500 items of up to 3 steps in 3000 steps: the ring wraps
        sh.insert_packed({"obs": rng.integers(0, 255, (lengths.sum(), 4096), dtype=np.uint8),
                          "a": rng.random(lengths.sum(), dtype=np.float32)}, lengths, rng.random(1500) + 0.1)
        shards.append(sh)
    fast, slow = shards
    slow._fused = False
    for window, align in ((1, "random"), (2, "random"), (3, "tail")):
        assert (b * window * spec.step_bytes_array.sum() >= local_sample.COPY_THREADS_BYTES) == (b * window >= 256)
        out = fast.sample(b, window, align)
        _same(out, slow.sample(b, window, align))
        _same(fast.sample(b, window, align, out=out), slow.sample(b, window, align))


def test_the_shard_holds_no_reference_to_a_reused_batch():
    """The record of a reused batch holds the batch weakly and none of its arrays or tensors: the batch's
    reference counts (``Batch.references``, which ``batches(recycle="auto")`` compares to tell whether the loop
    still holds a batch) are the same whether the shard remembers it or not."""
    sh = _shard(gm.Prioritized(0.6, 0.4))
    out = sh.sample(16, 1)
    sh.sample(16, 1, out=out)
    held = sh._repeat is not None and sh._repeat.batch() is out
    remembered = out.references()
    other = sh.sample(16, 1)
    sh.sample(16, 1, out=other)  # the shard now remembers another batch
    moved = sh._repeat.batch() is other
    now = out.references()
    assert held and moved
    assert now == remembered


@pytest.mark.parametrize("sel", [gm.Prioritized(0.6, 0.4), gm.Uniform()], ids=["prioritized", "uniform"])
@pytest.mark.parametrize("b", [1, 40, 700])
def test_repeated_new_batches_match_the_checked_path(sel, b, monkeypatch):
    """A sample into a new batch with the arguments of the last one-call sample skips the checks (a fresh
    record): the same draws as a twin that takes the checked path every call, a new batch each call (the last
    one left as it was), and an update of that batch's keys (through the sorted draw) the same as the twin's."""
    for window, align, squeeze in ((1, "random", False), (1, "head", True), (3, "random", False), (5, "tail", False)):
        fast, checked = _shard(sel), _shard(sel)
        batches, twins = [], []
        for step in range(4):
            checked._repeat = None  # the checked path every call
            want = checked.sample(b, window, align, squeeze=squeeze)
            got = fast.sample(b, window, align, squeeze=squeeze)
            assert step == 0 or fast._repeat is record  # the record the first call made serves the others
            record = fast._repeat
            assert record.fresh and record.batch() is got and all(got is not old for old in batches)
            _same(got, want)
            batches.append(got)
            twins.append(want)
            new = np.random.default_rng(step).random(b) + 0.01
            assert fast.update_priorities(got.keys, new) == checked.update_priorities(want.keys.clone(), new)
        for got, want in zip(batches, twins):
            _same(got, want)  # no later call wrote into an earlier batch
        np.testing.assert_array_equal(fast.index.leaves, checked.index.leaves)
        assert fast.stats() == checked.stats()
        assert fast.rng.random() == checked.rng.random()


def test_new_batch_arguments_that_differ_are_still_checked():
    sh = _shard(gm.Prioritized(0.6, 0.4))
    sh.sample(8, 2)
    sh.sample(8, 2)
    assert sh._repeat is not None and sh._repeat.fresh and sh._repeat.same(None, 8, 2, "random", False)
    state = sh.rng.bit_generator.state
    for bad in (dict(batch_size=8.0), dict(batch_size=True), dict(window=2.0), dict(align="middle"),
                dict(squeeze=True)):
        with pytest.raises(ValueError):
            sh.sample(**(dict(batch_size=8, window=2) | bad))
    assert sh.rng.bit_generator.state == state  # nothing drawn
    assert not sh._repeat.same(None, 9, 2, "random", False) and sh.sample(9, 2).keys.shape == (9,)
    sh.clear()  # the fresh record of (9, 2) is kept; the shard has nothing to draw
    with pytest.raises(EmptyReplayError):
        sh.sample(9, 2)
    sh.close()
    with pytest.raises(RuntimeError, match="closed"):
        sh.sample(9, 2)


def test_a_new_generator_is_drawn_from():
    """The kernel draws a repeated sample's uniforms from the shard's generator itself (kernels.bitgen): a
    generator put in its place, of another kind, is the one drawn from, as the checked path draws from it."""
    again, checked = _shard(gm.Prioritized(0.6, 0.4)), _shard(gm.Prioritized(0.6, 0.4))
    out = again.sample(50, 2)
    checked.sample(50, 2)
    for step in range(6):
        if step == 3:
            again.rng, checked.rng = (np.random.Generator(np.random.Philox(8)) for _ in range(2))
        checked._repeat = None  # the checked path every call
        _same(again.sample(50, 2, out=out), checked.sample(50, 2))
        assert step == 0 or again._repeat.call.rng is again.rng
    assert again.rng.random() == checked.rng.random()
