"""A replay's own state for checkpoints: what :class:`~gear_mpi.replay.Replay` hands out and takes back.

:class:`ReplayState` is the part of a :class:`~gear_mpi.replay.Replay` that holds it, as
:class:`~gear_mpi.checkpoint.shard_state.ShardCheckpointState` does for a shard: the replay-level streams and
window counters (:meth:`~ReplayState.state`, :meth:`~ReplayState.load_state`; the replay counts its
windows into it, :meth:`~ReplayState.count_windows`) and how the replay runs
(:meth:`~ReplayState.describe`, for a manifest). The shards' own state and the file format are
elsewhere (:mod:`gear_mpi.checkpoint.shard_state`, :mod:`gear_mpi.checkpoint`); ``Replay.save`` and
``Replay.load`` call :func:`gear_mpi.checkpoint.save` and :func:`gear_mpi.checkpoint.load`, which read
and restore this part through the replay's ``state``, ``load_state`` and ``describe``. Everything
here is local (no communication).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np


class ReplayState:
    """The checkpoint state of one rank of a replay (a part of :class:`~gear_mpi.replay.Replay`). Local.

    Args:
        rng: the replay's own stream of this rank; shared_rng: the stream every rank holds alike (both are
            the generators the replay's plans draw from: :meth:`load_state` restores them in place).
        mode, comm, force_alltoallv, device, shard: the replay's default mode, communicator, window path,
            device context (None: a host replay) and shard, for :meth:`describe`.
    """

    def __init__(self, rng: np.random.Generator, shared_rng: np.random.Generator, *, mode: str, comm,
                 force_alltoallv: bool, device, shard):
        self.rng, self.shared_rng = rng, shared_rng
        self.mode, self.comm, self.force_alltoallv, self.device, self.shard = mode, comm, force_alltoallv, device, shard
        self.windows_shared = 0  # windows this rank copied from a node peer's shared memory
        self.windows_mpi = 0  # windows this rank received through MPI

    def count_windows(self, shared: int, mpi: int) -> None:
        """Add one sample's windows: ``shared`` copied from node peers' memory, ``mpi`` received by MPI (O(1))."""
        self.windows_shared += shared
        self.windows_mpi += mpi

    def state(self) -> dict[str, Any]:
        """``{"rng", "shared_rng", "windows_shared", "windows_mpi"}``: JSON-serialisable (see ``Replay.state``)."""
        return {"rng": self.rng.bit_generator.state, "shared_rng": self.shared_rng.bit_generator.state,
                "windows_shared": int(self.windows_shared), "windows_mpi": int(self.windows_mpi)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (``"shared_rng"`` optional: kept when absent; see
        ``Replay.load_state``).

        Raises:
            KeyError: a required entry is missing; ValueError/TypeError: a stream state of another kind.
        """
        self.rng.bit_generator.state = state["rng"]
        if state.get("shared_rng") is not None:
            self.shared_rng.bit_generator.state = state["shared_rng"]
        self.windows_shared = int(state["windows_shared"])
        self.windows_mpi = int(state["windows_mpi"])

    def describe(self) -> dict[str, Any]:
        """``{"mode", "timeout", "force_alltoallv", "device", "memory"}``: how the replay runs, for a checkpoint's
        manifest (see ``Replay.describe``)."""
        return {"mode": self.mode, "timeout": self.comm.timeout, "force_alltoallv": bool(self.force_alltoallv),
                "device": "cuda" if self.device is not None else "cpu",
                "memory": getattr(self.shard.store.arena, "kind", None)}
