"""The checkpoint's files: format constants, checksummed writing and reading, the manifest.

Every file of a checkpoint is written by :func:`write_file` (streamed, hashed
while written, fsynced, never overwriting) and read back through
:class:`CheckedFile` (size checked before reading, sha256 at the end); both count
the bytes they move with :func:`gear_mpi.progress.advance` (the progress bar and
the heartbeats of :mod:`~gear_mpi.checkpoint.arrival`). The
manifest is the one file that describes all others; :func:`read_manifest`
checks it and :func:`resolve` applies the crash-recovery rule to find it.

:func:`write_file` and :func:`rename` are the only ways the protocol touches
the file system to create or install a checkpoint, and it calls them through
this module, so that tests can wrap them to kill a save midway. Background
checkpoints write their ring segments with :func:`write_file_direct` (the same
file, bypassing the page cache where the file system allows).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import mmap
import os
import zlib
from typing import Any, Iterable, Iterator

import numpy as np

from .. import progress
from ..errors import CheckpointError

FORMAT = "gear_mpi-checkpoint"
FORMAT_VERSION = 3  # 2: the priority index has line sums (l0_sum); 3: one columns.bin laid out as the arena
SEGMENTED_VERSION = 4  # background (incremental) checkpoints: seg-NNNNN.bin files (checkpoint.segment_file)
BLOCKED_VERSION = 5  # and the table in table-<section>-NNNNN.bin blocks (checkpoint.table_blocks)
PARTED_VERSION = 6  # and a ring segment may be stored in parts (segment_file: "segment_parts")
READABLE_VERSIONS = (2, 3, 4, 5, 6)  # what load reads (version 2: a column-NNN.bin per column, oldest step first)
MANIFEST = "MANIFEST.json"
SHARD_JSON = "shard.json"
TABLE = "table.bin"
CHUNK_BYTES = 16 << 20


def path_digest(path: str) -> int:
    """A CRC-32 of ``path`` (its bytes as the file system takes them), for the ranks of a collective to check in
    its head that they were given the same one (after ``os.path.abspath``). Local, O(len(path))."""
    return zlib.crc32(path.encode("utf-8", "surrogateescape"))


def rank_dir(rank: int) -> str:
    """The directory name of rank ``rank``'s files inside a checkpoint (``rank-00000``). O(1).

    Args:
        rank: the rank of the replay that wrote them.
    Returns:
        The name, relative to the checkpoint directory.
    """
    return f"rank-{rank:05d}"


def column_file(index: int) -> str:
    """The file name of column ``index`` inside a rank's directory (``column-000.bin``). O(1).

    Args:
        index: the column's position in the spec's column order.
    Returns:
        The name, relative to the rank's directory.
    """
    return f"column-{index:03d}.bin"


# ---- writing -------------------------------------------------------------------------------------
def write_file(filename: str, chunks: Iterable) -> dict[str, Any]:
    """Write ``chunks`` to a new file, fsync it, and describe it for the manifest.

    Every file of a checkpoint goes through here (tests wrap it to crash a save midway).

    Args:
        filename: the file to create; it must not exist.
        chunks: bytes-like objects (numpy arrays included), written in order; or ``(offset, data)``
            pairs, written at ``offset`` (what lies between stays a hole: sparse where the file
            system allows). An empty ``data`` at an offset past the end makes the file that long.
            The sha256 is over the chunks' bytes in the order given.
    Returns:
        ``{"bytes": file size, "sha256": hex digest}``, plus ``"data"``: the bytes hashed, when
        any chunk had an offset.
    Raises:
        FileExistsError: ``filename`` exists (a checkpoint file is never overwritten).
        OSError: the file system refused.
    """
    digest = hashlib.sha256()
    data, placed = 0, False
    with open(filename, "xb") as f:
        for chunk in chunks:
            if isinstance(chunk, tuple):
                offset, chunk = chunk
                placed = True
                f.seek(int(offset))
            mv = memoryview(chunk).cast("B")
            if len(mv):
                digest.update(mv)
                f.write(mv)
                data += len(mv)
                progress.advance(len(mv))
            elif placed and f.tell() > os.fstat(f.fileno()).st_size:
                f.truncate(f.tell())
        f.flush()
        os.fsync(f.fileno())
        size = os.fstat(f.fileno()).st_size
    out = {"bytes": size, "sha256": digest.hexdigest()}
    if placed:
        out["data"] = data
    return out


DIRECT_BLOCK = 8 << 20  # write_file_direct's bounce buffer: page-aligned, a multiple of any O_DIRECT block
DIRECT_ALIGN = 4096     # a chunk at an address and of a length that are multiples of this is written in place


def _address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, np.uint8).__array_interface__["data"][0])


def write_file_direct(filename: str, chunks: Iterable, sha256: str | None = None) -> dict[str, Any]:
    """:func:`write_file` for plain ``chunks`` (no offsets), bypassing the page cache where it can.

    The file is opened with ``O_DIRECT``. A chunk whose address and length are multiples of
    :data:`DIRECT_ALIGN` (a ring segment of page-sized steps, a page-aligned copy) is written from where
    it lies, in one call; others are copied into a page-aligned buffer of :data:`DIRECT_BLOCK` bytes
    first. The kernel moves the data straight to the device, without copying it into the page cache and
    writing it back later -- about a tenth of the CPU time of a buffered write on the machine measured
    (docs/guide/faults.md), work that otherwise competes with the training loop. Each chunk is hashed in
    one call and written in one or a few: the calling thread gives up the GIL for the whole of each (a
    thread of low priority that takes the GIL back often can hold up the training thread, which waits
    for it). A tail shorter than the alignment is written after ``O_DIRECT`` is turned off (``fcntl``).
    Where the system or the file system refuses ``O_DIRECT`` (not Linux, tmpfs before Linux 6.6, a
    write with other alignment needs), the same bytes are written through the page cache instead. The
    result is the same file, fsynced, and the same description as :func:`write_file`'s.

    Args:
        filename: the file to create; it must not exist.
        chunks: bytes-like objects (numpy arrays included), written in order.
        sha256: the chunks' digest when the caller has it already (not computed again), else None.
    Returns:
        ``{"bytes": file size, "sha256": hex digest}``.
    Raises:
        FileExistsError: ``filename`` exists.
        OSError: the file system refused.
    """
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        out = write_file(filename, chunks)
        return out if sha256 is None else dict(out, sha256=sha256)
    try:
        fd = os.open(filename, os.O_WRONLY | os.O_CREAT | os.O_EXCL | flag, 0o644)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
        if os.path.lexists(filename):  # created before the flag was refused (O_EXCL: ours)
            os.unlink(filename)
        out = write_file(filename, chunks)
        return out if sha256 is None else dict(out, sha256=sha256)
    digest, size, fill = (hashlib.sha256() if sha256 is None else None), 0, 0
    bounce: mmap.mmap | None = None
    buf = None
    direct = True

    def buffered() -> None:
        nonlocal direct
        if direct:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~flag)
            direct = False

    def put(view: memoryview) -> None:
        """Write all of ``view`` (aligned, or the tail); a refusal of O_DIRECT falls back to the page cache."""
        done = 0
        if direct and len(view) % DIRECT_ALIGN:  # the tail: through the page cache
            buffered()
        while done < len(view):
            with view[done:] as rest:
                try:
                    done += os.write(fd, rest)
                except OSError as e:
                    if not direct or e.errno != errno.EINVAL:
                        raise
                    buffered()

    def flush(n: int) -> None:
        with memoryview(bounce) as whole, whole[:n] as view:
            put(view)

    try:
        for chunk in chunks:
            mv = memoryview(chunk).cast("B")
            if not len(mv):
                continue
            if digest is not None:
                digest.update(mv)  # one call: the GIL is free for all of it
            if direct and not fill and len(mv) >= DIRECT_ALIGN and _address(mv) % DIRECT_ALIGN == 0:
                whole = len(mv) - len(mv) % DIRECT_ALIGN
                with mv[:whole] as view:
                    put(view)  # in place: no copy
                rest = mv[whole:]
            else:
                rest = mv
            if len(rest):
                if bounce is None:
                    bounce = mmap.mmap(-1, DIRECT_BLOCK)
                    buf = np.frombuffer(bounce, np.uint8)
                src = np.frombuffer(rest, np.uint8)
                pos = 0
                while pos < len(src):
                    n = min(DIRECT_BLOCK - fill, len(src) - pos)
                    buf[fill:fill + n] = src[pos:pos + n]
                    fill, pos = fill + n, pos + n
                    if fill == DIRECT_BLOCK:
                        flush(fill)
                        fill = 0
                del src
            size += len(mv)
            progress.advance(len(mv))
        if fill:
            flush(fill)
        os.fsync(fd)
    finally:
        del buf
        if bounce is not None:
            bounce.close()
        os.close(fd)
    return {"bytes": size, "sha256": digest.hexdigest() if digest is not None else sha256}


def rename(src: str, dst: str) -> None:
    """One step of installing a checkpoint: one ``rename(2)`` (tests wrap it to crash between the two).

    Args:
        src: the directory to move.
        dst: its new name (must not exist).
    Raises:
        OSError: the rename failed.
    """
    os.rename(src, dst)


def fsync_dir(path: str) -> None:
    """Make the entries of directory ``path`` durable (best effort: ignored where unsupported). One fsync.

    Args:
        path: the directory.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def slices(buf: np.ndarray, lo: int = 0, hi: int | None = None, step: int = CHUNK_BYTES) -> Iterator[np.ndarray]:
    """``buf[lo:hi]`` as consecutive views of at most ``step`` elements (no copy). O(1) per view.

    Args:
        buf: a 1-D array.
        lo: the first element.
        hi: one past the last element (None: ``len(buf)``).
        step: the most elements per view.
    Returns:
        An iterator of views.
    """
    hi = len(buf) if hi is None else hi
    for a in range(lo, hi, step):
        yield buf[a:min(hi, a + step)]


def canonical(body: dict) -> bytes:
    """The bytes the manifest's checksum is taken over. O(size of ``body``).

    Args:
        body: the manifest body (JSON-able).
    Returns:
        ``body`` as sorted, compact JSON, UTF-8.
    """
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(directory: str, body: dict, version: int = FORMAT_VERSION,
                   filename: str = MANIFEST) -> dict[str, Any]:
    """Write ``MANIFEST.json`` (format, version, ``body``, the sha256 of its canonical form); one fsync.

    Args:
        directory: the checkpoint directory being assembled.
        body: JSON-able description of the checkpoint (see :mod:`gear_mpi.checkpoint.protocol`).
        version: the format version it declares (4 for a background checkpoint's segments).
        filename: the name to write (a temporary name, renamed to ``MANIFEST.json`` by the caller).
    Returns:
        The manifest file's size and sha256.
    Raises:
        OSError: the file system refused.
    """
    doc = {"format": FORMAT, "version": int(version), "sha256": hashlib.sha256(canonical(body)).hexdigest(),
           "body": body}
    return write_file(os.path.join(directory, filename), [json.dumps(doc, indent=1).encode()])


# ---- reading -------------------------------------------------------------------------------------
class CheckedFile:
    """One checkpoint file opened for reading: its size is checked at once (O(1)), its sha256 by :meth:`finish`.

    Args:
        filename: the file.
        entry: its ``{"bytes", "sha256"}`` from the manifest (None: not listed).
    Raises:
        CheckpointError: not listed, missing, or of another size than the manifest says.
    """

    def __init__(self, filename: str, entry: dict | None):
        self.filename = filename
        if entry is None:
            raise CheckpointError(f"{filename}: not listed in the manifest")
        if not os.path.isfile(filename):
            raise CheckpointError(f"{filename}: missing (the checkpoint is incomplete)")
        size = os.path.getsize(filename)
        if size != entry["bytes"]:
            raise CheckpointError(f"{filename}: {size} bytes, the manifest says {entry['bytes']} "
                                  f"(truncated or overwritten)")
        self.size = size
        self.expect = entry["sha256"]
        self.digest = hashlib.sha256()
        self.f = open(filename, "rb")

    def __enter__(self) -> "CheckedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_into(self, dst: np.ndarray) -> None:
        """Fill ``dst`` with the next bytes of the file, hashing them. O(dst.nbytes).

        Args:
            dst: a C-contiguous array.
        Raises:
            ValueError: ``dst`` is not contiguous.
            CheckpointError: the file ends first (truncated).
        """
        if not dst.flags.c_contiguous:
            raise ValueError("read_into needs a contiguous destination")
        mv = memoryview(dst).cast("B")
        got = self.f.readinto(mv)
        if got != len(mv):
            raise CheckpointError(f"{self.filename}: ended early (truncated)")
        self.digest.update(mv)
        progress.advance(len(mv))

    def read_at(self, offset: int, dst: np.ndarray, hashed: bool = True) -> None:
        """Fill ``dst`` with the file's bytes at ``offset``, hashing them (unless ``hashed`` is False).
        O(dst.nbytes).

        Args:
            offset: the file position.
            dst: a C-contiguous array.
            hashed: add the bytes to the running sha256 (compared by :meth:`finish`).
        Raises:
            CheckpointError: the file ends first (truncated).
        """
        self.f.seek(int(offset))
        if hashed:
            self.read_into(dst)
            return
        mv = memoryview(dst).cast("B")
        if self.f.readinto(mv) != len(mv):
            raise CheckpointError(f"{self.filename}: ended early (truncated)")
        progress.advance(len(mv))

    def read_bytes(self, n: int) -> bytes:
        """The next ``n`` bytes of the file, hashed. O(n).

        Args:
            n: how many.
        Returns:
            The bytes.
        Raises:
            CheckpointError: the file ends first (truncated).
        """
        data = self.f.read(n)
        if len(data) != n:
            raise CheckpointError(f"{self.filename}: ended early (truncated)")
        self.digest.update(data)
        progress.advance(n)
        return data

    def finish(self, rest: bool = True) -> None:
        """Hash what was not read (``rest``), close, and compare with the manifest. O(bytes left).

        Args:
            rest: hash the file from the current position to its end first (False: the checksum
                covers only what was read, as for a v3 ``columns.bin``).
        Raises:
            CheckpointError: the sha256 differs from the manifest's (corrupted).
        """
        while rest:
            data = self.f.read(CHUNK_BYTES)
            if not data:
                break
            self.digest.update(data)
            progress.advance(len(data))
        self.f.close()
        if self.digest.hexdigest() != self.expect:
            raise CheckpointError(f"{self.filename}: sha256 does not match the manifest (corrupted)")

    def close(self) -> None:
        """Close the file without checking it. Idempotent."""
        self.f.close()


def read_json(filename: str, entry: dict | None) -> dict:
    """Read and check a JSON file of the checkpoint. O(file size). Local.

    Args:
        filename: the file.
        entry: its ``{"bytes", "sha256"}`` from the manifest (None: not listed).
    Returns:
        The parsed JSON.
    Raises:
        CheckpointError: not listed, missing, of another size or checksum, or not valid JSON.
    """
    with CheckedFile(filename, entry) as c:
        data = c.read_bytes(entry["bytes"])
        c.finish()
    try:
        return json.loads(data)
    except ValueError:
        raise CheckpointError(f"{filename}: not valid JSON") from None


def resolve(path) -> str:
    """The directory a load reads for ``path``: ``path``, else ``path.old``.

    ``path.old`` alone is what a save that died between its two renames leaves
    (see :mod:`gear_mpi.checkpoint`). Local; O(1) file-system calls.

    Args:
        path: the checkpoint's path (str or os.PathLike).
    Returns:
        The directory to read.
    Raises:
        CheckpointError: neither exists, or ``path`` is not a directory.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        return path
    old = path + ".old"
    if not os.path.lexists(path) and os.path.isdir(old):
        return old
    if os.path.lexists(path):
        raise CheckpointError(f"{path}: not a directory, so not a gear_mpi checkpoint")
    raise CheckpointError(f"{path}: no checkpoint there (neither {path} nor {old} exists)")


def read_manifest(path) -> dict:
    """Parse and check ``MANIFEST.json`` of checkpoint directory ``path``.

    Checks the format name and version, the manifest's own checksum, and that the
    rank directories present are exactly those it lists. Local.

    Args:
        path: a checkpoint directory (as returned by :func:`resolve`).
    Returns:
        The manifest: ``format``, ``version``, ``sha256``, ``body``, plus ``path``.
    Raises:
        CheckpointError: missing, damaged, of another format or version, or not
            matching the rank directories; the message names the file.
    """
    filename = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.isfile(filename):
        raise CheckpointError(f"{filename}: missing (an interrupted save, or not a gear_mpi checkpoint)")
    try:
        with open(filename, "rb") as f:
            doc = json.loads(f.read())
    except ValueError:
        raise CheckpointError(f"{filename}: not valid JSON (truncated or corrupted)") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{filename}: not a gear_mpi checkpoint manifest")
    if doc.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{filename}: format version {doc.get('version')!r}; this gear_mpi reads "
                              f"versions {', '.join(map(str, READABLE_VERSIONS))}")
    body = doc.get("body")
    if not isinstance(body, dict) or hashlib.sha256(canonical(body)).hexdigest() != doc.get("sha256"):
        raise CheckpointError(f"{filename}: sha256 of the manifest body does not match (corrupted)")
    shards = body.get("shards")
    if not isinstance(shards, list) or len(shards) != body.get("ranks") or \
            [s.get("rank") for s in shards] != list(range(len(shards))):
        raise CheckpointError(f"{filename}: says ranks={body.get('ranks')!r} but lists "
                              f"{len(shards) if isinstance(shards, list) else 'no'} shards")
    for s in shards:
        d = os.path.join(os.fspath(path), rank_dir(s["rank"]))
        if not os.path.isdir(d):
            raise CheckpointError(f"{d}: missing, but the manifest lists rank {s['rank']} of {body['ranks']}")
    extra = sorted(n for n in os.listdir(path) if n.startswith("rank-") and
                   n not in {rank_dir(s["rank"]) for s in shards})
    if extra:
        raise CheckpointError(f"{os.path.join(os.fspath(path), extra[0])}: not listed in the manifest, which "
                              f"says ranks={body['ranks']} (files of another save mixed in?)")
    doc["path"] = os.fspath(path)
    return doc
