"""The priority update of the batch just sampled into ``out=`` (gear_mpi.selection.sampled_update), through the
sample's sorted draw: the same index arrays, raw priorities, counts and stale counts, bit for bit, as a twin
shard updated through the general path with the same keys; duplicates, evicted keys and both kernels (serial
and parallel); and every input it does not serve goes the general way (errors raised, nothing changed)."""
import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.errors import InvalidKeyError, InvalidPriorityError
from gear_mpi.kernels import local_sample, priority_sampled, priority_tree
from gear_mpi.selection import sampled_update
from gear_mpi.shard import Shard


def _shard(sel, items=3000, maxlen=1):
    spec = gm.TrajectorySpec({"x": ((2,), "float32")}, max_length=maxlen)
    sh = Shard(spec, items * maxlen, sel, seed=11, tag=5, rank=2)
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, maxlen + 1, items)
    sh.insert_packed({"x": rng.standard_normal((lengths.sum(), 2)).astype(np.float32)}, lengths,
                     rng.random(items) * 3 + 0.05)
    return sh


def _insert_some(sh, count, seed):
    """Evicts the oldest items: some keys of the last batch go stale."""
    rng = np.random.default_rng(seed)
    sh.insert_packed({"x": rng.standard_normal((count, 2)).astype(np.float32)}, np.ones(count, np.int64),
                     rng.random(count) + 0.1)


def _state(sh):
    out = {name: arr.copy() for name, arr in zip(priority_tree.TREE_FIELDS, sh.index.tree)}
    row = sh.store.layout.priority
    if isinstance(row, np.ndarray) and sh.store.layout.priority_constant is None:
        out["raw"] = row.copy()
    out["stale"] = sh.stale_updates
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the two sorted-update kernels."""
    seen = []
    for name in ("update_sampled", "update_sampled_parallel"):
        fn = getattr(priority_sampled, name)
        monkeypatch.setattr(priority_sampled, name, lambda *a, _f=fn, _n=name: seen.append(_n) or _f(*a))
    return seen


@pytest.mark.parametrize("sel", [gm.Prioritized(0.6, 0.4), gm.Prioritized(1.0, 0.5), gm.Prioritized(0.0, 0.5),
                                 gm.Uniform()], ids=["alpha0.6", "alpha1", "alpha0", "uniform"])
@pytest.mark.parametrize("b", [40, 300, 2500])
def test_same_as_general_path(sel, b, calls, monkeypatch):
    monkeypatch.setattr(priority_sampled, "PARALLEL_MIN", 2048)  # and 2500 keys updated by the threads
    fast, slow = _shard(sel), _shard(sel)
    out = fast.sample(b, 1)
    slow.sample(b, 1)
    for step in range(5):
        fast.sample(b, 1, out=out)
        want = slow.sample(b, 1)
        np.testing.assert_array_equal(out.keys.numpy(), want.keys.numpy())
        keys = out.keys.numpy()
        assert len(np.unique(keys)) < b or b == 40  # duplicates: the last one in batch order wins
        if step >= 2:  # some of the batch's items evicted since the draw: counted as stale, not written
            _insert_some(fast, 200, step)
            _insert_some(slow, 200, step)
        new = np.random.default_rng(step).random(b) * 2
        new[::7] = 0.0  # zero weights: block minima recounted
        new[1::9] = -0.0
        before = len(calls)
        lazy = fast.store.layout.priority_constant is not None  # Uniform's row until its first update
        got = fast.update_priorities(out.keys, new)
        assert got == slow.apply_priorities(keys.copy(), np.abs(new)).sum()
        _assert_same(_state(fast), _state(slow))
        if not lazy:
            assert len(calls) == before + 1 and calls[-1] == ("update_sampled_parallel" if b >= priority_sampled.PARALLEL_MIN
                                                              else "update_sampled")
    assert fast.stale_updates > 0
    assert fast.rng.random() == slow.rng.random()


def test_other_inputs_go_the_general_way(calls, monkeypatch):
    sel = gm.Prioritized(0.6, 0.4)
    sh, twin = _shard(sel), _shard(sel)
    out = sh.sample(300, 1)
    sh.sample(300, 1, out=out)
    twin_out = twin.sample(300, 1)
    twin_out = twin.sample(300, 1)
    new = np.random.default_rng(1).random(300)
    # a bad priority or a foreign key: the general path's error, nothing changed
    before = _state(sh)
    bad = new.copy()
    bad[17] = np.nan
    with pytest.raises(InvalidPriorityError):
        sh.update_priorities(out.keys, bad)
    with pytest.raises(InvalidPriorityError):
        sh.update_priorities(out.keys, new[:10])
    keys = out.keys.numpy()
    saved = keys[5]
    keys[5] = saved ^ (1 << 62)  # in place: the batch's keys tensor sees it
    with pytest.raises(InvalidKeyError):
        sh.update_priorities(out.keys, new)
    keys[5] = saved
    _assert_same(_state(sh), before)
    assert calls == ["update_sampled"] * 2  # the NaN and the foreign key: refused by the kernel, raised by the general path
    # another shard's sample in between takes this thread's scratch: the general path, the same result
    other = _shard(gm.Prioritized(0.6, 0.4))
    other.sample(300, 1)
    assert sh.update_priorities(out.keys, list(new)) == twin.update_priorities(twin_out.keys.clone(), new)
    _assert_same(_state(sh), _state(twin))
    assert len(calls) == 3  # tried (a list of priorities, validated), refused: its scratch is the other sample's
    # keys changed in place to other live keys of the batch: refused (the draw no longer describes them)
    sh.sample(300, 1, out=out)
    twin_out = twin.sample(300, 1)
    keys[[0, 1]] = keys[[1, 0]]
    if keys[0] != keys[1]:
        twin_keys = twin_out.keys.numpy().copy()
        twin_keys[[0, 1]] = twin_keys[[1, 0]]
        assert sh.update_priorities(out.keys, new) == twin.update_priorities(twin_keys, new)
        _assert_same(_state(sh), _state(twin))
    # the kernel refuses a scratch that is not a sorted draw of these keys
    sh.sample(300, 1, out=out)
    sslots, order, inv = local_sample.sorted_draw(300)
    order[[3, 4]] = order[[4, 3]]
    assert sampled_update.update_batch(sh, out.keys.numpy(), new) is None
    assert sh.update_priorities(out.keys, new) >= 0  # the general path


def test_small_batches_and_no_draw(monkeypatch):
    sh = _shard(gm.Prioritized(0.6, 0.4))
    out = sh.sample(8, 1)
    sh.sample(8, 1, out=out)  # fewer than DRAW_PIPE: drawn unsorted, no sorted draw to take
    assert local_sample.sorted_draw(8) is None
    assert sampled_update.update_batch(sh, out.keys.numpy(), np.ones(8)) is None
    assert sh.update_priorities(out.keys, np.ones(8)) == 8


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("where", [0, 1300, 2499])
def test_bad_input_on_the_threads_changes_nothing(where, threads, calls, monkeypatch):
    """The parallel kernel checks every slice before any thread writes (its one region waits for every slice's
    checks): a NaN priority or a foreign key in the first, a middle or the last slice is refused by the kernel,
    raised by the general path, and leaves the index, the raw priorities and the counts as they were; the same
    batch then updates as the general path would."""
    import numba
    before_threads = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        monkeypatch.setattr(priority_sampled, "PARALLEL_MIN", 2048)
        sel = gm.Prioritized(0.6, 0.4)
        sh, twin = _shard(sel), _shard(sel)
        b = 2500
        out = sh.sample(b, 1)
        sh.sample(b, 1, out=out)
        twin.sample(b, 1)
        twin_keys = twin.sample(b, 1).keys.numpy().copy()
        new = np.random.default_rng(where).random(b) + 0.01
        sh.update_priorities(out.keys, new)  # raw priorities kept from here on
        twin.apply_priorities(twin_keys.copy(), new)
        sh.sample(b, 1, out=out)
        twin_keys = twin.sample(b, 1).keys.numpy().copy()
        before = _state(sh)
        bad = new.copy()
        bad[where] = np.nan
        with pytest.raises(InvalidPriorityError):
            sh.update_priorities(out.keys, bad)
        keys = out.keys.numpy()
        saved = keys[where]
        keys[where] = saved ^ (1 << 62)  # in place: the batch's keys tensor sees it
        with pytest.raises(InvalidKeyError):
            sh.update_priorities(out.keys, new)
        keys[where] = saved
        _assert_same(_state(sh), before)
        assert calls[-2:] == ["update_sampled_parallel"] * 2  # both refused by the parallel kernel
        assert sh.update_priorities(out.keys, new[::-1].copy()) == twin.apply_priorities(twin_keys.copy(),
                                                                                       new[::-1].copy()).sum()
        _assert_same(_state(sh), _state(twin))
    finally:
        numba.set_num_threads(before_threads)


@pytest.mark.parametrize("threads", [False, True], ids=["serial", "threads"])
def test_a_key_of_another_generation_is_stale(threads, calls, monkeypatch):
    """A batch key whose generation was changed in place (its slot still the draw's) is a stale key, as the
    general path counts it: the sorted update reads each key's generation at its sorted position."""
    from gear_mpi.keys import _GEN_SHIFT
    monkeypatch.setattr(priority_sampled, "PARALLEL_MIN", 256 if threads else 1 << 30)
    sel = gm.Prioritized(0.6, 0.4)
    sh, twin = _shard(sel), _shard(sel)
    out = sh.sample(300, 1)
    sh.sample(300, 1, out=out)
    twin.sample(300, 1)
    twin_keys = twin.sample(300, 1).keys.numpy().copy()
    keys = out.keys.numpy()
    np.testing.assert_array_equal(keys, twin_keys)
    for row in (5, 6, 299):
        keys[row] ^= 1 << _GEN_SHIFT
        twin_keys[row] ^= 1 << _GEN_SHIFT
    new = np.random.default_rng(2).random(300) + 0.1
    before = len(calls)
    got = sh.update_priorities(out.keys, new)
    assert len(calls) == before + 1  # through the sorted draw, not refused
    assert got == twin.update_priorities(twin_keys, new) == 300 - 3
    assert sh.stale_updates == twin.stale_updates == 3
    _assert_same(_state(sh), _state(twin))


def test_prepared_calls_take_only_what_they_were_made_for():
    """After two steps the sample and the update call their kernels' compiled entry points directly
    (gear_mpi.kernels.compiled); priorities of another array type, bad priorities, a sample of another size
    between, and a call from another thread each still give the twin's general-path result or error."""
    import threading

    sel = gm.Prioritized(0.6, 0.4)
    sh, twin = _shard(sel), _shard(sel)
    out, want = sh.sample(300, 1), twin.sample(300, 1)
    rng = np.random.default_rng(9)

    def step(priorities, twin_priorities=None):
        sh.sample(300, 1, out=out)
        w = twin.sample(300, 1)
        np.testing.assert_array_equal(out.keys.numpy(), w.keys.numpy())
        got = sh.update_priorities(out.keys, priorities)
        assert got == twin.apply_priorities(w.keys.numpy().copy(), np.asarray(
            priorities if twin_priorities is None else twin_priorities, np.float64)).sum()
        _assert_same(_state(sh), _state(twin))

    for _ in range(2):
        step(rng.random(300))
    rep = sh._repeat
    assert rep.call.run is not local_sample._sample_kernel  # the entry point, not the dispatcher
    assert rep.update_call.run is not None
    wide = rng.random(600)
    step(wide[::2])  # strided: another layout, not the entry's
    step(rng.random(300).astype(np.float32))  # float32: validated and converted
    frozen = rng.random(300)
    frozen.flags.writeable = False
    step(frozen)
    bad = rng.random(300)
    bad[7] = np.nan
    sh.sample(300, 1, out=out)
    twin.sample(300, 1)
    before = _state(sh)
    with pytest.raises(InvalidPriorityError):
        sh.update_priorities(out.keys, bad)  # refused by the entry point's kernel, raised by the general path
    _assert_same(_state(sh), before)
    other = _shard(gm.Prioritized(0.6, 0.4))
    other.sample(40, 1)  # this thread's scratch cut for 40 items: the prepared calls are made again
    step(rng.random(300))
    assert sh._repeat.call.flat is local_sample._scratch(300)
    errors = []

    def on_a_thread():
        try:
            step(rng.random(300))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    worker = threading.Thread(target=on_a_thread)
    worker.start()
    worker.join()
    assert errors == []
    step(rng.random(300))  # back on this thread: its own scratch again
    assert sh.rng.random() == twin.rng.random()
