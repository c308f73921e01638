#!/usr/bin/env python
"""Cold reads of sampled windows from a file, by several read paths (issue 13 item 5b).

    python -m scripts.bench.bench_cold_reads --size-gb 4             # a 4 GB file under /var/tmp
    python -m scripts.bench.bench_cold_reads --size-gb 29 --reps 21  # larger than RAM (disk space!)

Manual, not CI. The file holds columns laid out as a file-backed gear_mpi shard lays them out
(one ring per column, each starting on a page): a wide column of 28,224 B a step (an 84x84x4
image) and three narrow ones (8, 4 and 1 B a step). A call reads ``--batch`` random windows of
``--window`` steps of every column into a batch buffer, after the file is dropped from the page
cache (MADV_DONTNEED on the mapping, then POSIX_FADV_DONTNEED); the methods take turns call by
call, each call with new random windows, so they see the same disk at the same minutes:

  willneed        MADV_WILLNEED of each window of each column (column by column, the library's
                  ``Store.prefetch``), then a copy out of the mapping (MADV_RANDOM)
  direct+copy     O_DIRECT ``preadv`` of each window's pages (every column) from ``--depth``
                  threads into one page-aligned buffer, then the copy into the batch
  direct-overlap  O_DIRECT of each wide window from ``--depth`` threads, each copying its window
                  into the batch as soon as it is read; the narrow columns as ``willneed``
  direct-floor    O_DIRECT of each wide window from ``--depth`` threads, no copy: the disk alone
                  for the wide column's bytes, the least any read path could take
  buffered        buffered ``preadv`` (through the page cache) from ``--depth`` threads, then the copy

Prints the median (quartiles) ms per call and the bytes /proc/self/io says each call read.
Where the file system refuses O_DIRECT (tmpfs), the O_DIRECT methods are left out, with a note.
The file is removed at the end unless ``--keep``.
"""
from __future__ import annotations

import argparse
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from scripts.peers._offline import IMAGE, read_bytes

WIDE = int(np.prod(IMAGE["obs"][0]))  # an image step's observation: 28,224 B
NARROW = tuple(np.dtype(d).itemsize for name, (_, d) in IMAGE.items() if name != "obs")  # 8, 4, 1 B
PAGE = mmap.PAGESIZE


class ColdReads:
    def __init__(self, path: str, size: int, batch: int, window: int, depth: int):
        self.widths = (WIDE,) + NARROW
        self.cap = size // sum(self.widths)
        self.base = [0]
        for w in self.widths:
            self.base.append(self.base[-1] + -(-self.cap * w // PAGE) * PAGE)
        total = self.base[-1]
        if not os.path.exists(path) or os.path.getsize(path) != total:
            chunk = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
            with open(path, "wb") as f:
                left = total
                while left > 0:
                    n = min(left, len(chunk))
                    f.write(chunk[:n])
                    left -= n
                f.flush()
                os.fsync(f.fileno())
        self.fd = os.open(path, os.O_RDONLY)
        try:
            self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        except OSError as e:  # tmpfs and some other file systems refuse O_DIRECT
            self.dfd, self.refused = None, f"{e.strerror or e}"
        self.mm = mmap.mmap(self.fd, total, mmap.MAP_SHARED, mmap.PROT_READ)
        self.mm.madvise(mmap.MADV_RANDOM)
        self.buf = np.frombuffer(self.mm, np.uint8)
        self.batch, self.window = batch, window
        self.out = np.zeros(batch * window * sum(self.widths), np.uint8)
        big = batch * len(self.widths) * 2 * PAGE + batch * window * sum(self.widths)
        self.bounce = np.frombuffer(mmap.mmap(-1, big), np.uint8)
        self.bounce[:] = 0  # committed before timing
        self.pool = ThreadPoolExecutor(depth)
        self.local = threading.local()

    def drop(self) -> None:
        self.mm.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def ranges(self, rng) -> list:
        """(column, file lo, file hi, batch offset) of each window, column by column."""
        starts = rng.integers(0, self.cap - self.window + 1, self.batch).tolist()
        out, pos = [], 0
        for c, w in enumerate(self.widths):
            for s in starts:
                lo = self.base[c] + s * w
                out.append((c, lo, lo + self.window * w, pos))
                pos += self.window * w
        return out

    def _thread_buffer(self) -> np.ndarray:
        b = getattr(self.local, "b", None)
        if b is None:
            b = self.local.b = np.frombuffer(mmap.mmap(-1, self.window * WIDE + 2 * PAGE), np.uint8)
            b[:] = 0
        return b

    def willneed(self, rr) -> None:
        for _, lo, hi, _ in rr:
            a = lo - lo % PAGE
            self.mm.madvise(mmap.MADV_WILLNEED, a, hi - a)
        for _, lo, hi, o in rr:
            self.out[o:o + hi - lo] = self.buf[lo:hi]

    def _plan(self, rr) -> list:
        plan, pos = [], 0
        for _, lo, hi, o in rr:
            a, b = lo - lo % PAGE, -(-hi // PAGE) * PAGE
            plan.append((a, b, pos, lo, hi, o))
            pos += b - a
        return plan

    def _direct_into_bounce(self, item) -> int:
        a, b, pos = item[:3]
        return os.preadv(self.dfd, [memoryview(self.bounce)[pos:pos + b - a]], a)

    def _buffered_into_bounce(self, item) -> int:
        a, b, pos = item[:3]
        return os.preadv(self.fd, [memoryview(self.bounce)[pos:pos + b - a]], a)

    def _copy_from_bounce(self, plan) -> None:
        for a, _, pos, lo, hi, o in plan:
            self.out[o:o + hi - lo] = self.bounce[pos + lo - a:pos + hi - a]

    def direct_copy(self, rr) -> None:
        plan = self._plan(rr)
        list(self.pool.map(self._direct_into_bounce, plan))
        self._copy_from_bounce(plan)

    def buffered(self, rr) -> None:
        plan = self._plan(rr)
        list(self.pool.map(self._buffered_into_bounce, plan))
        self._copy_from_bounce(plan)

    def _direct_and_copy(self, r) -> None:
        _, lo, hi, o = r
        a, b = lo - lo % PAGE, -(-hi // PAGE) * PAGE
        tb = self._thread_buffer()
        os.preadv(self.dfd, [memoryview(tb)[:b - a]], a)
        self.out[o:o + hi - lo] = tb[lo - a:hi - a]

    def direct_overlap(self, rr) -> None:
        narrow = [r for r in rr if r[0] > 0]
        for _, lo, hi, _ in narrow:
            a = lo - lo % PAGE
            self.mm.madvise(mmap.MADV_WILLNEED, a, hi - a)
        list(self.pool.map(self._direct_and_copy, [r for r in rr if r[0] == 0]))
        for _, lo, hi, o in narrow:
            self.out[o:o + hi - lo] = self.buf[lo:hi]

    def direct_floor(self, rr) -> None:
        list(self.pool.map(self._direct_into_bounce, self._plan([r for r in rr if r[0] == 0])))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=4.0, help="file size in GB (default 4)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--depth", type=int, default=16, help="reader threads of the pool methods (default 16)")
    ap.add_argument("--reps", type=int, default=11, help="calls per method (default 11)")
    ap.add_argument("--methods", default="willneed,direct+copy,direct-overlap,direct-floor,buffered")
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--keep", action="store_true", help="keep the file (reused by the next run of the same size)")
    args = ap.parse_args()
    path = os.path.join(args.dir, f"gear_cold_reads_{args.size_gb:g}.bin")
    r = ColdReads(path, int(args.size_gb * 1e9), args.batch, args.window, args.depth)
    try:
        fns = {"willneed": r.willneed, "direct+copy": r.direct_copy, "direct-overlap": r.direct_overlap,
               "direct-floor": r.direct_floor, "buffered": r.buffered}
        names = args.methods.split(",")
        if r.dfd is None:
            print(f"# O_DIRECT refused under {args.dir} ({r.refused}): its methods are left out")
            names = [n for n in names if not n.startswith("direct")]
        rng = np.random.default_rng(1)
        ms = {n: [] for n in names}
        disk = {n: [] for n in names}
        for _ in range(args.reps):
            for n in names:
                rr = r.ranges(rng)
                r.drop()
                d0 = read_bytes()
                t0 = time.perf_counter()
                fns[n](rr)
                ms[n].append(1e3 * (time.perf_counter() - t0))
                disk[n].append(read_bytes() - d0)
                if n != "direct-floor":  # the batch holds exactly the file's bytes
                    for _, lo, hi, o in rr[::17]:
                        assert np.array_equal(r.out[o:o + hi - lo], r.buf[lo:hi]), n
        wide = args.batch * args.window * WIDE
        print(f"# {r.base[-1] / 1e9:.1f} GB file, {args.batch} windows x {args.window} steps "
              f"({args.batch * args.window * sum(r.widths) / 1e6:.1f} MB a call), {args.reps} calls each, "
              f"pool depth {args.depth}")
        for n in names:
            a = np.array(ms[n])
            print(f"{n:>15} {np.median(a):7.1f} ms ({np.percentile(a, 25):.1f}-{np.percentile(a, 75):.1f})  "
                  f"{wide / np.median(a) / 1e6:5.2f} GB/s of the wide column  "
                  f"{np.median(disk[n]) / 1e6:5.1f} MB read a call")
    finally:
        if not args.keep:
            os.unlink(path)


if __name__ == "__main__":
    main()
