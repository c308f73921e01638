"""File-backed arenas: a shard's columns (and table) in memory-mapped files, so a shard may exceed RAM.

``memory="file", path=DIR`` keeps rank r's files under ``DIR/rank-NNNNN/`` (one directory
per rank, so ranks may share ``DIR`` on a parallel file system, or each name its own
node-local disk). The files are mapped ``MAP_SHARED``: the page cache holds what is hot
and writes back the rest, so a ring far larger than RAM works at the speed of the disk
for the cold part. Node peers map the same file by its name (as they map POSIX shared
memory) and copy windows straight out of it.

- :meth:`FileArena.create` -- a new file this process owns: the space is reserved up
  front (``posix_fallocate``), so a full disk fails here with a clear
  :class:`~gear_mpi.errors.StorageError` rather than with SIGBUS at a later write.
  The owner unlinks the file on :meth:`FileArena.unlink` (a replay does so once its
  node peers have mapped it: the space is freed when the last mapping goes, even
  after a crash) or on :meth:`FileArena.close`.
- :meth:`FileArena.attach` -- a node peer's file, mapped by name (never unlinked here).
- :meth:`FileArena.open_private` -- an existing file (a checkpoint's ``columns.bin``)
  mapped copy-on-write (``MAP_PRIVATE``, kind ``"mapped"``): reads come from the file
  through the page cache, writes stay in this process and never reach the file. Other
  processes' writes do reach the mapping, so the arena holds a
  :class:`~gear_mpi.storage.file_guard.FileGuard` (``arena.guard``: a read lease) that
  notices them; users of the mapping hold it (``with arena.guard.hold(): ...``).

Access advice: column mappings get ``MADV_RANDOM`` (sampling reads windows at random
places; the kernel's read-ahead around each fault would read pages no window needs).

The GPU path (``device="cuda"``) page-locks the whole arena (``cudaHostRegister``):
every page of a file-backed arena is then read in and locked in RAM (so the shard must
fit in RAM after all), and Linux kernels from 6.5 on may refuse long-term pins of
writable, file-backed mappings (files other than tmpfs/hugetlbfs, copy-on-write
mappings of them included), where registration fails and :class:`~gear_mpi.distributed.node.NodeView`
raises a ValueError saying so; use ``memory="shm"`` or ``"private"`` for device replays.
Not tested on a GPU (none was available); the CUDA simulator accepts it.
"""
from __future__ import annotations

import errno
import mmap
import os
import weakref

import numpy as np

from ..errors import StorageError
from ..progress import human
from .file_guard import FileGuard

COLUMNS_FILE = "columns.bin"  # a rank's arena of step columns (and a v3 checkpoint's, laid out alike)
TABLE_FILE = "slots.bin"      # a file-backed shard's trajectory table
FILE_ALIGN = 4096             # arrays carved out of a file start on page boundaries


def rank_dir_name(rank: int) -> str:
    """The directory of rank ``rank``'s files under a ``path`` (``rank-00003``). O(1).

    Args:
        rank: the shard's rank.
    Returns:
        The name, relative to ``path`` (the same as a checkpoint's rank directories).
    """
    return f"rank-{int(rank):05d}"


def rank_directory(path, rank: int) -> str:
    """Check ``path`` and make (or reuse) this rank's directory under it. Local; a few file-system calls.

    Args:
        path: the directory given as ``path=`` (str or os.PathLike).
        rank: the shard's rank.
    Returns:
        The absolute path of ``path/rank-NNNNN``.
    Raises:
        StorageError: ``path`` is None, missing, not a directory or not writable.
    """
    if path is None:
        raise StorageError('memory="file" needs path=, an existing directory for the shards\' files')
    if not isinstance(path, (str, os.PathLike)):
        raise StorageError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if not os.path.exists(path):
        raise StorageError(f"path {path!r} does not exist (create the directory first; each rank keeps its "
                           f"files in path/rank-NNNNN/)")
    if not os.path.isdir(path):
        raise StorageError(f"path {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise StorageError(f"path {path!r} is not writable by this process")
    d = os.path.join(path, rank_dir_name(rank))
    try:
        os.makedirs(d, exist_ok=True)
    except OSError as e:
        raise StorageError(f"cannot create {d!r}: {e.strerror or e}") from None
    return d


def require_space(directory: str, nbytes: int) -> None:
    """Check that the file system of ``directory`` has ``nbytes`` free for this user. Local, one statvfs.

    Args:
        directory: a directory on the file system.
        nbytes: bytes about to be reserved.
    Raises:
        StorageError: less is free (the message gives both figures).
    """
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise StorageError(f"not enough disk for a file-backed shard in {directory!r}: it needs {human(nbytes)}, "
                           f"{human(free)} is free there")


def remove_if_empty(directory: str) -> None:
    """Remove ``directory`` if it is empty (a rank's directory once its files are gone). Local; one rmdir.

    Args:
        directory: the directory.
    """
    try:
        os.rmdir(directory)
    except OSError:
        pass


def unlink_quietly(path: str, remove_directory: bool = False) -> bool:
    """Unlink ``path``; then, with ``remove_directory``, its directory if it is left empty. Local, O(1).

    Returns:
        Whether it was there to unlink (False: gone already).
    """
    try:
        os.unlink(path)
        removed = True
    except FileNotFoundError:
        removed = False
    if remove_directory:
        remove_if_empty(os.path.dirname(path))
    return removed


def unlink_in_creator(path: str, creator: int, remove_directory: bool = False) -> None:
    """:func:`unlink_quietly` if this is process ``creator``, else nothing. The exit handlers and finalizers of
    named memory call it: a child forked from the creator inherits them, and when it exits normally they run
    there too, where they must not delete the names that the creator and its node peers still map and attach
    by (a writer registry, a shared ring). Local, O(1).

    Args:
        path: the file or shared-memory segment; creator: ``os.getpid()`` of the process that made it;
        remove_directory: remove the directory too when it is empty.
    """
    if os.getpid() == creator:
        unlink_quietly(path, remove_directory)


def create_exclusive(filename: str) -> int:
    """Create ``filename`` (read-write, mode 0600), failing if it exists: a file-backed shard's files are its
    own. O(1).

    Returns:
        The open descriptor (the caller closes it).
    Raises:
        StorageError: the file exists already (left by a crashed run?) or cannot be created.
    """
    try:
        return os.open(filename, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise StorageError(f"{filename!r} exists: a file-backed shard needs files of its own (left by a crashed "
                           f"run? remove it, or give another path)") from None
    except OSError as e:
        raise StorageError(f"cannot create {filename!r}: {e.strerror or e}") from None


def close_mapping(mapping: mmap.mmap | None) -> None:
    """Close ``mapping`` now if nothing views it; else leave it to go with its last view. O(1)."""
    if mapping is None:
        return
    try:
        mapping.close()
    except BufferError:
        pass  # arrays still view it; the mapping goes when they do


class NamedMapping:
    """What a mapped, named arena (a file here, a POSIX shared-memory segment in :mod:`gear_mpi.storage.arenas`)
    does on unlink and close: it holds ``buffer``, ``_mmap`` and ``_finalizer`` (the creator's unlink,
    None for an attacher)."""

    def unlink(self) -> None:
        """Remove the name now (mappings stay valid; the space is freed when the last goes). Only the
        creator does anything. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    def close(self) -> None:
        """Unmap (once no array views it); the creator also unlinks the name. Idempotent."""
        self.buffer = None
        close_mapping(self._mmap)
        self._mmap = None
        self.unlink()


class FileArena(NamedMapping):
    """An arena in a memory-mapped file (see the module docstring). Build it with :meth:`create`,
    :meth:`attach` or :meth:`open_private`.

    Attributes:
        kind: ``"file"`` (shared mapping) or ``"mapped"`` (copy-on-write mapping of an existing file).
        name: the file's absolute path, by which node peers attach (None for ``"mapped"``: peers
            cannot see this process's copy-on-write pages).
        buffer: the mapped bytes (uint8); nbytes: their count.
        owner: whether this process created the file (and unlinks it).
    """

    def __init__(self, filename: str, fd: int, nbytes: int, *, owner: bool, private: bool, random: bool):
        self.filename = filename
        self.kind = "mapped" if private else "file"
        self.name = None if private else filename
        self.owner = owner
        self.nbytes = int(nbytes)
        flags = mmap.MAP_PRIVATE if private else mmap.MAP_SHARED
        self._mmap = mmap.mmap(fd, max(self.nbytes, 1), flags, mmap.PROT_READ | mmap.PROT_WRITE)
        if random and hasattr(mmap, "MADV_RANDOM"):
            self._mmap.madvise(mmap.MADV_RANDOM)
        self.buffer = np.frombuffer(self._mmap, np.uint8, self.nbytes)
        self._finalizer = (weakref.finalize(self, unlink_in_creator, filename, os.getpid(), True) if owner
                           else None)
        self.guard: FileGuard | None = None  # open_private: watches the file for other processes' changes

    def close(self) -> None:
        """Unmap (once no array views it), unlink the file if this process created it, and (a
        copy-on-write mapping) give up its guard's lease. Idempotent."""
        super().close()
        if self.guard is not None:
            self.guard.close()
            self.guard = None

    @classmethod
    def create(cls, directory: str, filename: str, nbytes: int, random: bool = True) -> "FileArena":
        """A new file of ``nbytes`` zero bytes, its blocks reserved, mapped shared read-write.

        Args:
            directory: this rank's directory (from :func:`rank_directory`).
            filename: the file's name in it (e.g. :data:`COLUMNS_FILE`).
            nbytes: its size.
            random: advise the kernel of random access (``MADV_RANDOM``).
        Returns:
            The arena (this process owns the file). Cost: one create, one ``posix_fallocate``
            (fast where the file system reserves extents; glibc writes a byte per block elsewhere),
            one mmap.
        Raises:
            StorageError: the file exists already, cannot be created, or the disk has no room.
        """
        full = os.path.join(directory, filename)
        require_space(directory, nbytes)
        fd = create_exclusive(full)
        try:
            try:
                os.posix_fallocate(fd, 0, max(int(nbytes), 1))
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise StorageError(f"not enough disk for {full!r}: reserving {human(nbytes)} failed "
                                       f"({e.strerror})") from None
                raise StorageError(f"cannot reserve {human(nbytes)} for {full!r}: {e.strerror or e}") from None
            return cls(full, fd, nbytes, owner=True, private=False, random=random)
        except BaseException:
            unlink_quietly(full, remove_directory=True)
            raise
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, filename: str) -> "FileArena":
        """Map another process's arena file (shared, read-write; never unlinked by this process).

        Args:
            filename: the file's absolute path (``shard.shm_name`` of a file-backed shard).
        Returns:
            The arena. Cost: one open and one mmap.
        Raises:
            FileNotFoundError: no such file (its shard was closed).
        """
        return cls._open(filename, private=False)

    @classmethod
    def open_private(cls, filename: str, nbytes: int | None = None) -> "FileArena":
        """Map an existing file copy-on-write (``MAP_PRIVATE``): the file is never written.

        Args:
            filename: the file (e.g. a checkpoint's ``rank-NNNNN/columns.bin``).
            nbytes: the size it must have (None: any).
        Returns:
            The arena, of kind ``"mapped"``, with its :class:`~gear_mpi.storage.file_guard.FileGuard`
            (``arena.guard``; its descriptor stays open until :meth:`close`). Cost: one open, one
            mmap, the guard's lease (one ``fcntl`` or two); pages are read on first use.
        Raises:
            FileNotFoundError: no such file.
            StorageError: the file has another size than ``nbytes`` (checked once the lease is held).
        """
        return cls._open(filename, private=True, nbytes=nbytes)

    @classmethod
    def _open(cls, filename: str, private: bool, nbytes: int | None = None) -> "FileArena":
        try:
            fd = os.open(filename, os.O_RDWR if not private else os.O_RDONLY)
        except FileNotFoundError:
            raise FileNotFoundError(f"no arena file {filename!r} (was its shard closed?)") from None
        guard = None
        try:
            if private:  # a file of someone else's (a checkpoint): guard it before its size is trusted
                guard = FileGuard(filename, fd)
            size = os.fstat(fd).st_size
            if nbytes is not None and size != nbytes:
                raise StorageError(f"{filename!r} has {size} bytes, {nbytes} expected")
            arena = cls(filename, fd, size, owner=False, private=private, random=True)
            arena.guard = guard
            return arena
        except BaseException:
            if guard is not None:
                guard.close()  # closes fd too
            raise
        finally:
            if guard is None:
                os.close(fd)

    def advise(self, option: int, start: int, length: int) -> None:
        """``madvise`` a range of the mapping (``start`` page-aligned); ignored if the kernel refuses. O(1) call.

        Args:
            option: an ``mmap.MADV_*`` constant.
            start: byte offset in the arena, a multiple of the page size.
            length: bytes.
        """
        try:
            self._mmap.madvise(option, start, length)
        except (OSError, ValueError):
            pass



def carve(buffer: np.ndarray, fields: dict[str, tuple[int, np.dtype]]) -> dict[str, np.ndarray]:
    """Arrays laid out back to back in ``buffer``, each starting on a :data:`FILE_ALIGN` boundary. O(fields).

    Args:
        buffer: bytes of at least :func:`carved_bytes` ``(fields)``.
        fields: name -> (element count, dtype), in layout order.
    Returns:
        name -> 1-D array viewing ``buffer``.
    """
    out, pos = {}, 0
    for name, (count, dtype) in fields.items():
        dtype = np.dtype(dtype)
        out[name] = buffer[pos:pos + count * dtype.itemsize].view(dtype)
        pos += -(-count * dtype.itemsize // FILE_ALIGN) * FILE_ALIGN
    return out


def carved_bytes(fields: dict[str, tuple[int, np.dtype]]) -> int:
    """Bytes :func:`carve` needs for ``fields``. O(fields).

    Args:
        fields: name -> (element count, dtype).
    Returns:
        The size.
    """
    return max(FILE_ALIGN, sum(-(-c * np.dtype(d).itemsize // FILE_ALIGN) * FILE_ALIGN for c, d in fields.values()))
