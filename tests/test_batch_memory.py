"""Large host batches' memory kept for the next batch (gear_mpi.batch_memory): reused only once nothing refers to
it, never while an array, a view or a tensor of it lives, and a reused buffer's old bytes never show."""
import threading

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi import batch_memory

BIG = batch_memory.MIN_BYTES + 4096


@pytest.fixture(autouse=True)
def empty_pool():
    batch_memory.release()
    yield
    batch_memory.release()


def test_small_allocations_are_not_kept():
    a = batch_memory.byte_buffer(batch_memory.MIN_BYTES - 1)
    assert a.dtype == np.uint8 and a.shape == (batch_memory.MIN_BYTES - 1,)
    assert batch_memory.kept_bytes() == (0, 0)


def test_a_dropped_buffer_is_reused_a_referenced_one_never():
    a = batch_memory.byte_buffer(BIG)
    first = a.ctypes.data
    assert batch_memory.kept_bytes() == (BIG, 0)
    a[:] = 0
    view = a[100:200]  # a view keeps the buffer in use after the array's name is gone
    del a
    b = batch_memory.byte_buffer(BIG)
    assert b.ctypes.data != first
    b[:] = 7
    assert not view.any()
    del view
    c = batch_memory.byte_buffer(BIG)
    assert c.ctypes.data == first  # nothing refers to it any more
    assert batch_memory.byte_buffer(BIG + 4096).ctypes.data not in (first, b.ctypes.data)  # another size: its own


def test_at_most_keep_buffers_are_tracked_and_release_frees_the_idle_ones():
    held = [batch_memory.byte_buffer(BIG) for _ in range(batch_memory.KEEP + 2)]
    total, idle = batch_memory.kept_bytes()
    assert total == batch_memory.KEEP * BIG and idle == 0
    held.pop()  # the newest, tracked: idle now
    assert batch_memory.kept_bytes() == (batch_memory.KEEP * BIG, BIG)
    assert batch_memory.release() == BIG
    assert batch_memory.kept_bytes() == (0, 0)
    assert all(h.shape == (BIG,) for h in held)  # the ones in use stay with their holders


def test_the_pool_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(batch_memory.ENV, "0")
    a = batch_memory.byte_buffer(BIG)
    assert batch_memory.kept_bytes() == (0, 0) and a.shape == (BIG,)


def test_a_forked_child_starts_with_an_empty_pool_and_a_free_lock():
    import os
    kept = batch_memory.byte_buffer(BIG)
    with batch_memory._lock:  # held at the fork, as another thread of the parent might hold it
        pid = os.fork()
        if pid == 0:  # the child: must not block, and must not hand out the parent's buffer
            ok = batch_memory.kept_bytes() == (0, 0)
            b = batch_memory.byte_buffer(BIG)
            ok = ok and batch_memory.kept_bytes() == (BIG, 0)
            del b
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert batch_memory.kept_bytes() == (BIG, 0)  # the parent's pool as it was
    del kept


@pytest.fixture
def image_shard():
    """A shard of 4 KiB steps whose B=160, W=64 batches are 40 MiB; episodes of 8-64 steps, each step's bytes its
    episode's number, so that a window shows where it came from and zero padding is told apart."""
    spec = gm.TrajectorySpec({"obs": ((4096,), "uint8"), "t": ((), "int32")}, max_length=64)
    shard = gm.Shard(spec, 64 * 300, seed=0)
    rng = np.random.default_rng(1)
    for i in range(200):
        length = int(rng.integers(8, 65))
        shard.insert({"obs": np.full((length, 4096), i % 250 + 1, np.uint8),
                      "t": np.arange(i * 1000, i * 1000 + length, dtype=np.int32)})
    yield shard
    shard.close()


def _check(batch):
    """Each window's steps are its episode's (one byte value, steps in order) and the padding is zero."""
    obs, t, mask = batch.numpy()["obs"], batch.numpy()["t"], batch.mask.numpy()
    assert obs.nbytes >= batch_memory.MIN_BYTES
    for r in range(obs.shape[0]):
        real = mask[r]
        assert real.any()
        values = np.unique(obs[r][real])
        assert len(values) == 1 and values[0] != 0
        assert not obs[r][~real].any() and not t[r][~real].any()
        steps = t[r][real]
        assert (np.diff(steps) == 1).all() and steps[0] // 1000 == values[0] - 1


def test_new_batches_reuse_a_dropped_batchs_memory_not_a_live_ones(image_shard):
    b1 = image_shard.sample(160, 64)
    a1 = b1.column_addresses()[0]
    size = batch_memory.kept_bytes()[0]  # the batch's one allocation
    assert size >= b1.nbytes
    _check(b1)
    kept_obs = b1["obs"]  # a tensor of the batch: its memory stays in use after the batch is dropped
    before = kept_obs.clone()
    del b1
    b2 = image_shard.sample(160, 64)
    assert b2.column_addresses()[0] != a1
    assert (kept_obs == before).all()  # the new sample wrote elsewhere
    _check(b2)
    del kept_obs, before
    a2 = b2.column_addresses()[0]
    b2.numpy()["obs"][:] = 0xFF  # the next batch in this memory must not show these bytes (padding: zeros)
    b2.numpy()["t"][:] = -1
    del b2
    assert batch_memory.kept_bytes() == (2 * size, 2 * size)
    b3 = image_shard.sample(160, 64)
    assert b3.column_addresses()[0] in (a1, a2) and batch_memory.kept_bytes() == (2 * size, size)
    _check(b3)
    b4 = image_shard.sample(160, 64)  # b3 lives: b4 takes the other kept buffer, nothing new is allocated
    assert b4.column_addresses()[0] in (a1, a2) and b4.column_addresses()[0] != b3.column_addresses()[0]
    assert batch_memory.kept_bytes() == (2 * size, 0)
    _check(b4)
    _check(b3)


def test_threads_sampling_new_batches_never_share_one(image_shard):
    """Four threads each sample new batches, mark every byte with their own value and check it after the
    others' samples: a buffer handed to two live batches would show another thread's mark."""
    errors = []
    lock = threading.Lock()

    def work(mark: int) -> None:
        try:
            for _ in range(6):
                with lock:  # (one shard: its calls take its lock anyway)
                    b = image_shard.sample(160, 64)
                obs = b.numpy()["obs"]
                obs[:] = mark
                for _ in range(3):
                    with lock:
                        other = image_shard.sample(160, 64)
                    assert (obs == mark).all()
                    del other
                del b, obs
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(m,)) for m in (11, 22, 33, 44)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors


def test_close_releases_the_idle_buffers(image_shard):
    b = image_shard.sample(160, 64)
    del b
    assert batch_memory.kept_bytes()[1] > 0
    image_shard.close()
    assert batch_memory.kept_bytes() == (0, 0)
