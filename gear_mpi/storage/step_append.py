"""One environment step into a shard, at the cost of a few small array writes: :class:`StepAppender`, the
body of :meth:`Shard.append_step <gear_mpi.shard.Shard.append_step>`.

Why a path of its own: the general insert (:meth:`ShardInserter.store_packed
<gear_mpi.storage.shard_insert.ShardInserter.store_packed>`) is built for batches -- chunk bounds, an eviction
scratch sized per chunk, a copy plan of pieces, closures for the index and the copy thread, a key array -- and
for one step that machinery cost about 55 us, ten times SB3's whole ``ReplayBuffer.add`` (issue 34). Here one
numba call (:func:`place_one`) does the table's part -- :func:`ring.plan_insert <gear_mpi.kernels.ring.plan_insert>`
for the one slot, the index leaves of the evicted slots and of the new one, and the key -- and each column is
one numpy item assignment into its ring. The common step, a dict of arrays of the columns' dtypes and step
shapes, is checked and written by two small functions written out for the spec (:func:`_exact_check`,
:func:`_column_writes`): a loop over the columns took twice as long.

The result is the general path's, array for array (tests/test_small_calls.py): the same plan kernel, the same
leaf values (a leaf that already holds its value is left as it is, which leaves the very tree a rewrite would
give: every level above is a recount of the leaves), the same stamp log and raw-priority row. A store that the
general path treats specially -- compressed columns, a write callback (a device mirror), a device index --
takes the general path. Local: no communication.
"""
from __future__ import annotations

import math
import time
from typing import Any, Callable, Mapping

import numpy as np
from numba import njit

from ..kernels.pipeline import SERIAL
from .. import keys as keyspace
from ..errors import InvalidTrajectoryError
from ..kernels import ring
from ..kernels.priority_tree import _rebuild_prefix, _set_serial, leaf_value
from ..kernels.weights import _power
from ..selection.priority_index import PriorityIndex
from ..selection.selectors import Prioritized, Uniform
from ..spec import validate_priorities
from .file_guard import Hold

_CASTS: dict = {}  # (given dtype, column dtype) -> whether a step of that dtype may go into that column
_ONE_PRIORITY = np.broadcast_to(np.float64(1.0), (1,))  # the default priority (stride 0, as insert_packed's)
_NO_LOG = (np.zeros(0, np.int64), np.zeros(0, np.int64), -2, 0)  # place_one's log arguments: no log
_EVICTIONS = 4  # live trajectories one step can evict: at most one for its slot and one for its ring step


@njit(cache=True, nogil=True, parallel=SERIAL)
def place_one(table, capacity, now, scratch, tree, flags1, flags2, weight, powered, alpha, tag, rank, seqs, stamps,
              count, limit):
    """The table's part of storing one one-step trajectory: its slot and ring step planned (evicting the
    oldest as needed), the index leaves of the live trajectories it evicted zeroed and its own set to
    ``weight`` (only where a leaf changes; ``weight < 0``: no index), the levels above recounted, and the
    insert's anchor in the stamp log where it has room (as ``StampLog.record``).

    Args:
        table: the store's rows (``ring.Table`` as a plain tuple); capacity: its ring steps; now: the stamp.
        scratch: int64 ``[2 + _EVICTIONS]``: 1 (the length), then the slot (written), then the evicted slots
            (written); one array rather than three, each array argument costing about 70 ns of dispatch.
        tree, flags1, flags2: the host index's arrays (any of the right types when ``weight < 0``).
        weight: the new trajectory's index weight (its selector's), or -1.0 for none; its raw priority where
            ``powered``, the weight then ``weight ** alpha`` as ``weights._power`` (``Prioritized``'s weights).
        tag, rank: the key's tag and shard.
        seqs, stamps, count, limit: the stamp log's anchors, their count and bound (``count`` -2: no log).
    Returns:
        (its key, the ring step its data goes to, the log's new count: ``-1`` when the anchor is left to
        ``StampLog.record``, the log being full). O(log n) with an index.
    """
    state = table[6]
    first_seq = state[ring.NEXT_SEQ]
    one, slot_out, evicted = scratch[0:1], scratch[1:2], scratch[2:]
    k = ring.plan_insert(table, capacity, one, now, slot_out, evicted)
    slot = slot_out[0]
    start, status = table[0], table[2]
    if powered:
        weight = _power(weight, alpha)
    if weight >= 0.0:
        leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
        # evicted and still free: plan_insert leaves out a slot this step took back, and one step makes room
        # by one live eviction at most, which it takes back, so this finds none; kept so that the kernel stays
        # the general insert's whatever the plan returns
        m = 0
        for i in range(k):
            e = evicted[i]
            if (status[e] >> ring.ALIVE_SHIFT) == ring.DEAD and leaves[e] != 0.0:
                evicted[m] = e
                m += 1
        if m or leaves[slot] != leaf_value(weight):
            slots = np.empty(m + 1, np.int64)
            values = np.zeros(m + 1, np.float64)
            slots[:m] = evicted[:m]
            slots[m] = slot
            values[m] = weight
            _set_serial(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, flags1, flags2, slots, values)
            _rebuild_prefix(l2_sum, prefix)
    keyspace.encode_slots(tag, rank, slot_out, status, slot_out)
    if count >= 0 and not (count > 0 and stamps[count - 1] == now):
        if count >= limit or count == seqs.shape[0]:
            count = -1  # the log shrinks or grows: StampLog.record's part
        else:
            seqs[count] = first_seq
            stamps[count] = now
            count += 1
    return slot_out[0], start[slot], count


class StepAppender:
    """:meth:`Shard.append_step <gear_mpi.shard.Shard.append_step>` for one shard: checks a step column by
    column, then stores it by :func:`place_one` and one item assignment per column, or, for a store this path
    does not cover, by the general insert. Built once per shard (by its
    :class:`~gear_mpi.storage.shard_insert.ShardInserter`); reads the store's and index's arrays at every call
    (a restore may rebind them). Local; not thread-safe (nor is the shard).

    Args:
        inserter: the shard's :class:`~gear_mpi.storage.shard_insert.ShardInserter` (its spec, store, index,
            selector; its ``store_packed`` is the general path).
    """

    def __init__(self, inserter) -> None:
        self.inserter = inserter
        self.spec = inserter.spec
        self.names = frozenset(self.spec.names)
        self.order = tuple(c.name for c in self.spec.columns)  # the columns in the order check returns them
        self.count = len(self.order)
        # per column: name, dtype, a step's shape, the same with a leading 1
        self.columns = [(c.name, c.dtype, tuple(c.shape), (1,) + tuple(c.shape)) for c in self.spec.columns]
        self.step_bytes = int(self.spec.step_bytes)
        self.min_length = int(self.spec.min_length)
        # the common step (a dict of arrays of the columns' dtypes and step shapes) checked, and the columns
        # written, by code made for this spec (_exact_check, _column_writes)
        self.exact = _exact_check(self.columns) if self.min_length <= 1 else None
        self.write = _column_writes(self.order)
        self.one = np.ones(1, np.int64)  # the general path's lengths
        self.one.flags.writeable = False
        self.scratch = np.zeros(2 + _EVICTIONS, np.int64)  # place_one's: the length 1, the slot, the evicted
        self.scratch[0] = 1
        spare = PriorityIndex(1)  # place_one's index arguments when there is no index (never written)
        self.no_index = (spare._arrays, spare._flags1, spare._flags2)
        # the index weight of the default priority 1.0, where the selector's weights are known to give 1.0
        kind = type(inserter.selector)
        self.unit_weight = 1.0 if kind in (Uniform, Prioritized) else None
        self.powered = kind is Prioritized  # a float priority's weight: p ** alpha in place_one (Uniform's: 1)

    def check(self, step: Mapping[str, Any]) -> list[np.ndarray]:
        """The step's columns, checked: present and none unknown, numeric and castable to the column (safe
        casts, and any integer or float into a float column, as ``insert_packed``), of the column's shape or
        that shape with a leading 1. Nothing is written. O(columns).

        Args:
            step: column name -> value (numpy array or scalar, CPU tensor, list).
        Returns:
            Each column's value as an array of the column's step shape (a view where it had a leading 1),
            in the spec's order.
        Raises:
            InvalidTrajectoryError: not a mapping; a column missing or unknown, non-numeric, of a dtype that
                does not cast, or of another shape; a spec whose trajectories need 2 steps or more (NextStep).
        """
        if type(step) is dict and self.exact is not None and len(step) == self.count:
            try:
                out = self.exact(step)
            except KeyError:  # a column missing (and one unknown): said below
                out = None
            if out is not None:
                return out
        if type(step) is not dict and not isinstance(step, Mapping):
            raise InvalidTrajectoryError(f"append_step: expected a mapping of column -> value, got "
                                         f"{type(step).__name__}")
        if len(step) != self.count or not self.names.issuperset(step):
            missing = [k for k in self.spec.names if k not in step]
            extra = [k for k in step if k not in self.names]
            raise InvalidTrajectoryError("append_step: " + (f"missing column(s) {missing}" if missing else
                                         f"unknown column(s) {extra}") + f"; the spec has {list(self.spec.names)}")
        if self.min_length > 1:
            raise InvalidTrajectoryError(f"append_step: a spec with a NextStep column stores trajectories of at "
                                         f"least {self.min_length} steps (a transition and the final "
                                         f"observation); insert whole trajectories instead")
        out = []
        for name, dtype, shape, one in self.columns:
            value = step[name]
            arr = value if type(value) is np.ndarray else _as_array(value, name)
            given = arr.dtype
            if given is not dtype:
                ok = _CASTS.get((given, dtype))
                if ok is None:
                    kind = given.kind
                    ok = _CASTS[(given, dtype)] = (not given.hasobject and kind in "biufc" and (
                        np.can_cast(given, dtype, "safe") or (kind in "biuf" and dtype.kind == "f")))
                if not ok:
                    raise InvalidTrajectoryError(f"append_step: column {name!r} has dtype {given}, which cannot "
                                                 f"be cast safely to {dtype}")
            got = arr.shape
            if got == shape:
                out.append(arr)
            elif got == one:
                out.append(arr[0])
            else:
                raise InvalidTrajectoryError(f"append_step: column {name!r} has shape {got}; expected "
                                             f"{shape} or {one}")
        return out

    def append(self, step: Mapping[str, Any], priority: float = 1.0) -> int:
        """Check the step and the priority, then store the step as a one-step trajectory, holding the columns
        as :meth:`Shard.hold <gear_mpi.shard.Shard.hold>` does (a guarded checkpoint mapping only).

        Args:
            step: as :meth:`check` takes it.
            priority: finite, >= 0.
        Returns:
            Its key.
        Raises:
            RuntimeError: the shard is closed.
            InvalidTrajectoryError: as :meth:`check` (nothing stored).
            InvalidPriorityError: a NaN, infinite or negative priority (nothing stored).
            CheckpointError: the columns map a checkpoint that another process wrote or truncated.
        Cost: O(columns) checks and item writes and one numba call (O(log n) index work), on this path;
        the general insert for one item on the other.
        """
        arena = self.inserter.store.arena
        if arena is None:
            raise RuntimeError("this Shard is closed")
        guard = getattr(arena, "guard", None)
        if guard is None:
            return self._append(step, priority)
        with Hold(guard, True):
            return self._append(step, priority)

    def _append(self, step: Mapping[str, Any], priority: float) -> int:
        """:meth:`append` once the columns are held."""
        checked = self.check(step)
        inserter = self.inserter
        store, index = inserter.store, inserter.index
        powered, alpha = False, 0.0
        if type(priority) is float and priority == 1.0:
            pr, p, weight = _ONE_PRIORITY, 1.0, self.unit_weight
        elif type(priority) is float and 0.0 <= priority < math.inf and self.unit_weight is not None:
            p = priority + 0.0  # -0.0 stored as +0.0
            pr = None  # made where needed (_priority_row)
            if self.powered:  # p ** alpha in place_one, with the selector's alpha of this call (as update_few)
                weight, powered, alpha = p, True, float(inserter.selector.alpha)
            else:
                weight = 1.0
        else:
            pr = validate_priorities([priority], 1)
            p, weight = float(pr[0]) + 0.0, None
        cols = store.columns
        if store.compressed or store.on_write is not None or len(cols) != self.count \
                or not (index is None or type(index) is PriorityIndex):
            return self._general(checked, _priority_row(pr, p))
        if index is None:
            weight, powered = -1.0, False
            tree, flags1, flags2 = self.no_index
        else:
            if weight is None:
                weight = float(inserter.selector.weights(pr)[0])
            tree, flags1, flags2 = index._arrays, index._flags1, index._flags2
        layout = store.layout
        constant = layout.priority_constant
        keep = (constant is None or p != constant) and isinstance(layout.priority, np.ndarray) \
            and layout.keep_priorities(_priority_row(pr, p))  # may materialize the row: before anything else changes
        log = layout.stamp_log
        seqs, stamps, count, limit = _NO_LOG if log is None else (log.seqs, log.stamps, log.count, log.limit)
        now = time.time_ns()
        key, pos, count = place_one(store._arrays, store.capacity, now, self.scratch, tree, flags1, flags2, weight,
                                    powered, alpha, store.tag, store.rank, seqs, stamps, count, limit)
        self.write(cols, pos, checked)
        if keep:
            layout.priority[key & keyspace.SLOT_MASK] = p
        if count >= 0:
            log.count = count
        elif count == -1:  # layout.record_stamp's anchor, the log shrunk or grown first
            state = store.state
            seq = int(state[ring.NEXT_SEQ])
            log.record(seq - 1, seq, now, seq - int(state[ring.ORDER_COUNT]))
        if pos >= store.ring_touched:
            store.ring_touched = pos + 1
        inserter.bytes_inserted += self.step_bytes
        return key

    def _general(self, checked: list[np.ndarray], pr: np.ndarray) -> int:
        """The general insert of one checked step (a store this path does not cover)."""
        columns = {name: arr.reshape((1,) + arr.shape) for name, arr in zip(self.order, checked)}
        return int(self.inserter.store_packed(columns, self.one, pr, steps=1)[0])


def _exact_check(columns: list[tuple]) -> Callable[[dict], list | None]:
    """A function of a step (a dict holding the spec's column names, as many as there are columns) that
    returns its values in the spec's order when each is a numpy array of its column's dtype (the same dtype
    object) and step shape, else None (the general check then converts or refuses them); a column missing
    raises KeyError. Written out column by column for the spec (``exec``), which takes about half the time
    of a loop over the columns: 0.49 against 0.99 us for six columns. O(columns).

    Args:
        columns: ``StepAppender.columns``: (name, dtype, step shape, shape with a leading 1) per column.
    """
    reads = "".join(f"    v{i} = step[{name!r}]\n" for i, (name, _, _, _) in enumerate(columns))
    fits = " and ".join(f"type(v{i}) is ndarray and v{i}.dtype is d{i} and v{i}.shape == s{i}"
                        for i in range(len(columns)))
    values = ", ".join(f"v{i}" for i in range(len(columns)))
    source = f"def exact(step):\n{reads}    if {fits}:\n        return [{values}]\n    return None\n"
    scope: dict[str, Any] = {"ndarray": np.ndarray}
    for i, (_, dtype, shape, _) in enumerate(columns):
        scope[f"d{i}"], scope[f"s{i}"] = dtype, shape
    exec(source, scope)
    return scope["exact"]


def _column_writes(order: tuple[str, ...]) -> Callable[[dict, int, list], None]:
    """A function ``write(columns, pos, values)`` doing ``columns[name][pos] = values[i]`` for each column
    ``name`` of ``order`` (the ``i``-th), written out for the spec (``exec``): 0.84 against 1.10 us for six
    columns in a loop. O(columns)."""
    lines = "".join(f"    columns[{name!r}][pos] = values[{i}]\n" for i, name in enumerate(order))
    scope: dict[str, Any] = {}
    exec(f"def write(columns, pos, values):\n{lines}", scope)
    return scope["write"]


def _priority_row(pr: np.ndarray | None, p: float) -> np.ndarray:
    """``pr``, or a one-entry float64 array of ``p`` where the fast path made none. O(1)."""
    return pr if pr is not None else np.full(1, p)


def _as_array(value: Any, name: str) -> np.ndarray:
    """A step's value of column ``name`` as a numpy array (a tensor through ``.cpu().numpy()``). O(size).
    Raises InvalidTrajectoryError for what numpy cannot read (a ragged nested list)."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise InvalidTrajectoryError(f"append_step: column {name!r} is not an array numpy can read: {e}") from None
