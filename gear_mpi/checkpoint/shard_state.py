"""A shard's own state for checkpoints: what :class:`~gear_mpi.shard.Shard` hands out and takes back.

:class:`ShardCheckpointState` is the part of :class:`~gear_mpi.shard.Shard` that its checkpoint
methods delegate to. A save reads :meth:`~ShardCheckpointState.state` (streams, counters, tag),
:meth:`~ShardCheckpointState.sections` (the trajectory table and the priority index) and
:meth:`~ShardCheckpointState.column_segments` (the ring steps in use); an exact load puts them back
into a new, empty shard with :meth:`~ShardCheckpointState.restore_sections`, the column segments and
:meth:`~ShardCheckpointState.load_state`; a reshard re-inserts trajectories and gives them back their
history with :meth:`~ShardCheckpointState.restore_history`. The file format is
:mod:`gear_mpi.checkpoint`'s; everything here is local (no communication).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import StaleKeyError
from ..kernels import ring
from ..keys import TAG_MASK, as_key_array


class ShardCheckpointState:
    """The checkpoint state of one shard: exports it and takes it back. The shard's counters
    (``samples_drawn``, ``stale_updates``) stay the shard's: :meth:`state` is given them and
    :meth:`load_state` returns them. Each method is documented where the shard exposes it
    (:class:`~gear_mpi.shard.Shard`). Local; not thread-safe.

    Args:
        store: the shard's :class:`~gear_mpi.storage.store.TrajectoryStore` (rank, capacity, tag, table, steps).
        index: its priority index, or None.
        selector: its selector (named when a saved index does not fit it).
        rng: its random stream (its state is saved and set in place).
    """

    def __init__(self, store, index, selector, rng: np.random.Generator):
        self.store = store
        self.index = index
        self.selector = selector
        self.rng = rng

    @property
    def index_kind(self) -> str:
        """The priority index's ``KIND`` (``"blocked"`` host, ``"generic"`` device), or ``"none"``. O(1)."""
        return "none" if self.index is None else self.index.KIND

    def state(self, samples_drawn: int, stale_updates: int) -> dict[str, Any]:
        """:meth:`Shard.state <gear_mpi.shard.Shard.state>`, given the shard's counters. O(1)."""
        s = self.store.state
        return {"rank": self.store.rank, "capacity_steps": self.store.capacity, "max_items": self.store.max_items,
                "hwm": int(s[ring.NEXT_FRESH]), "ring": [int(v) for v in s[:ring.STATE_SIZE]], "index": self.index_kind,
                "rng": self.rng.bit_generator.state, "samples_drawn": int(samples_drawn),
                "stale_updates": int(stale_updates), "tag": int(self.store.tag)}

    def load_state(self, state: Mapping[str, Any]) -> tuple[int, int]:
        """:meth:`Shard.load_state <gear_mpi.shard.Shard.load_state>`: sets the stream and the key tag. O(1).

        Returns:
            The counters to give the shard back: ``(samples_drawn, stale_updates)``.
        Raises:
            KeyError, TypeError, ValueError: a field is missing or the stream's state is invalid.
        """
        self.rng.bit_generator.state = state["rng"]
        counters = int(state["samples_drawn"]), int(state["stale_updates"])
        self.store.tag = int(state["tag"]) & TAG_MASK
        return counters

    def sections(self) -> list[tuple[str, np.ndarray]]:
        """:meth:`Shard.sections <gear_mpi.shard.Shard.sections>`. O(1) (host index), O(hwm) (device index)."""
        out = list(self.store.table_sections())
        if self.index is not None:
            out += self.index.sections(int(self.store.state[ring.NEXT_FRESH]))
        return out

    def restore_sections(self, state: Mapping[str, Any], sections: Mapping[str, np.ndarray]) -> None:
        """:meth:`Shard.restore_sections <gear_mpi.shard.Shard.restore_sections>`. O(hwm).

        Raises:
            ValueError: a section missing or misshapen, counters that do not fit, or an index
                kind that does not fit the selector.
        """
        if (state["index"] == "none") != (self.index is None):
            raise ValueError(f"priority index {state['index']!r} does not fit the sampler {self.selector!r}")
        self.store.restore_table(np.asarray(state["ring"], np.int64), sections)
        if self.index is not None:
            given = sections if state["index"] == self.index.KIND else {"leaves": sections.get("leaves")}
            self.index.restore(given, int(state["hwm"]))

    def column_segments(self, name: str) -> list[np.ndarray]:
        """:meth:`Shard.column_segments <gear_mpi.shard.Shard.column_segments>`. O(1).

        Raises:
            KeyError: no column ``name``.
        """
        return self.store.step_segments(name)

    def live_keys(self) -> np.ndarray:
        """:meth:`Shard.live_keys <gear_mpi.shard.Shard.live_keys>`. O(slots used)."""
        return self.store.keys_of(self.store.live_slots())

    def restore_history(self, keys: Any, stamps: Any, times_sampled: Any) -> None:
        """:meth:`Shard.restore_history <gear_mpi.shard.Shard.restore_history>`. O(n).

        Raises:
            TypeError, InvalidKeyError, StaleKeyError: keys not integers; of another shard or replay; gone.
        """
        keys = as_key_array(keys)
        slots, live = self.store.resolve(keys)
        if not live.all():
            raise StaleKeyError(f"key {int(keys[np.flatnonzero(~live)[0]])}: its trajectory is gone")
        self.store.layout.set_stamps(slots, np.asarray(stamps, np.int64))
        if self.store.counts_uses:  # a store without a use limit does not count uses
            self.store.times_sampled[slots] = np.asarray(times_sampled, np.int64)
