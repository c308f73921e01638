"""TrajectoryStore: a shard's columnar step ring and its trajectory table.

Columns are packed back to back in a ring of ``capacity_steps`` steps (no padding
is stored); the table holds, per slot, start step, length, priority (float64),
generation, insertion sequence, insertion stamp and times sampled. The oldest
trajectories are evicted (FIFO) when the ring or the table is full.
"""
from __future__ import annotations

import time

import numpy as np

from . import keys as keyspace
from .errors import InvalidKeyError, InvalidTrajectoryError, StaleKeyError
from .kernels import ring
from .memory import SharedArena, column_layout, make_arena, write_header
from .spec import TrajectorySpec

TABLE_BYTES_PER_SLOT = 8 * 8 + 1  # start, length, priority, generation, seq, stamp, times, order + alive


class TrajectoryStore:
    """Step ring + trajectory table of one shard.

    Memory: ``capacity_steps * spec.step_bytes`` for the columns (in the chosen
    arena) plus ``65 * max_items`` bytes of table, committed lazily as slots are
    first used.
    """

    def __init__(self, spec: TrajectorySpec, capacity_steps: int, max_items: int | None = None,
                 memory: str = "numpy", rank: int = 0, tag: int = 0, arena=None):
        if isinstance(capacity_steps, bool) or not isinstance(capacity_steps, (int, np.integer)) or capacity_steps < 1:
            raise ValueError(f"capacity_steps must be a positive integer, got {capacity_steps!r}")
        if capacity_steps < spec.max_length:
            raise ValueError(f"capacity_steps={capacity_steps} is smaller than max_length={spec.max_length}")
        max_items = int(capacity_steps if max_items is None else max_items)
        if not 1 <= max_items <= keyspace.MAX_SLOTS:
            raise ValueError(f"max_items must be in [1, {keyspace.MAX_SLOTS}], got {max_items}")
        if not 0 <= rank < keyspace.MAX_RANKS:
            raise ValueError(f"rank must be in [0, {keyspace.MAX_RANKS}), got {rank}")
        self.spec = spec
        self.capacity = int(capacity_steps)
        self.max_items = max_items
        self.rank = int(rank)
        self.tag = int(tag) & keyspace.TAG_MASK
        self.offsets, nbytes = column_layout(spec, self.capacity)
        self.arena = arena if arena is not None else make_arena(memory, nbytes)
        write_header(self.arena.buffer, spec, self.capacity)
        self.columns: dict[str, np.ndarray] = {}
        self._byte_views: dict[str, np.ndarray] | None = None
        for c in spec.columns:
            raw = self.arena.buffer[self.offsets[c.name]:self.offsets[c.name] + c.step_bytes * self.capacity]
            self.columns[c.name] = raw.view(c.dtype).reshape((self.capacity,) + c.shape)
        m = max_items
        self.start = np.zeros(m, np.int64)
        self.length = np.zeros(m, np.int64)
        self.priority = np.zeros(m, np.float64)
        self.generation = np.zeros(m, np.int64)
        self.seq = np.zeros(m, np.int64)
        self.stamp = np.zeros(m, np.int64)
        self.times_sampled = np.zeros(m, np.int64)
        self.alive = np.zeros(m, np.uint8)
        self.order = np.zeros(m, np.int64)
        self.free = np.zeros(m, np.int64)
        self.state = np.zeros(ring.STATE_SIZE, np.int64)

    # ---- sizes ----------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.state[ring.LIVE_COUNT])

    @property
    def live_steps(self) -> int:
        return int(self.state[ring.LIVE_STEPS])

    @property
    def steps_used(self) -> int:
        return int(self.state[ring.STEPS_USED])

    def byte_views(self) -> dict[str, np.ndarray]:
        """Each column as a flat uint8 array over the whole ring (for the gather kernel); built once."""
        if self._byte_views is None:
            self._byte_views = {
                c.name: self.arena.buffer[self.offsets[c.name]:self.offsets[c.name] + c.step_bytes * self.capacity]
                for c in self.spec.columns}
        return self._byte_views

    # ---- insertion ------------------------------------------------------------------
    def check_batch(self, lengths: np.ndarray) -> None:
        """Raise if a batch of trajectories cannot be stored at once (before anything changes)."""
        total = int(lengths.sum())
        if total > self.capacity:
            raise InvalidTrajectoryError(
                f"insert_many: {len(lengths)} trajectories hold {total} steps, more than capacity_steps={self.capacity}")
        if len(lengths) > self.max_items:
            raise InvalidTrajectoryError(
                f"insert_many: {len(lengths)} trajectories, more than max_items={self.max_items}")

    def insert(self, columns: dict[str, np.ndarray], lengths: np.ndarray, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Store already-validated trajectories whose steps are concatenated in ``columns``.

        Returns (slots of the new trajectories, slots of live trajectories evicted).
        Cost: O(n) table work in a kernel plus one copy of the steps (at most two
        slices per column, for the ring's wrap-around).
        """
        slots = np.empty(len(lengths), np.int64)
        evicted = ring.plan_insert(lengths, time.time_ns(), self.state, self.capacity, self.start, self.length,
                                   self.generation, self.seq, self.stamp, self.times_sampled, self.alive,
                                   self.order, self.free, slots)
        self.priority[slots] = priorities
        total = int(lengths.sum())
        first = int(self.start[slots[0]])
        head = min(total, self.capacity - first)
        for name, data in columns.items():
            dst = self.columns[name]
            dst[first:first + head] = data[:head]
            if head < total:
                dst[:total - head] = data[head:]
        return slots, evicted

    # ---- keys -----------------------------------------------------------------------
    def keys_of(self, slots: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """The keys of ``slots`` (into ``out`` if given). O(B), one kernel."""
        slots = np.ascontiguousarray(slots, np.int64)
        out = np.empty(len(slots), np.int64) if out is None else out
        keyspace.encode_slots(self.tag, self.rank, slots, self.generation, out)
        return out

    def resolve(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Map keys of this shard to slots. Returns (slots, live mask); stale keys are not live.

        Raises InvalidKeyError for a key of another replay or shard, or out of range.
        Cost: O(n), one kernel.
        """
        keys = np.ascontiguousarray(keys, np.int64)
        slot = np.empty(len(keys), np.int64)
        live = np.empty(len(keys), np.bool_)
        if keyspace.resolve_keys(keys, self.tag, self.rank, self.max_items, self.generation, self.alive,
                                 ring.LIVE, slot, live) < 0:
            return slot, live
        tag, rank, gen, slot = keyspace.decode(keys)  # a foreign key: find it again, for the message
        bad = (keys < 0) | (tag != self.tag) | (rank != self.rank) | (slot >= self.max_items)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            k = int(keys[i])
            if k < 0 or int(tag[i]) != self.tag:
                raise InvalidKeyError(f"key {k} was not issued by this replay")
            if int(rank[i]) != self.rank:
                raise InvalidKeyError(f"key {k} belongs to shard {int(rank[i])}, not this shard ({self.rank})")
            raise InvalidKeyError(f"key {k} names slot {int(slot[i])}, but this shard has {self.max_items} slots")
        live = (self.alive[slot] == ring.LIVE) & ((self.generation[slot] & keyspace.GEN_MASK) == gen)
        return slot, live

    def read(self, key: int) -> dict[str, np.ndarray]:
        """A copy of the whole trajectory behind ``key``. Raises StaleKeyError if it is gone."""
        slots, live = self.resolve(np.array([key], np.int64))
        if not live[0]:
            raise StaleKeyError(f"key {key}: its trajectory has been evicted or removed")
        s = int(slots[0])
        start, length = int(self.start[s]), int(self.length[s])
        idx = (start + np.arange(length)) % self.capacity
        return {name: col[idx] for name, col in self.columns.items()}

    def close(self) -> None:
        self.columns = {}
        self._byte_views = None
        if self.arena is not None:
            self.arena.close()
            self.arena = None

    @property
    def shm_name(self) -> str | None:
        return self.arena.name if isinstance(self.arena, SharedArena) else None
