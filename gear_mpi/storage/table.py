"""The trajectory table's memory layout: row dtypes chosen from a shard's ranges, and :class:`TableLayout`,
the table a store holds: its rows, its raw priorities and its checkpoint sections.

A shard's table costs a few bytes per slot (:func:`bytes_per_slot`; 10 for one-step items in a
ring of up to 2**32 steps, plus 8 for the insertion stamp under ``Fifo``/``Lifo``, plus the raw
priorities when the priority index cannot give them back), because each row takes the narrowest type
its range allows, fixed at construction, and a row that can be derived is not stored:

- ``start`` uint32 while the ring has at most 2**32 steps, else int64;
- ``length`` uint8 / uint16 / uint32 / int64, the narrowest that holds ``spec.max_length``; not stored
  at all (one element seen through a zero stride) when every trajectory is one step;
- ``status`` uint16: the generation (modulo ``2**keys.GEN_BITS``, exactly the bits a key carries, so
  keys behave as with a wider counter) and the alive code (:mod:`~gear_mpi.kernels.ring`);
- ``stamp`` int64 (ns insertion time) only for the selectors that merge shards by it (``Fifo``, ``Lifo``:
  :func:`stamps_per_item`); every other table keeps its stamps along the insertion order in a
  :class:`~gear_mpi.storage.stamps.StampLog` (one anchor per insert, bounded at 16 bytes per 64 slots),
  the row then one element seen through a zero stride;
- ``times_sampled`` uint32 (int64 above 2**32 - 1 uses) only when ``max_times_sampled`` is set:
  without a limit, uses are not counted (a checkpoint then holds zeros);
- ``order`` int32 (a shard has at most ``keys.MAX_SLOTS`` = 2**27 slots);
- the free-slot stack is linked through the free slots' ``start`` entries, the insertion sequence is
  each trajectory's place in the order ring: neither is stored;
- ``priority`` float64 only where the index cannot give it back: a :class:`~gear_mpi.selection.selectors.Prioritized`
  index holds ``p ** alpha`` (alpha > 0) rounded to float32, so ``p`` is read back as ``leaf ** (1 / alpha)``
  (:class:`DerivedPriority`, within float32 precision of the value set); ordered selectors, ``Uniform`` and
  alpha 0 keep the row.

Checkpoints keep the old section names (``ring.TABLE_ROWS`` then ``order`` and ``free``), each in its
row's type here (derived ones computed at save: :meth:`TableLayout.sections`); a load
(:meth:`TableLayout.restore`) casts whatever integer types were saved (format 2 and 3 tables are int64).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np
from numba import njit

from ..kernels import ring
from ..kernels.weights import leaf_weights
from ..keys import GEN_MASK
from .arenas import anonymous_pages
from .stamps import StampLog

_ROW_STAGGER = 320  # bytes: rows at k * 320 past a page boundary all fall in different 4 KiB offsets
_STAMP_DTYPE = np.dtype(np.int64)


def _narrowest(limit: int) -> np.dtype:
    """The narrowest of uint8, uint16, uint32, int64 holding ``limit``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if limit <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


def row_types(capacity_steps: int, max_items: int, max_length: int, max_times_sampled: int,
              stamp_row: bool = True) -> dict:
    """The table's arrays for these ranges: name -> (entries allocated, dtype, broadcast). O(1).

    Args:
        capacity_steps: ring steps.
        max_items: table slots.
        max_length: the spec's longest trajectory.
        max_times_sampled: uses before removal (0: not counted).
        stamp_row: whether each slot keeps its insertion stamp (False: a :class:`~gear_mpi.storage.stamps.StampLog`
            holds them, one per insert; :func:`stamps_per_item`).
    Returns:
        ``ring.TABLE_FIELDS`` in order; ``broadcast`` rows are one element seen ``max_items`` times.
    """
    start = np.dtype(np.uint32) if max(capacity_steps, max_items) <= 2 ** 32 - 1 else np.dtype(np.int64)
    times = np.dtype(np.uint32) if max_times_sampled <= 2 ** 32 - 1 else np.dtype(np.int64)
    one_step = max_length == 1
    return {"start": (max_items, start, False),
            "length": (1 if one_step else max_items, _narrowest(max_length), one_step),
            "status": (max_items, np.dtype(np.uint16), False),
            "stamp": (max_items if stamp_row else 1, _STAMP_DTYPE, not stamp_row),
            "times_sampled": (max_items if max_times_sampled else 1, times, not max_times_sampled),
            "order": (max_items, np.dtype(np.int32), False),
            "state": (ring.STATE_LEN, np.dtype(np.int64), False)}


def bytes_per_slot(capacity_steps: int, max_items: int, max_length: int, max_times_sampled: int = 0,
                   priority_row: bool = True, stamp_row: bool = True) -> int:
    """Table bytes per slot for these ranges (the priority index's are apart). O(1).

    Args:
        capacity_steps, max_items, max_length, max_times_sampled, stamp_row: as for :func:`row_types`.
        priority_row: whether raw priorities are stored (8 bytes).
    Returns:
        The bytes.
    """
    rows = row_types(capacity_steps, max_items, max_length, max_times_sampled, stamp_row)
    per = sum(dt.itemsize for name, (_, dt, bc) in rows.items() if name != "state" and not bc)
    return per + (8 if priority_row else 0)


def _staggered(count: int, dtype, k: int) -> np.ndarray:
    """A zeroed row of ``count`` entries starting ``k * _ROW_STAGGER`` bytes past a page boundary.

    Big allocations all start at the same offset within a page, so the kernels that walk many rows
    at once (``ring.plan_insert`` writes 6) would touch addresses 4 KiB apart, all in one L1 cache
    set: staggering the rows made a 1e7-item insert's table pass about 3x faster. O(1) (the pages are
    committed when first written). Big rows come from an anonymous mapping (zero pages, unmapped when
    the last view goes; huge pages as ``memory.PrivateArena.huge_pages`` says), not numpy's allocator.
    """
    itemsize = np.dtype(dtype).itemsize
    nbytes = count * itemsize + 4096
    if nbytes >= 1 << 20:
        raw = np.frombuffer(anonymous_pages(nbytes), np.uint8)
    else:
        raw = np.zeros(nbytes, np.uint8)
    skip = (k * _ROW_STAGGER - raw.ctypes.data) % 4096
    return raw[skip:skip + count * itemsize].view(dtype)


def build(rows: dict, max_items: int, carved: Mapping[str, np.ndarray] | None = None) -> ring.Table:
    """The table's arrays: staggered zeroed rows, or views of ``carved`` (a file's, by name). O(1).

    Args:
        rows: :func:`row_types`' answer.
        max_items: table slots (the length of a broadcast row as seen).
        carved: name -> array already laid out (``file_memory.carve`` of ``{name: (count, dtype)}``).
    Returns:
        The :class:`~gear_mpi.kernels.ring.Table`.
    """
    arrays = {}
    for k, (name, (count, dtype, broadcast)) in enumerate(rows.items()):
        if carved is not None:
            arr = carved[name]
        elif name == "state" or broadcast:
            arr = np.zeros(count, dtype)
        else:
            arr = _staggered(count, dtype, k)
        if broadcast:  # one value for every slot: writes land on that one element
            arr[0] = 1 if name == "length" else 0
            arr = np.lib.stride_tricks.as_strided(arr, shape=(max_items,), strides=(0,), writeable=True)
        arrays[name] = arr
    return ring.Table(**arrays)


def _priority_row(max_items: int) -> np.ndarray:
    """A zeroed float64 row of raw priorities (staggered like the table's rows). O(1)."""
    return _staggered(max_items, np.float64, len(ring.TABLE_FIELDS))


def stored_fields(rows: dict, max_items: int, priority_row: bool) -> dict[str, tuple[int, np.dtype]]:
    """What the table stores: name -> (entries, dtype), the raw priorities' row included where kept -- what a
    file holding the table must carve (``file_arenas.carve``), and its bytes. O(1).

    Args:
        rows: :func:`row_types`' answer.
        max_items: table slots.
        priority_row: whether raw priorities are kept in a row.
    """
    fields = {name: (count, dtype) for name, (count, dtype, _) in rows.items()}
    if priority_row:
        fields["priority"] = (max_items, np.dtype(np.float64))
    return fields


@njit(cache=True, nogil=True)
def all_equal(values, v):
    """Whether every ``values[i] + 0.0`` equals ``v`` (so -0.0 counts as +0.0). O(n), stops at the first other."""
    for i in range(values.shape[0]):
        if values[i] + 0.0 != v:
            return False
    return True


_NEAR = 3  # float32 patterns tried on each side of w ** (1 / alpha)
_F32_INF_BITS = 0x7F800000  # the bits of float32 inf: patterns below it (and >= 0) are finite non-negative


def _trailing_zeros(bits: np.ndarray) -> np.ndarray:
    """The trailing zero bits of each int64 (64 for 0). O(n)."""
    low = bits & -bits  # the lowest set bit
    out = np.full(len(bits), 64, np.int64)
    nz = low != 0
    out[nz] = np.log2(low[nz].astype(np.float64)).astype(np.int64)
    return out


class DerivedPriority:
    """Raw priorities read back from a priority index holding ``leaf_value(p ** alpha)`` (alpha > 0; float32
    leaves, :func:`~gear_mpi.kernels.priority_tree.leaf_value`): ``p`` is a value whose weight is the leaf,
    within float32 precision of what was set (about ``2**-24 / alpha`` relative; a priority with a short
    mantissa, such as 0.5 or 3, reads back exactly). Indexed like the row it replaces; writes are ignored
    (the index is set by the shard).

    Args:
        index: the shard's priority index (``weights_of``, ``host_leaves``).
        alpha: the selector's exponent.
    """

    def __init__(self, index, alpha: float):
        self.index = index
        self.alpha = float(alpha)
        self.inverse = 1.0 / self.alpha

    def _held(self, priorities: np.ndarray) -> np.ndarray:
        """The leaf each priority gives: ``leaf_value(power_weights(p))``, as the shard sets it."""
        return leaf_weights(priorities, self.alpha)  # (a float64 contiguous copy where it is not one)

    def _raw(self, weights: np.ndarray) -> np.ndarray:
        """The priorities whose held weight (``leaf_value`` of ``p ** alpha`` as the selector computes it:
        :func:`~gear_mpi.kernels.weights.power_weights`, the C library's ``pow``) is the leaf ``w``: of the
        float32 values next to ``w ** (1 / alpha)`` that give ``w`` back, the one with the shortest
        mantissa (so a priority set as 0.5 or 0.625 reads back exactly). Reading back, setting again (a
        reshard re-inserts them) and reading back again gives the very same weight and value. O(n):
        2 * _NEAR + 1 powers per value; the float64 guess itself, or a bisection (about 40 steps), for
        the rare value with no float32 neighbour that fits (weights clamped at float32's ends, alpha > 1)."""
        w = np.asarray(weights, np.float64)
        if self.inverse == 1.0:
            return w.copy()  # the leaf is leaf_value(p): its own preimage
        with np.errstate(over="ignore", under="ignore", invalid="ignore"):
            p = np.power(w, self.inverse)
            guess = p.astype(np.float32).view(np.int32).astype(np.int64)  # positive floats sort as their bits
            best = np.full(len(w), -1, np.int64)
            best_zeros = np.full(len(w), -1, np.int64)
            for d in range(-_NEAR, _NEAR + 1):
                cand = guess + d
                ok = (cand >= 0) & (cand < _F32_INF_BITS)
                values = np.where(ok, cand, 0).astype(np.int32).view(np.float32).astype(np.float64)
                hit = ok & (self._held(values) == w)
                zeros = _trailing_zeros(cand)
                take = hit & (zeros > best_zeros)
                best = np.where(take, cand, best)
                best_zeros = np.where(take, zeros, best_zeros)
            found = best >= 0
            out = p.copy()
            out[found] = best[found].astype(np.int32).view(np.float32).astype(np.float64)
            rest = np.flatnonzero(~found & (w > 0) & np.isfinite(p))
            if len(rest):
                bad = rest[self._held(p[rest]) != w[rest]]
                if len(bad):
                    out[bad] = self._bisect(p[bad], w[bad])
        return out

    def _bisect(self, p: np.ndarray, target: np.ndarray) -> np.ndarray:
        """The smallest value within 1e-6 of ``p`` whose held weight reaches ``target`` (``p`` where none is equal)."""
        lo = (p * (1 - 1e-6)).view(np.int64)
        hi = (p * (1 + 1e-6)).view(np.int64)
        while True:
            go = lo < hi
            if not go.any():
                break
            mid = lo + (hi - lo) // 2
            below = self._held(mid.view(np.float64)) < target
            lo = np.where(go & below, mid + 1, lo)
            hi = np.where(go & ~below, mid, hi)
        found = lo.view(np.float64)
        return np.where(self._held(found) == target, found, p)

    def __getitem__(self, slots) -> np.ndarray:
        if isinstance(slots, slice) and slots.start in (None, 0) and slots.step in (None, 1) and slots.stop is not None:
            return self._raw(self.index.host_leaves(slots.stop))
        if isinstance(slots, np.ndarray) and slots.dtype == np.bool_:
            slots = np.flatnonzero(slots)
        return self._raw(self.index.weights_of(slots))

    def __setitem__(self, slots, values) -> None:
        pass


def stamps_per_item(selector) -> bool:
    """Whether ``selector`` needs each trajectory's own insertion stamp (``Fifo``, ``Lifo``: shards are merged by
    it); every other selector's table keeps them in a :class:`~gear_mpi.storage.stamps.StampLog`. O(1)."""
    from ..selection.selectors import Fifo, Lifo
    return isinstance(selector, (Fifo, Lifo))


def derives_priority(selector) -> bool:
    """Whether ``selector``'s index gives raw priorities back (a ``Prioritized`` with alpha > 0). O(1)."""
    from ..selection.selectors import Prioritized
    return type(selector) is Prioritized and selector.alpha > 0


def _fits(got: np.ndarray, dtype: np.dtype) -> bool:
    """Whether a saved section of ``got``'s dtype may be cast to a row of ``dtype``."""
    if dtype.kind == "f":
        return got.dtype == np.float64
    return got.dtype.kind in "iu" and got.dtype.itemsize <= 8


class TableLayout:
    """A store's trajectory table laid out for its ranges: the rows (:func:`row_types`, in the narrowest types
    the ranges allow), the raw priorities, and the sections a checkpoint saves and loads.

    The raw priorities are a row (``priority``), or a :class:`DerivedPriority` the shard sets (its index
    gives them back), or None (not kept); a row may stand for one value shared by every slot below the
    high-water mark without being written (``priority_constant``; see :meth:`keep_priorities`).
    Local; not thread-safe (nor is the store).

    Args:
        capacity_steps: ring steps; max_items: table slots; max_length: the spec's longest trajectory;
            max_times_sampled: uses before removal (0: not counted) -- as for :func:`row_types`.
        priority_row: whether to keep raw priorities in a row.
        stamp_row: whether to keep each slot's insertion stamp in a row (False: ``stamp_log``, a
            :class:`~gear_mpi.storage.stamps.StampLog`, one anchor per insert, bounded).
        lazy_priority: whether that row may stand for one value (for selectors whose draws ignore raw
            priorities: a batch at one priority writes no row).
        carved: name -> array laid out in a file (``file_arenas.carve`` of :func:`stored_fields`), or None:
            staggered rows in memory, committed as slots are first used.
    Attributes:
        rows: the :class:`~gear_mpi.kernels.ring.Table`; arrays: the same as a plain tuple (what the kernels
            get: it dispatches faster); nbytes: the table's bytes; priority, priority_constant: as above;
            stamp_log: None, or the :class:`~gear_mpi.storage.stamps.StampLog` standing for the stamp row.
    """

    def __init__(self, capacity_steps: int, max_items: int, max_length: int, max_times_sampled: int = 0,
                 priority_row: bool = True, lazy_priority: bool = False,
                 carved: Mapping[str, np.ndarray] | None = None, stamp_row: bool = True):
        self.capacity = int(capacity_steps)
        self.max_items = int(max_items)
        self.max_length = int(max_length)
        types = row_types(self.capacity, self.max_items, self.max_length, int(max_times_sampled), stamp_row)
        # None: the stamp row holds each slot's stamp; else the anchors that stand for them
        self.stamp_log = None if stamp_row else StampLog(self.max_items)
        self.nbytes = sum(c * np.dtype(d).itemsize for c, d in stored_fields(types, self.max_items,
                                                                              priority_row).values())
        self.rows = build(types, self.max_items, carved)
        self.arrays = tuple(self.rows)
        self.priority = (carved["priority"] if carved is not None else _priority_row(self.max_items)) \
            if priority_row else None
        # None: the row holds every slot's raw priority. A float: every slot below the high-water mark has
        # this raw priority and the row is not kept up to date (keep_priorities, raw_priorities)
        self.priority_constant = 0.0 if lazy_priority and priority_row else None

    def release(self) -> ring.Table:
        """Point the rows at empty arrays and return them as the new table. O(fields).

        A file-backed table (``memory="file"``) is a mapping of an unlinked file: its disk space is
        freed only when the last array over it goes. A closed store calls this so that it goes at
        close, not when the store itself is collected.
        """
        self.rows = self.rows._make(np.empty(0, a.dtype) for a in self.rows)
        self.arrays = tuple(self.rows)
        if isinstance(self.priority, np.ndarray):
            self.priority = np.empty(0, self.priority.dtype)
        return self.rows

    # ---- a priority row that stands for one value ---------------------------------------------
    def keep_priorities(self, priorities: np.ndarray) -> bool:
        """Whether a batch's raw priorities must be written into ``priority`` (asked before its table pass).

        While ``priority_constant`` is set (the row stands for that one value, unwritten) and the batch's
        priorities all equal it, nothing is written (a table that has never held a slot takes the batch's
        value as its constant); a batch of another value or of several values first writes the constant into
        the row below the high-water mark (:meth:`materialize_priorities`, once) and then writes its own.

        Args:
            priorities: the batch's validated raw priorities (float64; one shared by all as a stride-0 array).
        Returns:
            True: write them into the row; False: the row stands for them.
        Cost: O(1) for a shared priority, else one pass over them; O(high-water mark) once when the row is
        materialized.
        """
        c = self.priority_constant
        if c is None or len(priorities) == 0:
            return c is None
        v = float(priorities[0]) + 0.0
        if priorities.strides == (0,) or all_equal(priorities, v):
            if v == c:
                return False
            if int(self.rows.state[ring.NEXT_FRESH]) == 0:  # no slot ever used: nothing holds the old value
                self.priority_constant = v
                return False
        self.materialize_priorities()
        return True

    def materialize_priorities(self) -> None:
        """Write ``priority_constant`` into the row below the high-water mark and keep the row up to date
        from now on. O(high-water mark) once; O(1) after."""
        c = self.priority_constant
        if c is not None:
            self.priority[:int(self.rows.state[ring.NEXT_FRESH])] = c
            self.priority_constant = None

    def raw_priorities(self, slots: np.ndarray) -> np.ndarray:
        """The raw priorities of ``slots`` (float64, a new array; any value for a free slot). O(len(slots))."""
        if self.priority_constant is not None:
            return np.full(len(slots), self.priority_constant)
        return np.asarray(self.priority[slots], np.float64)

    def set_stamps(self, slots: np.ndarray, stamps: np.ndarray) -> None:
        """Give ``slots`` (live) the insertion stamps ``stamps`` (ns): into the row, or the log's anchors
        (one per run of equal stamps). O(len(slots)) with a row, else O(high-water mark)."""
        stamps = np.asarray(stamps, np.int64)
        if self.stamp_log is None:
            self.rows.stamp[slots] = stamps
            return
        t = self.rows
        seq = ring.seq_numbers(t.state, t.order, int(t.state[ring.NEXT_FRESH]))
        self.stamp_log.assign(seq[np.asarray(slots, np.int64)], np.broadcast_to(stamps, (len(slots),)),
                              int(t.state[ring.NEXT_SEQ] - t.state[ring.ORDER_COUNT]))

    def record_stamp(self, first_seq: int, now: int) -> None:
        """After an insert that took the sequence numbers from ``first_seq`` on, at ``now``: an anchor where
        the log wants one (nothing with a stamp row). O(1) amortized."""
        if self.stamp_log is not None:
            state = self.rows.state
            end = int(state[ring.NEXT_SEQ])
            self.stamp_log.record(int(first_seq), end, int(now), end - int(state[ring.ORDER_COUNT]))

    def written_rows(self) -> list[np.ndarray]:
        """The per-slot rows that inserts write (a row standing for one value left out), and the raw
        priorities' where kept. O(1)."""
        rows = [a for a in self.rows if a.strides[0]]
        if isinstance(self.priority, np.ndarray) and self.priority_constant is None:
            rows.append(self.priority)
        return rows

    # ---- checkpoint sections ------------------------------------------------------------------
    def sections(self) -> list[tuple[str, np.ndarray]]:
        """The table in use as (name, array) pairs, in the checkpoint's order (see
        :meth:`~gear_mpi.storage.store.TrajectoryStore.table_sections`). O(hwm): the derived rows are computed."""
        t = self.rows
        hwm = int(t.state[ring.NEXT_FRESH])
        status = t.status[:hwm]
        seq = ring.seq_numbers(t.state, t.order, hwm)
        rows = {"start": t.start[:hwm],
                "length": t.length[:hwm] if t.length.strides[0] else np.ones(hwm, t.length.dtype),
                "priority": self.raw_priorities(np.arange(hwm)) if self.priority_constant is not None
                else np.ascontiguousarray(self.priority[:hwm], np.float64),
                "generation": (status & GEN_MASK).astype(np.uint16),
                "seq": seq, "stamp": t.stamp[:hwm] if self.stamp_log is None
                else np.where(status >> ring.ALIVE_SHIFT == ring.DEAD, 0, self.stamp_log.stamps_of(seq)),
                "times_sampled": t.times_sampled[:hwm] if t.times_sampled.strides[0]
                else np.zeros(hwm, t.times_sampled.dtype),
                "alive": (status >> ring.ALIVE_SHIFT).astype(np.uint8)}
        out = [(name, rows[name]) for name in ring.TABLE_ROWS]
        for a, b in ring.ring_segments(int(t.state[ring.ORDER_HEAD]), int(t.state[ring.ORDER_COUNT]), self.max_items):
            out.append(("order", t.order[a:b]))
        out.append(("free", ring.free_stack(t.state, t.start).astype(np.int32)))
        return out

    def restore(self, state: np.ndarray, given: Mapping[str, np.ndarray]) -> None:
        """Load saved sections (see :meth:`~gear_mpi.storage.store.TrajectoryStore.restore_table`). O(hwm).

        Raises:
            ValueError: a section missing or of the wrong length or type, values out of this table's range,
                or counters that do not fit.
        """
        state = np.asarray(state)
        if state.shape not in ((ring.STATE_SIZE,), (ring.STATE_LEN,)) or state.dtype.kind not in "iu":
            raise ValueError(f"section 'state' has {state.shape} x {state.dtype}, expected "
                             f"({ring.STATE_SIZE},) x int64")
        state = state[:ring.STATE_SIZE].astype(np.int64)  # the free stack's top is rebuilt from ``free``
        cap, m = self.capacity, self.max_items
        hwm, o_head, o_count = int(state[ring.NEXT_FRESH]), int(state[ring.ORDER_HEAD]), int(state[ring.ORDER_COUNT])
        if not (0 <= hwm <= m and 0 <= o_head < m and 0 <= o_count <= hwm and 0 <= state[ring.FREE_TOP] <= hwm
                and 0 <= state[ring.STEP_HEAD] < cap and 0 <= state[ring.STEPS_USED] <= cap):
            raise ValueError(f"section 'state' {state.tolist()} does not fit a store of capacity_steps={cap}, "
                             f"max_items={m}")
        t = self.rows
        expect = {"start": t.start.dtype, "length": t.length.dtype, "priority": np.dtype(np.float64),
                  "generation": np.dtype(np.uint16), "seq": np.dtype(np.int64), "stamp": t.stamp.dtype,
                  "times_sampled": t.times_sampled.dtype, "alive": np.dtype(np.uint8)}
        counts = {name: hwm for name in ring.TABLE_ROWS}
        counts["order"], counts["free"] = o_count, int(state[ring.FREE_TOP])
        expect["order"] = expect["free"] = np.dtype(np.int32)
        got = {}
        for name, count in counts.items():
            arr = given.get(name)
            if arr is None and count == 0 and name == "order":  # an empty order ring is saved as no section
                arr = np.empty(0, expect[name])
            if arr is None:
                raise ValueError(f"section {name!r} is missing")
            arr = np.asarray(arr)
            if arr.shape != (count,) or not _fits(arr, expect[name]):
                raise ValueError(f"section {name!r} has {arr.shape} x {arr.dtype}, expected ({count},) x {expect[name]}")
            got[name] = arr
        alive = got["alive"].astype(np.int64)
        live = alive != ring.DEAD
        bounds = {"start": cap - 1, "length": self.max_length, "order": hwm - 1, "free": hwm - 1,
                  "alive": ring.REMOVED, "times_sampled": np.iinfo(t.times_sampled.dtype).max}
        for name, top in bounds.items():
            vals = got[name][live] if name in ("start", "length") else got[name]  # a dead slot's start is a link
            if len(vals) and (int(vals.min()) < 0 or int(vals.max()) > top):
                raise ValueError(f"section {name!r} holds values outside [0, {top}]")
        if t.length.strides[0] == 0 and len(got["length"][live]) and int(got["length"][live].min()) < 1:
            raise ValueError("section 'length' holds values outside [1, 1]")
        old_hwm = int(t.state[ring.NEXT_FRESH])
        t.start[:hwm] = got["start"]
        t.start[hwm:old_hwm] = 0
        if t.length.strides[0]:
            t.length[:hwm] = got["length"]
            t.length[hwm:old_hwm] = 0
        t.status[:hwm] = (got["generation"].astype(np.int64) & GEN_MASK) | (alive << ring.ALIVE_SHIFT)
        t.status[hwm:old_hwm] = 0
        if self.stamp_log is None:
            t.stamp[:hwm] = got["stamp"]
            t.stamp[hwm:old_hwm] = 0
        else:  # one anchor per run of equal stamps along the trajectories in the order ring
            held = np.asarray(got["order"], np.int64)
            self.stamp_log.clear()
            self.stamp_log.assign(got["seq"][held], got["stamp"][held], int(state[ring.NEXT_SEQ]) - o_count)
        if t.times_sampled.strides[0]:
            t.times_sampled[:hwm] = got["times_sampled"]
            t.times_sampled[hwm:old_hwm] = 0
        if isinstance(self.priority, np.ndarray):
            if self.priority_constant is not None:  # a row that stood for one value holds the values from now on
                self.priority_constant = None
            self.priority[:hwm] = got["priority"]
            self.priority[hwm:old_hwm] = 0
        t.order[(o_head + np.arange(o_count)) % m] = got["order"]
        t.state[:ring.STATE_SIZE] = state
        ring.link_free(t.state, t.start, np.ascontiguousarray(got["free"], np.int64))
