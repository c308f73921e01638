"""A replay's own state for checkpoints: what :class:`~gear_mpi.replay.Replay` hands out and takes back.

:class:`ReplayState` is a mixin that :class:`~gear_mpi.replay.Replay` inherits, as
:class:`~gear_mpi.checkpoint.shard_state.ShardState` is for a shard: the replay-level streams and
window counters (:meth:`~ReplayState.state`, :meth:`~ReplayState.load_state`) and how
the replay runs (:meth:`~ReplayState.describe`, for a manifest). The shards' own state
and the file format are elsewhere (:mod:`gear_mpi.checkpoint.shard_state`, :mod:`gear_mpi.checkpoint`);
everything here is local (no communication), except the collective :meth:`~ReplayState.save`
and :meth:`~ReplayState.load`, which hand the replay to :mod:`gear_mpi.checkpoint`.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .. import checkpoint


class ReplayState:
    """The checkpoint state of a replay (mixed into :class:`~gear_mpi.replay.Replay`).

    It reads the replay's ``rng``, ``shared_rng``, ``windows_shared``, ``windows_mpi``, ``mode``,
    ``comm``, ``force_alltoallv``, ``device`` and ``shard``.
    """

    def state(self) -> dict[str, Any]:
        """This rank's replay-level state (local, JSON-serialisable): the replay stream (``"rng"``),
        the shared stream (``"shared_rng"``, the same on every rank) and the window counters.

        Returns:
            ``{"rng", "shared_rng", "windows_shared", "windows_mpi"}``.
        """
        return {"rng": self.rng.bit_generator.state, "shared_rng": self.shared_rng.bit_generator.state,
                "windows_shared": int(self.windows_shared), "windows_mpi": int(self.windows_mpi)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state` returned (local; ``"shared_rng"`` optional: kept when absent).

        Args:
            state: a mapping with ``"rng"``, ``"windows_shared"``, ``"windows_mpi"`` and optionally
                ``"shared_rng"``.
        Raises:
            KeyError: a required entry is missing; ValueError/TypeError: a stream state of another kind.
        """
        self.rng.bit_generator.state = state["rng"]
        if state.get("shared_rng") is not None:
            self.shared_rng.bit_generator.state = state["shared_rng"]
        self.windows_shared = int(state["windows_shared"])
        self.windows_mpi = int(state["windows_mpi"])

    def describe(self) -> dict[str, Any]:
        """How this replay runs, for a checkpoint's manifest (local).

        Returns:
            ``{"mode", "timeout", "force_alltoallv", "device": "cpu" | "cuda", "memory": the shard
            arena's kind ("private" | "shm")}``.
        """
        return {"mode": self.mode, "timeout": self.comm.timeout, "force_alltoallv": bool(self.force_alltoallv),
                "device": "cuda" if self.device is not None else "cpu",
                "memory": getattr(self.shard.store.arena, "kind", None)}

    def save(self, path, progress: bool | None = None) -> None:
        """Collective: write a crash-safe, checksummed checkpoint of every shard to directory ``path``.

        Args:
            path: the checkpoint directory (its parent must exist; an earlier checkpoint there is replaced).
            progress: a progress bar on rank 0 (None: when stderr is a terminal; see :mod:`gear_mpi.progress`).
        Raises:
            CheckpointError: a file problem (on every rank); CollectiveTimeoutError: a rank did not arrive.
        Cost: see :func:`gear_mpi.checkpoint.save`.
        """
        checkpoint.save(self, path, progress)

    @classmethod
    def load(cls, path, comm=None, **overrides) -> tuple[Any, tuple[np.ndarray, np.ndarray]]:
        """Collective: restore a checkpoint onto ``comm`` (any number of ranks).

        Args:
            path: a checkpoint directory written by :meth:`save`.
            comm: the mpi4py communicator (default ``MPI.COMM_WORLD``).
            overrides: constructor arguments to change (e.g. ``mode``, ``timeout``, ``device``); ``mmap=True``
                maps the saved columns instead of reading them, ``verify`` (see :func:`gear_mpi.checkpoint.load`).
        Returns:
            ``(replay, key_map)``: the replay and the map of old keys to new keys.
        Raises:
            CheckpointError: a missing, partial or corrupted checkpoint (on every rank).
        Cost: see :func:`gear_mpi.checkpoint.load`.
        """
        return checkpoint.load(path, comm, cls, **overrides)
