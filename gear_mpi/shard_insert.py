"""How trajectories enter a shard: :class:`ShardInsert`, mixed into :class:`~gear_mpi.shard.Shard`.

Every path -- one trajectory, a list of them, packed columns, a writer's staged
episodes (:mod:`gear_mpi.ingest`) -- validates first and then ends in
:meth:`ShardInsert.store_packed`, so a bad trajectory stores nothing. Local: no communication.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .errors import InvalidTrajectoryError
from .spec import validate_priorities


class ShardInsert:
    """Insertion into a shard (mixed into :class:`~gear_mpi.shard.Shard`; reads its ``spec``, ``store``,
    ``index`` and ``selector``)."""

    bytes_inserted = 0  # bytes of the steps ever stored here (all paths; gear_mpi.activity)

    def insert(self, trajectory: Mapping[str, Any], priority: float = 1.0) -> int:
        """Add one trajectory; evicts the oldest (FIFO) when full. Cost: O(L) copy of the steps,
        O(1 + evictions) table work, one index update.

        Args:
            trajectory: column name -> ``[L, *shape]`` array (numpy, torch or nested lists).
            priority: its priority (finite, >= 0).
        Returns:
            Its key (int).
        Raises:
            InvalidTrajectoryError, InvalidPriorityError: as :meth:`insert_many`.
        """
        return int(self.insert_many([trajectory], [priority])[0])

    def insert_many(self, trajectories: Sequence[Mapping[str, Any]], priorities: Any = None) -> np.ndarray:
        """Add several trajectories, evicting the oldest (FIFO) to make room; one bad one stores none.
        Cost: one ring copy per column, O(n + evictions) table work in a kernel, one batched index update.

        Args:
            trajectories: a sequence of trajectories (each as :meth:`insert` takes it).
            priorities: one priority per trajectory (None: all 1).
        Returns:
            Their keys (int64), in order.
        Raises:
            InvalidTrajectoryError: a bad trajectory (see ``TrajectorySpec.validate``), a mapping, or too many.
            InvalidPriorityError: a NaN, infinite or negative priority, or the wrong number of them.
        """
        self._check_open()
        if isinstance(trajectories, Mapping):
            raise InvalidTrajectoryError("insert_many takes a sequence of trajectories; use insert() for one")
        trajectories = list(trajectories)
        n = len(trajectories)
        if n == 0:
            return np.zeros(0, np.int64)
        pr = validate_priorities(np.ones(n) if priorities is None else priorities, n)
        checked = [self.spec.validate(t, where=f"trajectory {i}" if n > 1 else "trajectory")
                   for i, t in enumerate(trajectories)]
        lengths = np.array([length for _, length in checked], np.int64)
        if n == 1:
            columns = checked[0][0]
        else:
            columns = {c.name: np.concatenate([cols[c.name] for cols, _ in checked]) for c in self.spec.columns}
        return self.store_packed(columns, lengths, pr)

    def store_packed(self, columns: Mapping[str, np.ndarray], lengths: np.ndarray, priorities: np.ndarray) -> np.ndarray:
        """Store already-validated trajectories laid end to end (the common tail of every insert path).
        Cost: one ring copy per column, O(n + evictions) table work in a kernel, one batched index update.

        Args:
            columns: column name -> all their steps back to back, C-contiguous, in the spec's dtype.
            lengths: int64 steps of each trajectory (each in ``[1, max_length]``, summing to the rows).
            priorities: float64 priorities, validated (finite, >= 0), one per trajectory.
        Returns:
            Their keys (int64), in order.
        Raises:
            InvalidTrajectoryError: more steps than ``capacity_steps`` or more trajectories than ``max_items``
                (nothing is stored).
        """
        self._check_open()
        self.store.check_batch(lengths)
        slots, evicted = self.store.insert(columns, lengths, priorities)
        self.bytes_inserted += int(lengths.sum()) * self.spec.step_bytes
        if self.index is not None:
            self.index.set(evicted, np.zeros(len(evicted)))
            self.index.set(slots, self.selector.weights(priorities))
        return self.store.keys_of(slots)
