"""Surviving a dead rank where MPI has ULFM: revoke the communicator, shrink it to the survivors.

ULFM (User Level Failure Mitigation: ``MPIX_Comm_revoke``, ``MPIX_Comm_shrink``, ``MPIX_Comm_agree``;
mpi4py 4 calls them ``Comm.Revoke``, ``Comm.Shrink``, ``Comm.Agree``) lets the ranks that are left
after one dies build a communicator of their own and go on. Open MPI 5 has it when the job is started
with ``mpiexec --with-ft ulfm`` (its launcher then sets ``OMPI_MCA_mpi_ft_enable=1`` in every rank);
MPICH does not (mpi4py then gives ``MPI.ERR_PROC_FAILED`` the value of ``MPI.ERR_UNKNOWN``).

:func:`unavailable` says, locally and at once, why it cannot work here; :func:`shrink` revokes a
communicator and returns the survivors' one (collective over the survivors, with a deadline);
:class:`Recovery` is what ``Replay.recover`` returns. ``Comm.Ishrink`` is not used: the Open MPI 5.0
wheel fails it with ``MPI_ERR_INTERN``; the blocking ``Shrink`` runs on a helper thread instead, so
that a survivor that never calls it makes the others raise at the deadline rather than wait forever.
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
        replay: the new replay over the survivors, loaded from the checkpoint.
        key_map: ``(old_keys, new_keys)`` of the checkpoint's trajectories (as ``Replay.load`` returns it).
        comm: the survivors' communicator (an mpi4py communicator; the job's old one is revoked: use this one
            from now on for the job's own communication too).
        survivors: the old ranks that survived, in their new order (new rank ``i`` was old rank ``survivors[i]``).
        dead: the old ranks that are gone.
        shrink_seconds, load_seconds: time spent revoking and shrinking, and loading the checkpoint.
    """
    replay: Any
    key_map: tuple[np.ndarray, np.ndarray]
    comm: Any
    survivors: list[int] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)
    shrink_seconds: float = 0.0
    load_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        """The whole recovery: shrink and load."""
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

    The survivors revoke and shrink the replay's communicator (:func:`shrink`), revoke the replay's node and
    closing communicators and close it locally, then load ``checkpoint`` resharded over themselves
    (``Replay.load``). What the new replay holds is exactly the checkpoint's trajectories: whatever any
    rank inserted after it is lost, and the old replay's writers are closed (they raise WriterError).
    Every survivor must call it, e.g. after a collective raised CollectiveTimeoutError; the job's old
    communicator (the replay's) is revoked: use ``Recovery.comm`` from then on.

    Args:
        replay: the replay that lost a rank (its ``comm`` is the communicator to shrink).
        checkpoint: a checkpoint directory (the newest one), seen by every survivor.
        overrides: as ``Replay.load``; by default ``timeout`` is the replay's, and ``capacity_steps`` and
            ``max_items`` grow so that the survivors hold what every rank held (:func:`scaled_capacity`).
    Returns:
        A :class:`Recovery`.
    Raises:
        RuntimeError: the replay is closed.
        RecoveryError: no ULFM (MPICH; Open MPI without ``mpiexec --with-ft ulfm``): at once on every rank,
            the replay unchanged (resume from the checkpoint in a new job); or a survivor did not arrive
            within the replay's ``timeout``.
        CheckpointError, TypeError, CollectiveTimeoutError: as ``Replay.load`` (the old replay is then closed).
    Cost: the shrink (an agreement of the survivors: milliseconds on one node), then the load (a reshard).
    """
    if replay.closed:
        raise RuntimeError("this Replay is closed")
    why = unavailable()  # local and the same on every rank: nothing is touched when it fails
    if why is not None:
        raise RecoveryError(f"recover: cannot survive a dead rank: {why}{RESTART_HINT}")
    replay._prefetch.check_owner()
    mc = replay.comm
    (comm, survivors), shrink_seconds = timed(shrink, mc.comm, mc.timeout)
    for c in (replay.node.node_comm.comm, replay.node.closing.comm):  # their collectives would wait for the dead
        revoke(c)
    mc.broken = mc.broken or "recover: the replay was moved to the surviving ranks"
    replay.close()  # locally: its communicator is broken
    kw = {"timeout": mc.timeout, **scaled_capacity(checkpoint, comm.Get_size()), **overrides}
    (new, key_map), load_seconds = timed(type(replay).load, checkpoint, comm, **kw)
    dead = sorted(set(range(mc.size)) - set(survivors))
    return Recovery(new, key_map, comm, survivors, dead, shrink_seconds, load_seconds)


def scaled_capacity(checkpoint: Any, ranks: int) -> dict[str, int]:
    """``capacity_steps`` and ``max_items`` per rank that keep a checkpoint's whole capacity on ``ranks``
    ranks (rounded up), read from its manifest; empty when it cannot be read (loading then says why).
    Local: reads the manifest once."""
    from ..checkpoint import read_manifest, resolve
    try:
        body = read_manifest(resolve(os.path.abspath(os.fspath(checkpoint))))["body"]
        old = int(body["ranks"])
        return {"capacity_steps": -(-int(body["capacity_steps"]) * old // ranks),
                "max_items": -(-int(body["max_items"]) * old // ranks)}
    except Exception:
        return {}


def timed(fn, *args, **kwargs) -> tuple[Any, float]:
    """``fn(*args, **kwargs)`` and the seconds it took (local)."""
    t0 = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - t0
