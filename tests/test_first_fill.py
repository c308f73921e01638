"""A fresh shard's first fill (issue 13, item 3): a priority row that stands for one value, fresh pages
committed ahead of the writes, and huge pages asked again once a large first fill is done."""
from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import TrajectoryStore, arenas as memory, store as store_module, store_insert


def _spec():
    return gm.TrajectorySpec({"x": ((3,), np.float32), "r": ((), np.float32)}, max_length=1)


def _cols(n, seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 3)).astype(np.float32), "r": rng.standard_normal(n).astype(np.float32)}


def _priorities(shard, keys):
    return shard.priorities(keys)


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.0, 0.4)], ids=repr)
def test_a_row_of_one_value_reads_as_a_written_row(shard_factory, sampler):
    """The same inserts and updates into a shard whose row stands for one value and into one whose row is
    written from the start give the same priorities, checkpoint sections and samples."""
    lazy = shard_factory(_spec(), 60, sampler, seed=5)
    eager = shard_factory(_spec(), 60, sampler, seed=5)
    eager.store.priority_constant = None  # written from the start
    assert lazy.store.priority_constant == 0.0
    rng = np.random.default_rng(3)
    keys = []
    steps = [("insert", None), ("insert", None), ("update_same", None), ("insert", "array_same"),
             ("insert", "array_mixed"), ("update", None), ("insert", None)]
    for i, (what, how) in enumerate(steps):
        if what == "insert":
            n = int(rng.integers(5, 25))
            pr = None if how is None else (np.full(n, 1.0) if how == "array_same" else rng.uniform(0, 2, n))
            ka = lazy.insert_packed(_cols(n, i), np.ones(n, np.int64), pr)
            kb = eager.insert_packed(_cols(n, i), np.ones(n, np.int64), pr)
            np.testing.assert_array_equal(ka, kb)
            keys.append(ka)
        else:
            k = np.concatenate(keys)[:10]
            p = np.ones(len(k)) if what == "update_same" else rng.uniform(0, 3, len(k))
            assert lazy.update_priorities(k, p) == eager.update_priorities(k, p)
        if i < 3:  # one value so far: nothing written
            assert lazy.store.priority_constant == 1.0 and not lazy.store.priority.any()
        every = np.concatenate(keys)
        np.testing.assert_array_equal(_priorities(lazy, every), _priorities(eager, every))
        sa, sb = dict(lazy.store.table_sections()), dict(eager.store.table_sections())
        live = sa["alive"] == 1
        np.testing.assert_array_equal(sa["priority"][live], sb["priority"][live])
        np.testing.assert_array_equal(lazy.sample(8, 1).keys.numpy(), eager.sample(8, 1).keys.numpy())
    assert lazy.store.priority_constant is None  # materialized by the mixed batch


def test_a_first_batch_sets_the_value_and_a_checkpoint_restores_it(shard_factory):
    a = shard_factory(_spec(), 40)
    keys = a.insert_packed(_cols(30, 1), np.ones(30, np.int64), np.full(30, 2.5))
    assert a.store.priority_constant == 2.5 and not a.store.priority.any()
    b = shard_factory(_spec(), 40)
    sections = a.store.table_sections()
    b.store.restore_table(a.store.state.copy(), dict(sections))
    assert b.store.priority_constant is None
    np.testing.assert_array_equal(b.store.priority[:30], np.full(30, 2.5))
    more = a.insert_packed(_cols(5, 2), np.ones(5, np.int64))  # another value: the row is written now
    assert a.store.priority_constant is None
    np.testing.assert_array_equal(a.priorities(np.concatenate([keys[5:], more])), [2.5] * 25 + [1.0] * 5)


def test_ordered_selectors_write_their_row(shard_factory):
    s = shard_factory(_spec(), 40, gm.Fifo())
    s.insert_packed(_cols(4, 1), np.ones(4, np.int64))
    assert s.store.priority_constant is None and (s.store.priority[:4] == 1.0).all()


def _smaps_field(address: int, field: str) -> list[str]:
    """The values of ``field`` (e.g. ``VmFlags:``) of the mapping holding ``address`` (/proc/self/smaps)."""
    current = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                current = lo <= address < hi
            elif current and head == field:
                return line.split()[1:]
    return []


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address``."""
    return _smaps_field(address, "VmFlags:")


def test_a_large_first_fill_asks_for_huge_pages_again(shard_factory, monkeypatch):
    """The huge-page advice is off during a large first fill and back on after it (the rows and columns
    keep their contents); pages committed ahead of the writes hold what was written."""
    if not memory.PrivateArena.huge_pages or not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("huge pages off here")
    n = 1 << 17  # a 2 MB column arena and table rows of 512 KB and up
    s = shard_factory(_spec(), n, gm.Uniform())
    arena = s.store.arena.buffer
    if "hg" not in _vm_flags(arena.ctypes.data):
        pytest.skip("this kernel does not take MADV_HUGEPAGE")
    seen = []
    real = TrajectoryStore._insert_chunks

    def spy(store, *args):
        seen.append(_vm_flags(store.arena.buffer.ctypes.data))
        return real(store, *args)

    monkeypatch.setattr(TrajectoryStore, "_insert_chunks", spy)
    monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 1 << 20)
    monkeypatch.setattr(store_insert, "PIECE_BYTES", 1 << 16)
    cols = _cols(n, 7)
    keys = s.insert_packed(cols, np.ones(n, np.int64))
    assert "nh" in seen[0] and "hg" not in seen[0]
    assert "hg" in _vm_flags(arena.ctypes.data) and "nh" not in _vm_flags(arena.ctypes.data)
    np.testing.assert_array_equal(s.store.columns["x"], cols["x"])
    np.testing.assert_array_equal(s.get(int(keys[-1]))["r"], cols["r"][-1:])
    assert s.store.ring_touched == n
    s.insert_packed(cols, np.ones(n, np.int64))  # warm: the store is full, no advice changed
    assert len(seen) == 2 and "hg" in seen[1]


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of the mapping holding ``address``."""
    return int((_smaps_field(address, "AnonHugePages:") or ["0"])[0])


def test_a_large_first_fill_is_merged_into_huge_pages_in_the_background(shard_factory, monkeypatch):
    """By default ($GEAR_MPI_COLLAPSE unset), after a large first fill on 4 KiB pages, the written ranges (and only those)
    are collapsed into huge pages by a background thread (MADV_COLLAPSE); the contents do not change."""
    if not memory.PrivateArena.huge_pages or memory.PrivateArena.first_fill_huge:
        pytest.skip("huge pages off, or kept for a first fill, here")
    from gear_mpi.storage import huge_pages as page_collapse
    n = 1 << 19  # 4 MB of x in a ring of 8 MB: half of it written
    s = shard_factory(_spec(), 2 * n, gm.Uniform())
    monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 1 << 20)
    monkeypatch.setattr(page_collapse, "ENABLED", True)  # the default, whatever this run's environment says
    cols = _cols(n, 9)
    keys = s.insert_packed(cols, np.ones(n, np.int64))
    collapser = s.store._collapser
    assert collapser is not None
    x = s.store.columns["x"]
    ranges = s.store.written_ranges()
    assert (x.ctypes.data, n * x.strides[0]) in ranges  # the written steps, not the whole ring
    assert all(size <= n * 12 for _, size in ranges), ranges  # 12 B: the widest step or table entry here
    collapser.thread.join(60)
    if collapser.collapsed == 0 and collapser.failed == 0:
        pytest.skip("this kernel does not know MADV_COLLAPSE")
    assert collapser.collapsed > 0 and _anon_huge_kb(x.ctypes.data) >= 2048, (collapser.collapsed, collapser.failed)
    np.testing.assert_array_equal(x[:n], cols["x"])
    np.testing.assert_array_equal(s.get(int(keys[-1]))["r"], cols["r"][-1:])
    s.store.close()  # stops the (finished) thread; idempotent with the fixture's close
    assert collapser.done()


def test_commit_pages_keeps_the_contents():
    pages = memory.anonymous_pages(1 << 20, huge=False)
    a = np.frombuffer(pages, np.uint8)
    a[100:200] = 7
    memory.commit_pages(a[50:70000])
    memory.commit_pages(np.zeros(4))  # not an anonymous mapping of ours: nothing
    assert (a[100:200] == 7).all() and a[:100].sum() == 0 and a[200:].sum() == 0


def test_huge_pages_always_leaves_the_advice_alone(monkeypatch):
    """$GEAR_MPI_HUGE_PAGES=always (PrivateArena.first_fill_huge): a large first fill keeps huge pages."""
    pages = memory.anonymous_pages(4 << 20)
    view = np.frombuffer(pages, np.uint8)
    assert len(memory.small_pages([view]).maps) == int(pages.huge)
    monkeypatch.setattr(memory.PrivateArena, "first_fill_huge", True)
    assert memory.small_pages([view]).maps == []


def test_collapse_is_off_when_asked(monkeypatch):
    """$GEAR_MPI_COLLAPSE=0 (page_collapse.ENABLED False): no thread, nothing advised."""
    from gear_mpi.storage import huge_pages as page_collapse
    monkeypatch.setattr(page_collapse, "ENABLED", False)
    pages = memory.anonymous_pages(8 << 20)
    view = np.frombuffer(pages, np.uint8)
    view[:] = 1
    c = page_collapse.Collapser([(view.ctypes.data, view.nbytes)])
    assert c.thread is None and c.done() and c.collapsed == 0 and len(c.ranges) >= 1
    c.stop()


def test_a_collapse_waits_while_its_owner_is_busy():
    """Collapser(busy=...): no chunk is collapsed while busy() says an insert runs; all of them once it stops."""
    from gear_mpi.storage import huge_pages as page_collapse
    pages = memory.anonymous_pages(8 << 20)
    view = np.frombuffer(pages, np.uint8)
    view[:] = 5
    asked, state = [], {"busy": True}

    def busy():
        asked.append(state["busy"])
        return state["busy"]

    c = page_collapse.Collapser([(view.ctypes.data, view.nbytes)], force=True, busy=busy)
    deadline = time.monotonic() + 30
    while len(asked) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(asked) >= 3 and c.collapsed == 0 and c.failed == 0 and not c.done()  # it waits, nothing advised
    state["busy"] = False
    c.thread.join(60)
    assert c.done() and c.collapsed + c.failed == sum(hi - lo for lo, hi in c.ranges) > 0
    assert (view == 5).all()
    c.stop()


def test_an_insert_is_busy_while_it_runs_and_a_large_one_just_after(shard_factory, monkeypatch):
    """TrajectoryStore.insert_busy: True inside an insert, for INSERT_QUIET_S after a large one, else False."""
    s = shard_factory(_spec(), 1 << 12, gm.Uniform())
    seen = []
    monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 1 << 40)  # no insert here is large
    s.store.on_write = lambda first, total: seen.append(s.store.insert_busy())
    s.insert_packed(_cols(64, 1), np.ones(64, np.int64))
    assert seen == [True] and not s.store.insert_busy()  # a small insert: busy only while it runs
    monkeypatch.setattr(store_insert, "OVERLAP_BYTES", 1)  # now every insert is large
    s.insert_packed(_cols(64, 2), np.ones(64, np.int64))
    assert s.store.insert_busy()  # a bulk load may go on: still busy just after
    time.sleep(store_module.INSERT_QUIET_S + 0.05)
    assert not s.store.insert_busy()
