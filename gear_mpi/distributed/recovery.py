"""Surviving a dead rank where MPI has ULFM: revoke the communicator, shrink it to the survivors.

ULFM (User Level Failure Mitigation: ``MPIX_Comm_revoke``, ``MPIX_Comm_shrink``, ``MPIX_Comm_agree``;
mpi4py 4 calls them ``Comm.Revoke``, ``Comm.Shrink``, ``Comm.Agree``) lets the ranks that are left
after one dies build a communicator of their own and go on. Open MPI 5 has it when the job is started
with ``mpiexec --with-ft ulfm`` (its launcher then sets ``OMPI_MCA_mpi_ft_enable=1`` in every rank);
MPICH does not (mpi4py then gives ``MPI.ERR_PROC_FAILED`` the value of ``MPI.ERR_UNKNOWN``).

:func:`unavailable` says, locally and at once, why it cannot work here; :func:`shrink` revokes a
communicator and returns the survivors' one (collective over the survivors, with a deadline);
:func:`recover` shrinks, then has :func:`gear_mpi.checkpoint.survivors.rebuild` build the survivors' replay
(their own shards kept, the dead ranks' restored from a checkpoint); :class:`Recovery` is what it returns.
``Comm.Ishrink`` is not used: the Open MPI 5.0 wheel fails it with ``MPI_ERR_INTERN``; the blocking
``Shrink`` runs on a helper thread instead, so that a survivor that never calls it makes the others raise
at the deadline rather than wait forever.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import RecoveryError

#: what Open MPI's launcher sets in every rank when started with ``mpiexec --with-ft ulfm``
FT_VARIABLE = "OMPI_MCA_mpi_ft_enable"
#: the end of every RecoveryError that says ULFM is missing: what to do instead
RESTART_HINT = ("; restart the job from the newest checkpoint instead (Replay.load on any number of ranks; "
                "docs/guide/faults.md), or run under Open MPI 5 with `mpiexec --with-ft ulfm`")


@dataclass
class Recovery:
    """What :meth:`gear_mpi.Replay.recover` returns (the same on every survivor but ``replay``, its rank's).

    Attributes:
        replay: the new replay over the survivors: their own trajectories and the dead ranks' of the checkpoint.
        key_map: ``(old_keys, new_keys)``, sorted by old key, of every kept and restored trajectory (-1: a
            restored one dropped with ``allow_drop=True``); translate with :func:`gear_mpi.checkpoint.remap`.
        comm: the survivors' communicator (an mpi4py communicator; the job's old one is revoked: use this one
            from now on for the job's own communication too).
        survivors: the old ranks that survived, in their new order (new rank ``i`` was old rank ``survivors[i]``).
        dead: the old ranks that are gone.
        shrink_seconds, load_seconds: time spent revoking and shrinking, and rebuilding the replay (its own
            shard copied, the dead ranks' read from the checkpoint).
        kept: trajectories the survivors kept from their own shards (all survivors).
        restored: the dead ranks' trajectories restored from the checkpoint (all survivors).
        dropped: the dead ranks' trajectories of the checkpoint dropped because they did not fit
            (only with ``allow_drop=True``; ``key_map`` maps them to -1).
    """
    replay: Any
    key_map: tuple[np.ndarray, np.ndarray]
    comm: Any
    survivors: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    shrink_seconds: float = 0.0
    load_seconds: float = 0.0
    kept: int = 0
    restored: int = 0
    dropped: int = 0

    @property
    def seconds(self) -> float:
        """The whole recovery: shrink and rebuild."""
        return self.shrink_seconds + self.load_seconds


def _mpi():
    from mpi4py import MPI
    return MPI


def unavailable() -> str | None:
    """Why this process cannot survive a dead rank (None: it can). Local, O(1): the same answer on every
    rank of a job (it depends on the MPI library and how the job was started)."""
    MPI = _mpi()
    library = MPI.Get_library_version().splitlines()[0].strip()
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink")):
        return f"this mpi4py ({library}) has no Comm.Revoke/Comm.Shrink (ULFM; mpi4py >= 4 is needed)"
    if getattr(MPI, "ERR_PROC_FAILED", MPI.ERR_UNKNOWN) == MPI.ERR_UNKNOWN:
        return f"the MPI library ({library}) has no ULFM (MPIX_Comm_revoke/MPIX_Comm_shrink)"
    if "Open MPI" in library and os.environ.get(FT_VARIABLE, "").lower() not in ("1", "true", "yes", "enabled"):
        return (f"{library} runs without fault tolerance ({FT_VARIABLE} is not set): start the job with "
                f"`mpiexec --with-ft ulfm`")
    return None


def revoke(comm: Any) -> None:
    """Revoke ``comm`` (an mpi4py communicator) so that every pending and later operation on it fails at
    once on every rank. Local, non-blocking; a communicator already revoked or freed is left as it is."""
    try:
        if comm is not None and not comm.Is_revoked():
            comm.Revoke()
    except Exception:
        pass


def shrink(comm: Any, timeout: float) -> tuple[Any, list[int]]:
    """Collective over the ranks of ``comm`` still alive: revoke ``comm`` and build their communicator.

    Args:
        comm: an mpi4py communicator that lost ranks (it is revoked; the caller no longer uses it).
        timeout: seconds to wait for every survivor to arrive.
    Returns:
        ``(new_comm, survivors)``: the survivors' communicator (ordered as in ``comm``) and, for each of
        its ranks, its rank in ``comm``.
    Raises:
        RecoveryError: ULFM is missing (:func:`unavailable`; raised at once, nothing revoked), or a survivor
            did not arrive within ``timeout`` (its ``Shrink`` is then left running on a helper thread: end
            the process with ``os._exit`` or ``MPI.COMM_WORLD.Abort``).
    Cost: ``MPIX_Comm_shrink``, an agreement over the survivors (milliseconds on one node), on a helper thread.
    """
    why = unavailable()
    if why is not None:
        raise RecoveryError(f"recover: cannot survive a dead rank: {why}{RESTART_HINT}")
    MPI = _mpi()
    revoke(comm)
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            done["comm"] = comm.Shrink()
        except BaseException as e:  # reported by the caller's thread
            done["error"] = e

    if MPI.Query_thread() >= MPI.THREAD_MULTIPLE:
        helper = threading.Thread(target=run, name="gear_mpi-shrink", daemon=True)
        helper.start()
        helper.join(timeout)
        if helper.is_alive():
            raise RecoveryError(f"recover: not every surviving rank of {comm.Get_size()} called recover within "
                                f"timeout={timeout:g} s (every survivor must; a rank still in Shrink stays "
                                f"blocked: end this process){RESTART_HINT}")
    else:  # no threads for MPI: the blocking call (ULFM's shrink completes once every survivor is in it)
        run()
    if "error" in done:
        raise RecoveryError(f"recover: MPI could not shrink the communicator: {done['error']}{RESTART_HINT}")
    new = done["comm"]
    survivors = MPI.Group.Translate_ranks(new.Get_group(), list(range(new.Get_size())), comm.Get_group())
    return new, [int(r) for r in survivors]


def recover(replay: Any, checkpoint: Any, **overrides) -> Recovery:
    """Collective over the surviving ranks (``Replay.recover``): after a rank died, go on without it.

    The survivors revoke and shrink the replay's communicator (:func:`shrink`) and revoke the replay's node
    and closing communicators; then, on their new communicator, they build a new replay that holds every
    survivor's own shard as it is in memory (everything it inserted, after the checkpoint too) and the dead
    ranks' shards of ``checkpoint``, dealt over the survivors (:func:`gear_mpi.checkpoint.survivors.rebuild`).
    What is lost is what the dead ranks inserted after ``checkpoint`` began. The new replay takes over
    this rank's ingest point and its actor ranks' inboxes (``accept_remote``): its ``gm.Writer`` processes
    and ``MpiWriter`` actor ranks go on (same ``writer_address``, episodes they staged or sent included); a
    dead rank's writers and actors raise WriterError (their owner is gone). The old replay then closes
    locally. Every survivor must call it, e.g. after a
    collective raised CollectiveTimeoutError; the job's old communicator (the replay's) is revoked: use
    ``Recovery.comm`` from then on.

    Args:
        replay: the replay that lost a rank (its ``comm`` is the communicator to shrink).
        checkpoint: a checkpoint directory this replay wrote (the newest: it loses least), seen by every
            survivor; or None (no checkpoint yet): the dead ranks' trajectories are all lost.
        overrides: any of :data:`gear_mpi.checkpoint.survivors.RECOVER_OPTIONS`: ``capacity_steps`` and
            ``max_items`` per survivor (default: the replay's grown by ``ranks / survivors``, rounded up),
            ``timeout``, ``mode``, ``seed``, ``memory``, ``memory_path``, ``lazy`` (as the Replay
            constructor), ``allow_drop`` (drop the oldest of the dead ranks' trajectories that do not fit,
            instead of failing).
    Returns:
        A :class:`Recovery`.
    Raises:
        RuntimeError: the replay is closed.
        TypeError: an unknown option (at once, nothing changed).
        RecoveryError: no ULFM (MPICH; Open MPI without ``mpiexec --with-ft ulfm``): at once on every rank,
            the replay unchanged (resume from the checkpoint in a new job); or a survivor did not arrive
            within the replay's ``timeout``.
        CheckpointError, CollectiveTimeoutError, ValueError, MemoryBudgetError: the rebuild failed (a checkpoint
            not this replay's, damaged or unreadable; survivors too small without ``allow_drop``; ...): on every
            survivor, the same error; the old replay stays open (broken, its data intact), and ``recover`` may
            be called again (e.g. with another checkpoint or None).
    Cost: the shrink (an agreement of the survivors: milliseconds on one node), then the rebuild: a Replay
    construction, each survivor copies its own live steps once and reads the dead ranks' steps dealt to it.
    """
    if replay.closed:
        raise RuntimeError("this Replay is closed")
    why = unavailable()  # local and the same on every rank: nothing is touched when it fails
    if why is not None:
        raise RecoveryError(f"recover: cannot survive a dead rank: {why}{RESTART_HINT}")
    from ..checkpoint import survivors as rebuilding
    rebuilding.options(replay, 1, overrides)  # TypeError for an unknown option, before anything changes
    replay._prefetch.check_owner()
    mc = replay.comm
    (comm, survivors), shrink_seconds = timed(shrink, mc.comm, mc.timeout)
    for c in (replay.node.node_comm.comm, replay.node.closing.comm):  # their collectives would wait for the dead
        revoke(c)
    mc.broken = mc.broken or "recover: the replay was moved to the surviving ranks"
    opts = rebuilding.options(replay, len(survivors), overrides)
    (new, key_map, counts), load_seconds = timed(rebuilding.rebuild, replay, comm, survivors, checkpoint, opts,
                                                 type(replay))
    new._feeds.adopt(replay._feeds)  # this rank's writers and actor ranks go on into the new shard
    replay.close()  # locally: its communicator is broken
    dead = sorted(set(range(mc.size)) - set(survivors))
    return Recovery(new, key_map, comm, survivors, dead, shrink_seconds, load_seconds, counts["kept"],
                    counts["restored"], counts["dropped"])


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and the seconds it took (local)."""
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0
