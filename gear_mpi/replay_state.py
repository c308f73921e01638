"""A replay's own state for checkpoints: what :class:`~gear_mpi.replay.Replay` hands out and takes back.

:class:`ReplayState` is a mixin that :class:`~gear_mpi.replay.Replay` inherits, as
:class:`~gear_mpi.shard_state.ShardState` is for a shard: the replay-level streams and
window counters (:meth:`~ReplayState.state`, :meth:`~ReplayState.load_state`) and how
the replay runs (:meth:`~ReplayState.describe`, for a manifest). The shards' own state
and the file format are elsewhere (:mod:`gear_mpi.shard_state`, :mod:`gear_mpi.checkpoint`);
everything here is local (no communication).
"""
from __future__ import annotations

from typing import Any, Mapping


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
