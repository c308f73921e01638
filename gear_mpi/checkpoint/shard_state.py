"""A shard's own state for checkpoints: what :class:`~gear_mpi.shard.Shard` hands out and takes back.

:class:`ShardState` is a mixin that :class:`~gear_mpi.shard.Shard` inherits. A
save reads :meth:`~ShardState.state` (streams, counters, tag), :meth:`~ShardState.sections`
(the trajectory table and the priority index) and :meth:`~ShardState.column_segments`
(the ring steps in use); an exact load puts them back into a new, empty shard
with :meth:`~ShardState.restore_sections`, the column segments and
:meth:`~ShardState.load_state`; a reshard re-inserts trajectories and gives them
back their history with :meth:`~ShardState.restore_history`. The file format is
:mod:`gear_mpi.checkpoint`'s; everything here is local (no communication).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import StaleKeyError
from ..kernels import ring
from ..keys import TAG_MASK, as_key_array


class ShardState:
    """The checkpoint state of a shard (mixed into :class:`~gear_mpi.shard.Shard`).

    It reads the shard's ``store`` (a :class:`~gear_mpi.storage.store.TrajectoryStore`),
    ``index`` (a priority index or None), ``selector``, ``rng``, ``samples_drawn``,
    ``stale_updates``, ``rank``, ``capacity_steps`` and ``tag``.
    """

    @property
    def index_kind(self) -> str:
        """The priority index's ``KIND`` (``"blocked"`` host, ``"generic"`` device), or ``"none"``. O(1)."""
        return "none" if self.index is None else self.index.KIND

    def state(self) -> dict[str, Any]:
        """Everything this shard holds besides its arrays, JSON-able. O(1); local.

        Returns:
            ``rank``, ``capacity_steps``, ``max_items``, ``hwm`` (slots ever used), ``ring``
            (the ``ring.STATE_SIZE`` counters), ``index`` (:attr:`index_kind`), ``rng``
            (the stream's state), ``samples_drawn``, ``stale_updates``, ``tag`` (key tag).
        """
        s = self.store.state
        return {"rank": self.rank, "capacity_steps": self.capacity_steps, "max_items": self.store.max_items,
                "hwm": int(s[ring.NEXT_FRESH]), "ring": [int(v) for v in s[:ring.STATE_SIZE]], "index": self.index_kind,
                "rng": self.rng.bit_generator.state, "samples_drawn": int(self.samples_drawn),
                "stale_updates": int(self.stale_updates), "tag": int(self.tag)}

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Take back the stream, counters and key tag of a :meth:`state` (the table and index
        come back through :meth:`restore_sections`). O(1); local.

        Args:
            state: as :meth:`state` returns it (``rng``, ``samples_drawn``, ``stale_updates``, ``tag``).
        Raises:
            KeyError, TypeError, ValueError: a field is missing or the stream's state is invalid.
        """
        self.rng.bit_generator.state = state["rng"]
        self.samples_drawn = int(state["samples_drawn"])
        self.stale_updates = int(state["stale_updates"])
        self.store.tag = int(state["tag"]) & TAG_MASK

    def sections(self) -> list[tuple[str, np.ndarray]]:
        """The table in use then the priority index, as ``(name, array)`` pairs in checkpoint order.

        Returns:
            The store's ``table_sections()`` then the index's ``sections(hwm)``. Views where
            possible (write them out before the shard changes). Cost: O(1) for a host index;
            a device index copies ``hwm`` weights to the host. Local.
        """
        out = list(self.store.table_sections())
        if self.index is not None:
            out += self.index.sections(int(self.store.state[ring.NEXT_FRESH]))
        return out

    def restore_sections(self, state: Mapping[str, Any], sections: Mapping[str, np.ndarray]) -> None:
        """Put :meth:`sections` back into this new, empty shard of the same sizes; then load the
        steps through :meth:`column_segments`. O(hwm); local.

        Args:
            state: the saved shard's :meth:`state` (``ring``, ``hwm``, ``index`` are used).
            sections: the sections by name (the order ring as one array, oldest first); an
                index of another kind than this shard's is rebuilt from ``leaves``.
        Raises:
            ValueError: a section missing or misshapen, counters that do not fit, or an index
                kind that does not fit this shard's selector.
        """
        if (state["index"] == "none") != (self.index is None):
            raise ValueError(f"priority index {state['index']!r} does not fit the sampler {self.selector!r}")
        self.store.restore_table(np.asarray(state["ring"], np.int64), sections)
        if self.index is not None:
            given = sections if state["index"] == self.index.KIND else {"leaves": sections.get("leaves")}
            self.index.restore(given, int(state["hwm"]))

    def column_segments(self, name: str) -> list[np.ndarray]:
        """Column ``name``'s ring steps in use as flat byte views, oldest first: read to save,
        filled to load after :meth:`restore_sections`. O(1); local.

        Args:
            name: a column of the spec.
        Returns:
            At most two uint8 views (the ring wraps), ``steps_used * step_bytes`` bytes in all.
        Raises:
            KeyError: no column ``name``.
        """
        return self.store.step_segments(name)

    def live_keys(self) -> np.ndarray:
        """The keys of the live trajectories, oldest first. O(slots used); local.

        Returns:
            int64 keys, one per live trajectory.
        """
        return self.store.keys_of(self.store.live_slots())

    def restore_history(self, keys: Any, stamps: Any, times_sampled: Any) -> None:
        """Give trajectories re-inserted by a reshard their insertion stamps and use counts. O(n); local.

        Args:
            keys: this shard's keys of the re-inserted trajectories (int, sequence, array or tensor).
            stamps: each one's original insertion time (ns, int64).
            times_sampled: each one's original use count.
        Raises:
            TypeError: the keys are not integers.
            InvalidKeyError: a key of another shard or replay.
            StaleKeyError: a key whose trajectory is gone.
        """
        keys = as_key_array(keys)
        slots, live = self.store.resolve(keys)
        if not live.all():
            raise StaleKeyError(f"key {int(keys[np.flatnonzero(~live)[0]])}: its trajectory is gone")
        self.store.stamp[slots] = np.asarray(stamps, np.int64)
        if self.store.counts_uses:  # a store without a use limit does not count uses
            self.store.times_sampled[slots] = np.asarray(times_sampled, np.int64)
