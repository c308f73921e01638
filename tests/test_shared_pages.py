"""Node-shared segments on huge pages (gear_mpi.storage.shared_pages): aligned mappings in every process,
collapsed by the creator, the contents unchanged, views keeping the memory mapped, and the opt-out."""
import mmap
import os
import subprocess
import sys

import numpy as np
import pytest

from gear_mpi.storage import SharedArena, huge_pages, shared_pages

HUGE_PAGE = huge_pages.HUGE_PAGE

MB = 1 << 20


def _segment_stats(name: str, pid: str = "self") -> dict:
    """Sum of Rss and ShmemPmdMapped (kB) over this process's mappings of the segment ``name``."""
    out, inside = {"Rss": 0, "ShmemPmdMapped": 0, "mappings": 0}, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if parts and "-" in parts[0] and not parts[0].endswith(":"):
                inside = any(name in p for p in parts[5:])
                out["mappings"] += inside
            elif inside and parts[0].rstrip(":") in ("Rss", "ShmemPmdMapped"):
                out[parts[0].rstrip(":")] += int(parts[1])
    return out


def _collapse_supported() -> bool:
    """Whether this kernel merges a tmpfs file's pages on MADV_COLLAPSE (Linux 6.1+)."""
    arena = SharedArena(4 * MB, huge=True)
    try:
        arena.buffer[:] = 1
        return _segment_stats(arena.name)["ShmemPmdMapped"] > 0
    finally:
        arena.close()


needs_collapse = pytest.mark.skipif(not _collapse_supported(), reason="the kernel cannot collapse shared memory")

ATTACH = """
import sys
import numpy as np
from gear_mpi.storage import SharedArena
from test_shared_pages import _segment_stats
a = SharedArena.attach(sys.argv[1])
want = np.arange(a.nbytes // 8, dtype=np.int64)
assert np.array_equal(a.buffer.view(np.int64), want), "the attacher reads other bytes"
assert a.buffer.ctypes.data % (2 << 20) == 0, "the attacher's mapping is not 2 MB-aligned"
print(_segment_stats(sys.argv[1])["ShmemPmdMapped"])
a.buffer.view(np.int64)[0] = -5
a.close()
"""


def test_a_segment_is_mapped_aligned_and_keeps_its_bytes():
    arena = SharedArena(6 * MB + 4096)  # (not huge: a staging segment; aligned all the same)
    try:
        assert isinstance(arena._mmap, shared_pages.AlignedMapping)
        assert arena.buffer.ctypes.data % HUGE_PAGE == 0
        assert arena.buffer.nbytes == 6 * MB + 4096 and arena.buffer.flags.writeable
        assert not arena.buffer.any()  # zero-filled, as a plain segment
        assert arena._collapser is None and _segment_stats(arena.name)["ShmemPmdMapped"] == 0  # not collapsed
        arena.buffer[-1] = 9  # the last byte, past the last whole huge page, is writable too
        assert arena.buffer[-1] == 9
    finally:
        arena.close()


@needs_collapse
def test_the_creator_collapses_and_a_peer_maps_the_huge_pages():
    arena = SharedArena(8 * MB, huge=True)
    try:
        arena.buffer.view(np.int64)[:] = np.arange(arena.nbytes // 8)
        stats = _segment_stats(arena.name)
        assert stats["ShmemPmdMapped"] == 8 * 1024, stats  # every byte through 2 MB entries
        here = os.path.dirname(__file__)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
        done = subprocess.run([sys.executable, "-c", ATTACH, arena.name], env=env, capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert int(done.stdout.split()[-1]) == 8 * 1024  # the peer's mapping is huge too
        assert arena.buffer.view(np.int64)[0] == -5  # and it is the same memory
    finally:
        arena.close()


@needs_collapse
def test_beyond_the_first_bytes_a_thread_collapses_the_rest():
    fd = os.open(f"/dev/shm/gear_mpi_test_{os.getpid()}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(f"/dev/shm/gear_mpi_test_{os.getpid()}")
    try:
        os.ftruncate(fd, 10 * MB)
        os.posix_fallocate(fd, 0, 10 * MB)
        mapping = shared_pages.map_shared(fd, 10 * MB, huge=True)
    finally:
        os.close(fd)
    view = np.asarray(mapping)
    view[::4096] = 3  # pages written before the collapse keep their bytes
    thread = shared_pages.collapse(mapping, now_bytes=2 * MB)
    assert thread is not None and thread.ranges == [(mapping.address, mapping.address + 10 * MB)]
    assert thread.collapsed + thread.failed >= 2 * MB  # the first 2 MB before it returned
    thread.thread.join(timeout=60)
    assert thread.done() and thread.collapsed + thread.failed == 10 * MB
    assert (view[::4096] == 3).all() and not view[1::4096].any()


def test_views_keep_the_memory_mapped_after_close():
    arena = SharedArena(4 * MB)
    name = arena.name
    view = arena.buffer[MB:MB + 16]
    view[:] = 7
    arena.close()
    assert not os.path.exists(os.path.join("/dev/shm", name))  # the creator unlinked the name
    assert (view == 7).all() and _segment_stats(name)["mappings"] == 1  # still mapped for the view
    del view
    assert _segment_stats(name)["mappings"] == 0  # the last view took the mapping with it


def test_without_huge_pages_the_mapping_is_plain(tmp_path):
    path = tmp_path / "seg"
    path.write_bytes(bytes(4 * MB))
    with open(path, "r+b") as f:
        plain = shared_pages.map_shared(f.fileno(), 4 * MB, huge=False)
        small = shared_pages.map_shared(f.fileno(), 4096, huge=True)  # under one huge page: plain as well
    assert isinstance(plain, mmap.mmap) and isinstance(small, mmap.mmap)
    assert shared_pages.collapse(plain) is None  # an unaligned mapping is left as it is
    plain.close()
    small.close()
