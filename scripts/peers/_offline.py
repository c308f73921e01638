"""What scripts/bench/bench_mmap.py and its TorchRL worker share (stdlib + numpy only: it runs in both venvs).

- :func:`image_trajectory`: the offline data set, the same bytes in every process: trajectory ``i``
  of ``T`` image steps (obs uint8[84, 84, 4], action int64, reward float32, done bool; 28,237 bytes
  a step). ``obs`` is one random block XOR ``i``, so making it costs a pass over memory, not an RNG.
- :func:`evict`: push a file-backed mapping's pages out of the page cache (msync, then
  ``MADV_PAGEOUT``), so that the next reads come from the disk ("cold").
- :func:`resident`: how many bytes of a mapping are in RAM (``/proc/self/smaps``), to show that
  an eviction worked.
- :func:`read_bytes`: how many bytes this process has had read from the disk (``/proc/self/io``),
  to show what a cold sample cost in I/O (the bytes it needed, or the read-ahead around them).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

IMAGE = {"obs": ((84, 84, 4), "uint8"), "action": ((), "int64"), "reward": ((), "float32"), "done": ((), "bool")}
MS_SYNC = 4
MADV_PAGEOUT = 21
_BASE: dict[int, np.ndarray] = {}


def image_step_bytes() -> int:
    return int(sum(np.prod(s, dtype=np.int64) * np.dtype(d).itemsize for s, d in IMAGE.values()))


def image_trajectory(i: int, T: int) -> dict[str, np.ndarray]:
    """Trajectory ``i`` of ``T`` steps (numpy arrays with a leading ``T``); the same in every process."""
    if T not in _BASE:
        _BASE[T] = np.random.default_rng(12345).integers(0, 256, (T, 84, 84, 4), dtype=np.uint8)
    t = np.arange(T, dtype=np.int64)
    done = np.zeros(T, np.bool_)
    done[-1] = True
    return {"obs": _BASE[T] ^ np.uint8(i & 255), "action": t + i * T,
            "reward": ((t + i * T) % 97).astype(np.float32), "done": done}


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    for fn in (libc.msync, libc.madvise):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
    return libc


def evict(address: int, nbytes: int) -> None:
    """Write back and drop the pages of ``[address, address + nbytes)`` (a shared file mapping)
    from RAM. Raises OSError if the kernel refuses."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = address - address % page
    n = nbytes + (address - lo)
    libc = _libc()
    for fn, arg in ((libc.msync, MS_SYNC), (libc.madvise, MADV_PAGEOUT)):
        if fn(lo, n, arg) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{fn.__name__}: {os.strerror(e)}")


def resident(address: int, nbytes: int) -> int:
    """Bytes of ``[address, address + nbytes)`` resident in RAM, from /proc/self/smaps (whole mappings
    that overlap the range are counted)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < address + nbytes and address < hi
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def read_bytes() -> int:
    """Bytes this process has caused to be read from storage so far (``read_bytes`` of /proc/self/io,
    read-ahead it started included); -1 where that file cannot be read."""
    try:
        with open("/proc/self/io") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return -1
