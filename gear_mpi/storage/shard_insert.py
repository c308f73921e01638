"""How trajectories enter a shard: :class:`ShardInserter`, the part of :class:`~gear_mpi.shard.Shard`
its insert methods delegate to.

Every path -- one trajectory, a list of them, packed columns, a writer's staged
episodes (:mod:`gear_mpi.feeds.intake`) -- validates first and then ends in
:meth:`ShardInserter.store_packed`, so a bad trajectory stores nothing. Local: no communication.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
from numba import njit

from .. import keys as keyspace
from ..errors import InvalidTrajectoryError
from ..kernels import ring
from ..selection.priority_index import PriorityIndex
from . import store_insert
from .step_append import StepAppender
from .store_insert import set_inserted_leaves
from ..spec import TrajectorySpec, check_casting, check_finite_columns, validate_priorities


# a host index update of at least 1/REBUILD_FRACTION of its slots writes the leaves and rebuilds the levels
# (O(n), parallel) instead of updating them per slot (O(B), much slower per slot): 1e7 of 1e7, 200 ms -> 60 ms
REBUILD_FRACTION = 8


class ShardInserter:
    """Insertion into one shard: checks trajectories, stores them in the shard's store and sets their
    weights in its priority index. :class:`~gear_mpi.shard.Shard` builds one and its ``insert*`` and
    ``store_packed`` methods delegate here (after checking that the shard is open). Local; not thread-safe.

    Args:
        spec: the shard's trajectory layout.
        store: its :class:`~gear_mpi.storage.store.TrajectoryStore`.
        index: its priority index (None for ordered selectors).
        selector: its selector (the weights of new items).
    """

    def __init__(self, spec: TrajectorySpec, store, index, selector):
        self.spec = spec
        self.store = store
        self.index = index
        self.selector = selector
        self.bytes_inserted = 0  # bytes of the steps ever stored here (all paths; gear_mpi.stats)
        self.appender = StepAppender(self)  # append_step's path

    def insert_many(self, trajectories: Sequence[Mapping[str, Any]], priorities: Any = None,
                    check_finite: bool = False, casting: str = "safe") -> np.ndarray:
        """:meth:`Shard.insert_many <gear_mpi.shard.Shard.insert_many>`: validates each trajectory and the
        priorities (one bad one stores none; ``check_finite``: a NaN or inf too), packs them, then
        :meth:`store_packed`.

        Raises:
            InvalidTrajectoryError, InvalidPriorityError: as the shard's method documents.
        """
        if isinstance(trajectories, Mapping):
            raise InvalidTrajectoryError("insert_many takes a sequence of trajectories; use insert() for one")
        trajectories = list(trajectories)
        n = len(trajectories)
        if n == 0:
            return np.zeros(0, np.int64)
        pr = validate_priorities(np.ones(n) if priorities is None else priorities, n)
        checked = [self.spec.validate(t, where=f"trajectory {i}" if n > 1 else "trajectory", casting=casting)
                   for i, t in enumerate(trajectories)]
        if check_finite:
            for i, (cols, _) in enumerate(checked):
                check_finite_columns(cols, f"trajectory {i}" if n > 1 else "trajectory")
        lengths = np.array([length for _, length in checked], np.int64)
        if n == 1:
            columns = checked[0][0]
        else:
            columns = {c.name: np.concatenate([cols[c.name] for cols, _ in checked]) for c in self.spec.columns}
        return self.store_packed(columns, lengths, pr)

    def insert_packed(self, columns: Mapping[str, Any], lengths: Any, priorities: Any = None,
                      check_finite: bool = False, casting: str = "safe") -> np.ndarray:
        """:meth:`Shard.insert_packed <gear_mpi.shard.Shard.insert_packed>`: checks the lengths, columns and
        priorities (``check_finite``: and the values) in whole-array operations (one bad input stores none),
        then :meth:`store_packed`.

        Raises:
            InvalidTrajectoryError, InvalidPriorityError: as the shard's method documents.
        """
        check_casting(casting)
        lengths, total = checked_lengths(lengths, self.spec.max_length, self.spec.min_length)
        arrays = check_packed_columns(self.spec, columns, total, casting)
        if check_finite:
            check_finite_columns(arrays, "insert_packed", lengths)
        n = len(lengths)
        # None: one shared 1.0 read n times (no n-element array to allocate)
        pr = np.broadcast_to(np.float64(1.0), (n,)) if priorities is None else checked_priorities(priorities, n)
        if n == 0:
            return np.zeros(0, np.int64)
        if total > self.store.capacity or n > self.store.max_items:
            raise InvalidTrajectoryError(
                f"insert_packed: {n} trajectories of {total} steps; one call takes at most capacity_steps="
                f"{self.store.capacity} steps and max_items={self.store.max_items} trajectories: split the batch")
        return self.store_packed(arrays, lengths, pr, steps=total)

    def append_step(self, step: Mapping[str, Any], priority: float = 1.0) -> int:
        """:meth:`Shard.append_step <gear_mpi.shard.Shard.append_step>`: one one-step trajectory, checked per
        column by what a step needs (present, numeric and castable safely, the column's shape with or without a
        leading 1) and nothing more (no lengths, no step counts, no priority array), then stored by
        :class:`~gear_mpi.storage.step_append.StepAppender` (one numba call and an item write per column; the
        general :meth:`store_packed` for a store that path does not cover).

        Raises:
            InvalidTrajectoryError, InvalidPriorityError: as the shard's method documents (nothing stored).
        """
        return self.appender.append(step, priority)

    def store_packed(self, columns: Mapping[str, np.ndarray], lengths: np.ndarray, priorities: np.ndarray,
                     steps: int | None = None) -> np.ndarray:
        """:meth:`Shard.store_packed <gear_mpi.shard.Shard.store_packed>`: the common tail of every insert
        path -- the store's chunked insert, the evicted slots' and new slots' index weights, the keys.
        Cost: as the shard's method documents (temporaries bounded, about 3 MB, whatever the batch).

        Raises:
            InvalidTrajectoryError: more steps than ``capacity_steps`` or more trajectories than ``max_items``
                (nothing is stored).
        """
        steps = int(lengths.sum()) if steps is None else int(steps)
        with self.store.inserting(steps * self.spec.step_bytes):  # (the index work after the store's insert too)
            return self._store_packed(columns, lengths, priorities, steps)

    def _store_packed(self, columns: Mapping[str, np.ndarray], lengths: np.ndarray, priorities: np.ndarray,
                      steps: int) -> np.ndarray:
        store = self.store
        store.check_batch(lengths, steps)
        n = len(lengths)
        out = store_insert.mapped_empty(n)  # the slots, then (in place) the keys returned
        index = self.index
        shared = priorities.strides == (0,)
        host = isinstance(index, PriorityIndex)
        # a large batch writes the leaves and rebuilds the levels; evicted slots the batch reused get
        # their new weight anyway: zero only the others. The tree depends on its leaves only, so this
        # gives the very tree that zeroing them all and then setting the new ones would
        bound = store_insert.eviction_bound(store.state, store.max_items, store.capacity, n, steps)
        rebuild = host and (n + bound) * REBUILD_FRACTION >= len(index)
        changed = [0, 0]  # leaves changed by on_evicted (this thread) and by after_chunk (maybe the copy thread)

        def on_evicted(evicted: np.ndarray) -> None:  # per chunk; touches the index only, never the columns
            if rebuild:
                changed[0] += store_insert.zero_evicted_leaves(index.leaves, evicted, store.status,
                                                               ring.ALIVE_SHIFT, ring.DEAD)
            else:
                gone = evicted[(store.status[evicted] >> ring.ALIVE_SHIFT) == ring.DEAD]
                if len(gone):
                    index.set(gone, np.zeros(len(gone)))

        # a host index keeps each weight rounded to float32: computed so at once (selector.leaf_weights, about half
        # the cost of pow), the same leaves
        weigh = self.selector.leaf_weights if host else self.selector.weights
        weights = weigh(priorities[:1]) if index is not None and shared else None  # one shared

        def chunk_weights(lo: int, hi: int) -> np.ndarray:  # -0.0 read as +0.0 (leaf_weights does it itself: no
            # temporary, whose fresh pages cost more than the pass, 3 % of a one-float insert)
            return weights if shared else np.ascontiguousarray(weigh(priorities[lo:hi] if host else
                                                                     priorities[lo:hi] + 0.0), np.float64)

        per_slot = index is not None and not rebuild  # index updates slot by slot, after every eviction

        def after_chunk(lo: int, hi: int) -> None:  # maybe in the copy thread: these slots' leaves and keys only
            if rebuild:  # leaves only, the levels rebuilt at the end: the order of the writes does not matter
                changed[1] += set_inserted_leaves(index.leaves, out[lo:hi], chunk_weights(lo, hi), out[:0],
                                                  store.status, ring.ALIVE_SHIFT, ring.DEAD)
            if not per_slot:  # slots -> keys in place (later chunks leave these slots' generations alone)
                keyspace.encode_slots(store.tag, store.rank, out[lo:hi], store.status, out[lo:hi])

        store.insert_chunked(columns, lengths, priorities, out, None if index is None else on_evicted, steps=steps,
                             after_chunk=after_chunk)
        self.bytes_inserted += steps * self.spec.step_bytes
        if per_slot:
            for lo in range(0, n, store_insert.CHUNK_ITEMS):
                hi = min(n, lo + store_insert.CHUNK_ITEMS)
                w = chunk_weights(lo, hi)
                index.set(out[lo:hi], np.ascontiguousarray(np.broadcast_to(w[0], (hi - lo,)) if shared else w))
            store.keys_of(out, out=out)
        elif rebuild and (changed[0] or changed[1]):
            index.rebuild()  # the levels follow from the leaves: unchanged leaves, unchanged tree
        return out


def checked_priorities(priorities: Any, count: int) -> np.ndarray:
    """:func:`~gear_mpi.spec.validate_priorities` without its copy where none is needed. Local, O(count).

    Args:
        priorities: as ``validate_priorities`` takes them.
        count: how many there must be.
    Returns:
        ``priorities`` itself when it is a 1-D float64 numpy array of ``count`` finite values >= 0
        (a -0.0 stays: the store reads each as ``p + 0.0``), else ``validate_priorities``' new array.
    Raises:
        InvalidPriorityError: as ``validate_priorities`` (the same messages).
    """
    if (isinstance(priorities, np.ndarray) and priorities.dtype == np.float64 and priorities.ndim == 1
            and len(priorities) == count and _first_bad_priority(priorities) < 0):
        return priorities  # an n-element copy less: it would stay in the C heap (see store_insert)
    return validate_priorities(priorities, count)


#: values a block of :func:`_first_bad_priority` tests without a branch (so the compiler vectorises it); a block
#: that fails is scanned again for its first bad value
_CHECK_BLOCK = 256


@njit(cache=True, nogil=True)
def _first_bad_priority(priorities):
    """The index of the first NaN, infinite or negative priority, or -1 (one pass, no temporary; blocks of
    ``_CHECK_BLOCK`` tested without a branch, so that they vectorise: 2**18 priorities 0.25 -> 0.14 ms, about the
    rate at which they are read)."""
    n = priorities.shape[0]
    for lo in range(0, n, _CHECK_BLOCK):
        hi = min(n, lo + _CHECK_BLOCK)
        ok = True
        for i in range(lo, hi):
            v = priorities[i]
            ok &= (v >= 0.0) & (v < np.inf)
        if not ok:
            for i in range(lo, hi):
                v = priorities[i]
                if not (v >= 0.0 and v < np.inf):
                    return i
    return -1


def check_lengths(lengths: Any, max_length: int) -> np.ndarray:
    """The trajectory lengths of a packed insert, checked as a whole. Local; O(n), no Python loop.

    Args:
        lengths: a 1-D sequence, array or tensor of integers.
        max_length: the spec's longest trajectory.
    Returns:
        A C-contiguous int64 array.
    Raises:
        InvalidTrajectoryError: not a 1-D array of integers, or (naming the first) a length of 0 or less,
            or over ``max_length``.
    """
    return checked_lengths(lengths, max_length)[0]


def checked_lengths(lengths: Any, max_length: int, min_length: int = 1) -> tuple[np.ndarray, int]:
    """:func:`check_lengths` and the lengths' sum, from one pass over them. Local; O(n).

    Args:
        lengths, max_length: as :func:`check_lengths` takes them.
        min_length: the spec's shortest trajectory (``TrajectorySpec.min_length``: 2 with a NextStep column).
    Returns:
        (the C-contiguous int64 lengths, their sum).
    Raises:
        InvalidTrajectoryError: as :func:`check_lengths`.
    """
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1 or (arr.dtype.kind not in "iu" and arr.size):
        raise InvalidTrajectoryError(
            f"lengths must be a 1-D array of integers, got shape {arr.shape} and dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, np.int64)
    i, total = _first_bad_length(arr, max_length, min_length)
    if i >= 0:
        too_long = f", longer than max_length={max_length}" if arr[i] > max_length else ""
        if 1 <= arr[i] < min_length:
            too_long = (f"; a spec with a NextStep column stores at least one transition and the final "
                        f"observation ({min_length} steps)")
        raise InvalidTrajectoryError(f"trajectory {i}: trajectory has length {int(arr[i])}{too_long}")
    return arr, int(total)


@njit(cache=True, nogil=True)
def _first_bad_length(lengths, max_length, min_length):
    """(the index of the first length outside ``[min_length, max_length]`` or -1, the sum of the lengths before it):
    one pass, no temporaries. Lengths within bounds cannot overflow the int64 sum."""
    total = 0
    for i in range(lengths.shape[0]):
        v = lengths[i]
        if v < min_length or v > max_length:
            return i, total
        total += v
    return -1, total


def check_packed_columns(spec: TrajectorySpec, columns: Mapping[str, Any], steps: int,
                         casting: str = "safe") -> dict[str, np.ndarray]:
    """The columns of a packed insert, checked against ``spec`` (dtype, shape, ``steps`` rows). Local, O(columns):
    nothing is copied or cast here (the ring copy casts).

    Args:
        spec: the trajectory layout.
        columns: column name -> ``[steps, *shape]`` array-like.
        steps: the sum of the trajectory lengths.
        casting: which dtypes a column takes (:data:`~gear_mpi.spec.CASTINGS`, checked by the caller).
    Returns:
        Column name -> numpy array (a view where the input was one; tensors via ``.cpu().numpy()``).
    Raises:
        InvalidTrajectoryError: not a mapping, a column missing or unknown, non-numeric or uncastable, of the
            wrong shape or of another step count than the others or than ``steps``.
    """
    out, rows = spec.column_arrays(columns, "packed columns", rows="steps", casting=casting)
    if rows != steps:
        raise InvalidTrajectoryError(f"packed columns: the lengths sum to {steps} steps but the columns have {rows}")
    return out
