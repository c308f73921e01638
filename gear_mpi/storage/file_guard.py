"""Guarding a file that this process maps against other processes that write or truncate it.

``Replay.load(path, mmap=True)`` maps a checkpoint's ``columns.bin`` copy-on-write
(:meth:`~gear_mpi.storage.file_arenas.FileArena.open_private`). ``MAP_PRIVATE`` keeps this
process's writes out of the file, not the file's changes out of the mapping: on Linux a page the
process has not written shows the file as it is now, so another process rewriting the file in
place silently changes sampled steps, and truncating it makes the next read of a page past the
new end raise SIGBUS, which kills the process (copied pages are dropped too). A :class:`FileGuard`
keeps both from happening unnoticed.

**With a lease** (Linux, the default): the guard takes a read lease on the mapped file
(``fcntl(F_SETLEASE, F_RDLCK)``). The kernel then holds any process that opens the file for
writing or truncates it (``open(O_WRONLY|O_RDWR|O_TRUNC)``, ``truncate``) until the lease holder
lets go, or until ``/proc/sys/fs/lease-break-time`` seconds (45 by default) have passed, and
tells the holder with a signal. The signal goes to one thread per process, the watcher
(``gear_mpi-lease-watch``), which has it blocked and waits for it with ``sigwaitinfo``
(``F_SETOWN_EX`` names that thread): no signal handler is installed, the main thread is never
interrupted, and nothing else of the process sees the signal. On notice the watcher marks the
guard *broken* and gives the lease back as soon as no call is using the mapping (at once if none
is; else when the last one ends), so the writer goes on promptly and never changes a page a call
is reading. From then on every call that would read or write the mapping raises
:class:`~gear_mpi.errors.CheckpointError` naming the file. Renaming or deleting the file (what a
save over the same path does) breaks no lease: the mapping keeps the old file.

**Without a lease** (the file system does not support them, e.g. NFS; the process neither owns
the file nor has ``CAP_LEASE``; the file is open for writing somewhere when it is mapped; or
``GEAR_MPI_MMAP_LEASE=0``): the guard compares the file's size and modification time with those
it had when mapped, before every call that uses the mapping. A change is then seen at the next
call, after the fact: a call running while the file changes may read changed steps, or die of
SIGBUS on a truncation. A :class:`RuntimeWarning` says so when a lease could not be taken.

Both ways also check the size and modification time (one ``fstat``, about a microsecond), which
catches what a lease cannot see, e.g. another host writing a file on a cluster file system.

Cost: one open file descriptor per guarded file; per call, a lock, a counter and one ``fstat``.
"""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import struct
import threading
import warnings
import weakref

from ..errors import CheckpointError

#: ``0`` turns leases off: guards then only compare sizes and modification times (see the module docstring)
LEASE_VAR = "GEAR_MPI_MMAP_LEASE"
_F_SETOWN_EX = getattr(fcntl, "F_SETOWN_EX", 15)  # Linux; Python's fcntl does not name these
_F_OWNER_TID = 0
_LEASE_BROKEN = "was opened for writing or truncated by another process"  # what a lease break tells
_REASONS = {
    errno.EAGAIN: "it is open for writing by some process",
    errno.EACCES: "this process neither owns it nor has CAP_LEASE",
    errno.EPERM: "this process neither owns it nor has CAP_LEASE",
    errno.EINVAL: "its file system does not support leases (e.g. NFS), or leases are off "
                  "(/proc/sys/fs/leases-enable)",
    errno.ENOLCK: "the kernel has no lock left for it",
}


class _Watcher:
    """The thread that receives lease-break signals (one per process) and tells the guards."""

    def __init__(self):
        self.guards: weakref.WeakSet = weakref.WeakSet()
        self.lock = threading.Lock()  # guards are added and dropped from other threads
        self.tid = 0
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), name="gear_mpi-lease-watch", daemon=True)
        self.thread.start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGIO})  # this thread only: it waits for them
        self.tid = threading.get_native_id()
        ready.set()
        while True:
            signal.sigwaitinfo({signal.SIGIO})
            with self.lock:
                guards = list(self.guards)
            for guard in guards:
                try:
                    guard._notice()
                except Exception:  # never let this thread die: a writer would then wait the lease-break time
                    pass


_watcher: _Watcher | None = None
_watcher_lock = threading.Lock()


def _the_watcher() -> _Watcher:
    global _watcher
    with _watcher_lock:
        if _watcher is None:
            _watcher = _Watcher()
        return _watcher


def _forget_watcher() -> None:  # a forked child has no watcher thread: it starts its own when needed
    global _watcher, _watcher_lock
    _watcher, _watcher_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watcher)


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class Hold:
    """A call's use of a guarded mapping, as a context manager (:meth:`FileGuard.hold`).

    ``with guard.hold() as problem:`` counts the call in (the lease is then not given back before
    it ends) and gives None, or, where the file has changed, counts nothing and gives the
    :class:`~gear_mpi.errors.CheckpointError` to raise (``strict=True``: raises it). A hold of no
    guard (None) always gives None: unguarded memory. With a ``lock`` (a shard's,
    :meth:`Shard.hold <gear_mpi.shard.Shard.hold>`), the lock is held from entry to exit: taken first, then
    ``check()`` called under it (a closed shard's raises), then the guard asked; given back if entry raises.
    """

    __slots__ = ("guard", "strict", "entered", "lock", "check")

    def __init__(self, guard: "FileGuard | None", strict: bool, lock=None, check=None):
        self.guard, self.strict, self.entered, self.lock, self.check = guard, strict, False, lock, check

    def __enter__(self) -> CheckpointError | None:
        if self.lock is not None:
            self.lock.acquire()
        try:
            if self.check is not None:
                self.check()
            problem = None if self.guard is None else self.guard.enter()
        except BaseException:
            self._unlock()
            raise
        if self.guard is None:
            return None
        if problem is None:
            self.entered = True
        elif self.strict:
            self._unlock()
            raise problem
        return problem

    def __exit__(self, *exc) -> None:
        try:
            if self.entered:
                self.entered = False
                self.guard.leave()
        finally:
            self._unlock()

    def _unlock(self) -> None:
        if self.lock is not None:
            self.lock.release()


class FileGuard:
    """Watches one mapped file for other processes' writes and truncations (see the module docstring).

    Args:
        filename: the file (named in errors).
        fd: a descriptor of it opened read-only; the guard keeps it open (the lease lives on it) and
            closes it in :meth:`close`.
    Attributes:
        mode: ``"lease"`` (a read lease is held) or ``"stat"`` (size and modification time only).
        why_no_lease: why no lease was taken (None in mode ``"lease"``).
    Cost: with a lease, one ``fcntl`` or two and, the first time in the process, a thread started.
    """

    def __init__(self, filename: str, fd: int):
        self.filename = filename
        self._fd = fd
        self._lock = threading.Lock()
        self._inflight = 0
        self._broken: str | None = None
        self._leased = False
        self.why_no_lease = self._take_lease()
        self.mode = "stat" if self.why_no_lease else "lease"
        st = os.fstat(fd)  # after the lease: no local writer can change the file between the two
        self._size, self._mtime = st.st_size, st.st_mtime_ns
        self._finalizer = weakref.finalize(self, _close_fd, fd)  # closing the descriptor drops the lease
        if self.why_no_lease and os.environ.get(LEASE_VAR) != "0":
            warnings.warn(f"load(mmap=True): no lease on {filename} ({self.why_no_lease}): another process's "
                          f"writes to it, or a truncation, are seen only at the next call that reads it (by its "
                          f"size and modification time), and one during a call may still change sampled steps or "
                          f"kill this process with SIGBUS (docs/CHECKPOINTS.md)", RuntimeWarning, stacklevel=2)

    def _take_lease(self) -> str | None:
        """Take the read lease, its notices sent to the watcher thread; the reason when it cannot."""
        if os.environ.get(LEASE_VAR) == "0":
            return f"{LEASE_VAR}=0"
        if not hasattr(fcntl, "F_SETLEASE"):
            return "leases are Linux only"
        try:
            watcher = _the_watcher()
            fcntl.fcntl(self._fd, _F_SETOWN_EX, struct.pack("ii", _F_OWNER_TID, watcher.tid))
            fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
        except OSError as e:
            return _REASONS.get(e.errno, f"fcntl: {e.strerror or e}")
        self._leased = True
        with watcher.lock:
            watcher.guards.add(self)
        self._notice()  # a break signalled before the watcher knew this guard would otherwise go unheard
        return None

    def _notice(self) -> None:
        """The watcher got a lease-break signal: is it this file's lease? If so the guard is broken, and the
        lease goes back now unless a call is using the mapping (then when the last one ends)."""
        with self._lock:
            if not self._leased:
                return
            try:
                lease = fcntl.fcntl(self._fd, fcntl.F_GETLEASE)
            except OSError:
                return
            if lease == fcntl.F_RDLCK:  # not breaking: another file's signal
                return
            if self._broken is None:
                self._broken = _LEASE_BROKEN
            if self._inflight == 0:
                self._release()

    def _release(self) -> None:  # under self._lock
        if self._leased:
            self._leased = False
            try:
                fcntl.fcntl(self._fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
            except OSError:
                pass  # already taken by the kernel (lease-break-time passed)

    def _check_stat(self) -> None:  # under self._lock
        try:
            st = os.fstat(self._fd)
        except OSError as e:
            self._broken = f"cannot be checked ({e.strerror or e})"
            return
        if st.st_size != self._size:
            how = "truncated" if st.st_size < self._size else "extended"
            self._broken = f"was {how} by another process (now {st.st_size} bytes, {self._size} when mapped)"
        elif st.st_mtime_ns != self._mtime:
            self._broken = "was written by another process (its modification time changed)"

    def problem(self) -> CheckpointError | None:
        """The error a call using the mapping would raise now, or None. Local; one ``fstat``.

        Returns:
            A :class:`~gear_mpi.errors.CheckpointError` naming the file and what happened, or None.
        """
        with self._lock:
            if self._broken in (None, _LEASE_BROKEN) and self._fd >= 0:
                self._check_stat()
            return self._error()

    def _error(self) -> CheckpointError | None:
        if self._broken is None:
            return None
        how = "" if self.mode == "lease" else f" (no lease: {self.why_no_lease})"
        return CheckpointError(f"{self.filename} {self._broken} while mapped by this process (load(mmap=True)){how}: "
                               f"its steps can no longer be trusted; close the replay and load the checkpoint again")

    def enter(self) -> CheckpointError | None:
        """Count a call in before it uses the mapping, unless the file has changed. Local, O(1) and one ``fstat``.

        Returns:
            None (counted: call :meth:`leave` when done), or the error to raise (not counted).
        """
        with self._lock:
            if self._fd >= 0:  # (closed: counted in all the same; the caller's own check says it is closed)
                if self._broken in (None, _LEASE_BROKEN):  # (after a break: what the writer did, once it did)
                    self._check_stat()
                if self._broken is not None:
                    return self._error()
            self._inflight += 1
            return None

    def leave(self) -> None:
        """A call counted in by :meth:`enter` no longer uses the mapping; the last one out gives a
        breaking lease back. Local, O(1)."""
        with self._lock:
            self._inflight -= 1
            if self._inflight == 0 and self._broken is not None:
                self._release()

    def hold(self, strict: bool = True) -> Hold:
        """A :class:`Hold` of this guard: ``with guard.hold(): ...`` around a use of the mapping.

        Args:
            strict: raise the error on entry (False: give it as the ``with`` target instead).
        Returns:
            The context manager.
        """
        return Hold(self, strict)

    @property
    def leased(self) -> bool:
        """Whether the read lease is held now. O(1)."""
        return self._leased

    def close(self) -> None:
        """Give the lease back and close the descriptor. Idempotent."""
        with self._lock:
            self._release()
            fd, self._fd = self._fd, -1
        watcher = _watcher
        if watcher is not None:
            with watcher.lock:
                watcher.guards.discard(self)
        if fd >= 0:
            self._finalizer.detach()
            _close_fd(fd)


class GuardGroup:
    """Several :class:`FileGuard` s used as one (a mapped checkpoint's ``columns.bin`` and ``compressed.bin``):
    :meth:`enter` counts a call in on every guard or on none, and gives the first guard's problem.

    Args:
        guards: the guards (closed by :meth:`close`).
    Cost: that of each guard, per call.
    """

    def __init__(self, guards):
        self.guards = [g for g in guards if g is not None]

    @property
    def mode(self) -> str:
        """``"lease"`` if every guard holds a lease, else ``"stat"``. O(guards)."""
        return "lease" if all(g.mode == "lease" for g in self.guards) else "stat"

    @property
    def leased(self) -> bool:
        """Whether every guard's lease is held now. O(guards)."""
        return all(g.leased for g in self.guards)

    def problem(self) -> CheckpointError | None:
        """The first guard's error a call would raise now, or None. O(guards) ``fstat`` s."""
        for g in self.guards:
            problem = g.problem()
            if problem is not None:
                return problem
        return None

    def enter(self) -> CheckpointError | None:
        """:meth:`FileGuard.enter` on every guard; on a problem, those entered leave again and it is given."""
        entered = []
        for g in self.guards:
            problem = g.enter()
            if problem is not None:
                for e in entered:
                    e.leave()
                return problem
            entered.append(g)
        return None

    def leave(self) -> None:
        """:meth:`FileGuard.leave` on every guard."""
        for g in self.guards:
            g.leave()

    def hold(self, strict: bool = True) -> Hold:
        """A :class:`Hold` of every guard at once (as :meth:`FileGuard.hold`)."""
        return Hold(self, strict)

    def close(self) -> None:
        """Close every guard. Idempotent."""
        for g in self.guards:
            g.close()
