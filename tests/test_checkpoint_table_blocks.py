"""Incremental tables of background checkpoints (gear_mpi/checkpoint/table_blocks.py) and the direct writer's
in-place path (files.write_file_direct): one process, real files, no MPI.

- write_file_direct writes a page-aligned chunk from where it lies, mixed with unaligned ones, and the file,
  size and sha256 are write_file's;
- changed_blocks finds exactly the blocks whose bytes differ, and counts a grown tail as changed;
- Copies never reuses the buffer that holds the base's copy;
- write/read: the first write writes every block; the next links the unchanged ones to the first
  (the same inode) and writes only the changed ones; each reads back alone, also after the other
  directory is deleted; a damaged block is named.
"""
from __future__ import annotations

import hashlib
import mmap
import os
import shutil

import numpy as np
import pytest

from gear_mpi.checkpoint import files, pacing, table_blocks as tb
from gear_mpi.errors import CheckpointError

B = 16 << 10  # small blocks: the same code as BLOCK, on small arrays


def test_direct_write_in_place_and_through_the_buffer(tmp_path):
    page = np.frombuffer(mmap.mmap(-1, 5 * 4096), np.uint8)  # page-aligned: written where it lies
    page[:] = np.random.default_rng(1).integers(0, 256, page.size, dtype=np.uint8)
    odd = np.arange(3001, dtype=np.uint8)
    chunks = [page, odd, page[4096:], page[:4096 + 17]]  # aligned, unaligned, aligned after the buffer
    info = files.write_file_direct(str(tmp_path / "d"), chunks)
    assert info == files.write_file(str(tmp_path / "b"), chunks)
    want = b"".join(bytes(c) for c in chunks)
    assert (tmp_path / "d").read_bytes() == want
    assert info["sha256"] == hashlib.sha256(want).hexdigest()
    given = files.write_file_direct(str(tmp_path / "g"), [page], sha256="ab" * 32)  # a digest already known
    assert given == {"bytes": page.size, "sha256": "ab" * 32} and (tmp_path / "g").read_bytes() == page.tobytes()


def test_changed_blocks():
    old = np.random.default_rng(2).integers(0, 256, 5 * B + 100, dtype=np.uint8)
    new = old.copy()
    assert not tb.changed_blocks(new, old, B).any() and len(tb.changed_blocks(new, old, B)) == 6
    new[2 * B + 5] ^= 1
    new[-1] ^= 1
    assert tb.changed_blocks(new, old, B).tolist() == [False, False, True, False, False, True]
    grown = np.concatenate([old, np.zeros(B, np.uint8)])  # the short last block filled, one more after it
    assert tb.changed_blocks(grown, old, B).tolist() == [False] * 5 + [True, True]
    assert tb.changed_blocks(grown, None, B).all() and len(tb.changed_blocks(old[:0], old, B)) == 0


def test_copies_keep_the_base_copy():
    c = tb.Copies()
    secs = [("a", np.arange(10, dtype=np.int64)), ("order", np.arange(3, dtype=np.int32)),
            ("order", np.arange(3, 5, dtype=np.int32)), ("free", np.zeros(0, np.int32))]
    arrays, flats = c.copy(secs)
    assert [f.nbytes for f in flats] == [80, 20, 0]  # the two halves of one name: one contiguous section
    assert flats[1].view(np.int32).tolist() == [0, 1, 2, 3, 4]
    assert all(f.__array_interface__["data"][0] % tb.ALIGN == 0 for f in flats)
    keep = list(flats)
    for _ in range(3):  # whatever the turn, the kept copy is never written over
        arrays2, flats2 = c.copy([("a", np.full(10, 7, np.int64))], keep)
        assert not any(np.may_share_memory(f, k) for f in flats2 for k in keep)
        assert keep[0].view(np.int64).tolist() == list(range(10))


def sections(n: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [("start", np.arange(n, dtype=np.int64)), ("priority", rng.random(n)),
            ("order", np.arange(n // 2, dtype=np.int32)), ("order", np.arange(n // 2, n, dtype=np.int32)),
            ("free", np.zeros(0, np.int32))]


def layout(secs) -> list:
    out = []
    for name, arr in secs:
        if out and out[-1][0] == name:
            out[-1][2] += len(arr)
        else:
            out.append([name, arr.dtype.str, len(arr)])
    return out


def test_blocks_written_linked_and_read_alone(tmp_path):
    n = 20_000  # 160 kB a section: 10 blocks of 16 KiB
    copies = tb.Copies()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    s1 = sections(n, 3)
    lay1 = layout(s1)
    stems = [s for s, _, _ in tb.groups(lay1)]
    _, f1 = copies.copy(s1)
    e1, w1, l1 = tb.write(str(one), stems, f1, None, pacing.Pacer(), B)
    assert l1 == 0 and w1 == sum(f.nbytes for f in f1) and sorted(e1) == sorted(tb.names(lay1, B))
    s2 = sections(n + 100, 3)  # grown by 100 rows; a few priorities changed in place
    s2[1][1][:n] = s1[1][1]
    s2[1][1][5000] = -1.0
    lay2 = layout(s2)
    _, f2 = copies.copy(s2, list(f1))
    e2, w2, l2 = tb.write(str(two), stems, f2, (str(one), e1, dict(zip(stems, f1))), pacing.Pacer(), B)
    # start: the short last block and one more; priority: the block of row 5000 and the tail; order: the
    # tail (its halves moved, not its bytes)
    assert 0 < w2 <= 8 * B and l2 > 20 * B, (w2, l2)
    linked = [n for n in e2 if os.stat(two / n).st_nlink > 1]
    assert linked and all(os.path.samefile(two / n, one / n) and e2[n] == e1[n] for n in linked)
    assert "table-priority-00002.bin" not in linked and "table-priority-00001.bin" in linked
    got = tb.read(str(two), e2, lay2, B)
    for name, arr in s2:
        if name != "order":
            assert np.array_equal(got[name], arr), name
    assert got["order"].tolist() == list(range(n + 100))
    shutil.rmtree(one)  # the second stands alone
    assert np.array_equal(tb.read(str(two), e2, lay2, B)["priority"], s2[1][1])
    victim = two / "table-start-00000.bin"
    data = bytearray(victim.read_bytes())
    data[7] ^= 1
    victim.unlink()
    victim.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="table-start-00000.bin: sha256 does not match"):
        tb.read(str(two), e2, lay2, B)
    assert tb.is_table_file("table.bin") and tb.is_table_file("table-free-00000.bin")
    assert not tb.is_table_file("seg-00001.bin")


def test_without_hard_links_unchanged_blocks_are_copied(tmp_path, monkeypatch):
    copies = tb.Copies()
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    s1 = sections(5000, 4)
    stems = [s for s, _, _ in tb.groups(layout(s1))]
    _, f1 = copies.copy(s1)
    e1, _, _ = tb.write(str(one), stems, f1, None, pacing.Pacer(), B)

    def refused(src, dst):
        raise OSError(18, "Invalid cross-device link")  # EXDEV
    monkeypatch.setattr(os, "link", refused)
    _, f2 = copies.copy(s1, list(f1))
    entries, pending, copied, linked = tb.plan(str(two), stems, f2, (str(one), e1, dict(zip(stems, f1))), B)
    assert not pending and len(copied) == len(e1) and linked == sum(f.nbytes for f in f1)
    more, written = tb.write_pending(str(two), pending, copied, pacing.Pacer())
    assert written == 0 and entries == e1
    assert all(os.stat(two / n).st_nlink == 1 and (two / n).read_bytes() == (one / n).read_bytes() for n in e1)
