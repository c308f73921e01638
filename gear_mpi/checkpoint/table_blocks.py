"""An incremental checkpoint's table: each section cut into ``table-<section>-NNNNN.bin`` blocks.

A background checkpoint (:mod:`~gear_mpi.checkpoint.background`, format version 5) does not write the
table (:meth:`Shard.sections <gear_mpi.shard.Shard.sections>`: the rows in use, the order ring, the
free-slot stack, the priority index) as one ``table.bin``: each section -- consecutive sections of one
name, the order ring's two halves, count as one -- is cut into blocks of :data:`BLOCK` bytes (the last
one shorter), each a file of its own, listed in the manifest with its size and sha256. Its layout is
``shard.json``'s ``"table_layout"`` (name, dtype, count per section, as in ``table.bin``) and
``"table_block"`` (the block size).

A block whose bytes are those of the same block of the rank's previous checkpoint (its *base*) is a
hard link to the base's file, as an unchanged ring segment is (:mod:`~gear_mpi.checkpoint.segment_file`).
Which blocks changed is found by comparing the table's copy with the base's copy, kept in memory
(:class:`Copies`: two buffers used in turn), in one vectorised comparison per section: no hashing of
the blocks that did not change. Rows are written in place by inserts, evictions, priority updates and
samples, so a replay that grew by 1 % rewrites about 1 % of its table plus the last block of each
section (the sections grow at their end); a section that every sample changes all over (``priority``
under priority updates, ``times_sampled`` when uses are counted) is rewritten whole, as before; the
order ring is saved oldest first, so once the ring is full and evicts, it shifts and is rewritten whole
(4 bytes per item).
"""
from __future__ import annotations

import errno
import mmap
import os
import shutil
from typing import Iterator

import numpy as np

from ..errors import CheckpointError
from . import files
from .files import CheckedFile
from .pacing import Pacer

BLOCK = 256 << 10  # bytes per block file: a multiple of any O_DIRECT alignment
PREFIX = "table-"
ALIGN = 4096       # each section's copy starts at a page: its blocks are written in place (O_DIRECT)


def is_table_file(name: str) -> bool:
    """Whether file ``name`` of a rank's directory holds table bytes (``table.bin`` or a block). O(1)."""
    return name == files.TABLE or (name.startswith(PREFIX) and name.endswith(".bin"))


def groups(layout: list) -> list[tuple[str, np.dtype, int]]:
    """``(file stem, dtype, count)`` per section of a ``table_layout`` (a name seen again gets ``.N``). O(sections)."""
    seen: dict[str, int] = {}
    out = []
    for name, dtype, count in layout:
        n = seen.get(name, 0)
        seen[name] = n + 1
        out.append((name if n == 0 else f"{name}.{n}", np.dtype(dtype), int(count)))
    return out


def block_name(stem: str, i: int) -> str:
    """The file name of block ``i`` of section ``stem`` (``table-start-00000.bin``). O(1)."""
    return f"{PREFIX}{stem}-{i:05d}.bin"


def blocks_of(nbytes: int, block: int = BLOCK) -> int:
    """How many blocks ``nbytes`` of a section take (0 for an empty section). O(1)."""
    return -(-int(nbytes) // int(block))


class Copies:
    """The table's copy at each snapshot, in two page-aligned buffers used in turn: the one the previous
    snapshot filled stays intact until the next snapshot's blocks are compared with it (:func:`write`).

    Memory: twice the table (about 70 bytes per slot in use, twice), touched once and reused (no page
    faults in the loop after the first two checkpoints).
    """

    def __init__(self):
        self._bufs: list[np.ndarray | None] = [None, None]
        self._turn = 0

    def copy(self, sections: list, keep=()) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """Copy ``sections`` (``(name, array)`` pairs) into a buffer that holds none of ``keep`` (the base's
        copies, compared with later). O(bytes); the training thread.

        Returns:
            ``(arrays, flats)``: a copy per section (same dtype and shape), and per group of consecutive
            sections of one name a flat uint8 view of its bytes (each group contiguous, page-aligned).
        """
        spans, total, prev = [], 0, None
        for name, arr in sections:
            if name != prev:
                total = -(-total // ALIGN) * ALIGN
                spans.append([total, total])
            spans[-1][1] += int(arr.nbytes)
            total += int(arr.nbytes)
            prev = name
        held = [b is not None and any(np.may_share_memory(b, k) for k in keep) for b in self._bufs]
        self._turn = (self._turn ^ 1) if not held[self._turn ^ 1] else self._turn
        if held[self._turn]:  # both hold the base's (cannot happen: one copy a snapshot): a fresh one
            self._bufs[self._turn] = None
        buf = self._bufs[self._turn]
        if buf is None or buf.nbytes < total:
            size = max(total + total // 4 + ALIGN, ALIGN)
            buf = np.frombuffer(mmap.mmap(-1, size), np.uint8)  # page-aligned
            self._bufs[self._turn] = buf
        arrays, pos, prev = [], 0, None
        for name, arr in sections:
            if name != prev:
                pos = -(-pos // ALIGN) * ALIGN
            dst = buf[pos:pos + int(arr.nbytes)].view(arr.dtype).reshape(arr.shape)
            np.copyto(dst, arr)
            arrays.append(dst)
            pos += int(arr.nbytes)
            prev = name
        return arrays, [buf[a:b] for a, b in spans]

    def drop(self) -> None:
        """Free both buffers (the handle is detached). Idempotent."""
        self._bufs = [None, None]


def changed_blocks(new: np.ndarray, old: np.ndarray | None, block: int = BLOCK) -> np.ndarray:
    """Which blocks of a section's bytes ``new`` differ from ``old`` (the base's copy), as a bool array.

    A block past ``old``'s end, or the last block when the lengths differ, counts as changed. O(bytes),
    a few vectorised calls (the GIL free for most of it).
    """
    nb = blocks_of(len(new), block)
    out = np.ones(nb, bool)
    if old is None or not nb:
        return out
    common = min(len(new), len(old)) // block  # whole blocks in both
    if common:
        word = 8 if block % 8 == 0 else 1
        a = new[:common * block].view(np.uint64 if word == 8 else np.uint8).reshape(common, block // word)
        b = old[:common * block].view(np.uint64 if word == 8 else np.uint8).reshape(common, block // word)
        out[:common] = (a != b).any(axis=1)
    if len(new) == len(old) and nb > common:  # the same short last block in both
        out[common] = not np.array_equal(new[common * block:], old[common * block:])
    return out


def link(src: str, dst: str) -> bool:
    """Hard-link ``src`` as ``dst``; False where the file system has no hard links (the caller copies). O(1).

    Raises:
        OSError: another failure (``src`` missing, ``dst`` existing, no space, ...).
    """
    try:
        os.link(src, dst)
        return True
    except OSError as e:
        if e.errno in (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            return False
        raise


def plan(directory: str, stems: list[str], flats: list[np.ndarray], base: tuple[str, dict, dict] | None,
         block: int = BLOCK) -> tuple[dict[str, dict], list[tuple[str, np.ndarray]], list[tuple[str, str]], int]:
    """Link the blocks that did not change since the base into ``directory``; list those to write.

    Run by the training thread at the snapshot (a comparison and a link per block: about 10 ms for 85 MB of
    table), so that the writer thread only writes -- the fewer calls it makes, the fewer times a thread of
    low priority takes the GIL back.

    Args:
        directory: the rank's directory of the checkpoint; stems: :func:`groups`'s stem per section;
        flats: each section's bytes (:meth:`Copies.copy`); base: ``(directory, entries, flats)`` of the
            rank's previous checkpoint -- its directory, its table files' manifest entries, and the copy
            its blocks were written from -- or None (every block is to be written).
    Returns:
        ``(entries, pending, copies, linked)``: the manifest entries of the blocks linked; the blocks to
        write (file name, bytes); the unchanged blocks to copy instead, where hard links are refused
        (source, file name); the bytes linked.
    Raises:
        OSError: a link failed otherwise.
    """
    entries: dict[str, dict] = {}
    pending: list[tuple[str, np.ndarray]] = []
    copies: list[tuple[str, str]] = []
    linked = 0
    for stem, flat in zip(stems, flats):
        old = None if base is None else base[2].get(stem)
        changed = changed_blocks(flat, old, block)
        for i, dirty in enumerate(changed.tolist()):
            name = block_name(stem, i)
            part = flat[i * block:(i + 1) * block]
            entry = None if base is None else base[1].get(name)
            if dirty or entry is None or int(entry["bytes"]) != len(part):
                pending.append((name, part))
                continue
            src = os.path.join(base[0], name)
            if not link(src, os.path.join(directory, name)):
                copies.append((src, name))
            entries[name] = dict(entry)
            linked += len(part)
    return entries, pending, copies, linked


def write_pending(directory: str, pending: list[tuple[str, np.ndarray]], copies: list[tuple[str, str]],
                  pacer: Pacer) -> tuple[dict[str, dict], int]:
    """Write :func:`plan`'s pending blocks (hashed, ``O_DIRECT``, fsynced) and copies. Any thread.

    Returns:
        ``(entries, written)``: their manifest entries and the bytes written.
    Raises:
        OSError: the file system refused.
    """
    entries: dict[str, dict] = {}
    written = 0
    for name, part in pending:
        entries[name] = files.write_file_direct(os.path.join(directory, name), pacer.chunks([part]))
        written += len(part)
    for src, name in copies:
        shutil.copyfile(src, os.path.join(directory, name))
    return entries, written


def write(directory: str, stems: list[str], flats: list[np.ndarray], base: tuple[str, dict, dict] | None,
          pacer: Pacer, block: int = BLOCK) -> tuple[dict[str, dict], int, int]:
    """:func:`plan` then :func:`write_pending`, in one thread.

    Returns:
        ``(entries, written, linked)``: the manifest entry of every block, and the bytes written and linked.
    Raises:
        OSError: the file system refused.
    """
    entries, pending, copies, linked = plan(directory, stems, flats, base, block)
    more, written = write_pending(directory, pending, copies, pacer)
    entries.update(more)
    return entries, written, linked


def read(directory: str, entries: dict, layout: list, block: int, verify: bool = True) -> dict[str, np.ndarray]:
    """Read a rank's table from its blocks (the inverse of :func:`write`). Local.

    Args:
        directory: the rank's directory; entries: its files' manifest entries; layout: ``shard.json``'s
        ``"table_layout"``; block: its ``"table_block"``; verify: compare each block's sha256.
    Returns:
        A new array per section name.
    Raises:
        CheckpointError: a block missing, not listed, of the wrong size, or (``verify``) corrupted.
    Cost: one read of each block file.
    """
    out = {}
    for (name, _, _), (stem, dtype, count) in zip(layout, groups(layout)):
        dst = np.empty(count, dtype)
        flat = dst.view(np.uint8).reshape(-1)
        for i in range(blocks_of(len(flat), block)):
            fn = os.path.join(directory, block_name(stem, i))
            part = flat[i * block:(i + 1) * block]
            with CheckedFile(fn, entries.get(block_name(stem, i))) as chk:
                if chk.size != len(part):
                    raise CheckpointError(f"{fn}: {chk.size} bytes, but section {name!r} needs {len(part)} there")
                chk.read_into(part)
                if verify:
                    chk.finish()
        out[name] = dst
    return out


def names(layout: list, block: int) -> Iterator[str]:
    """The block files a ``table_layout`` needs, in order. O(blocks)."""
    for stem, dtype, count in groups(layout):
        for i in range(blocks_of(count * dtype.itemsize, block)):
            yield block_name(stem, i)
