"""A priority update of a few keys in one numba call: the body of :meth:`Shard.update_priorities
<gear_mpi.shard.Shard.update_priorities>` (issue 34).

The general path (:meth:`Shard.apply_priorities <gear_mpi.shard.Shard.apply_priorities>`) validates the
priorities into a copy, resolves the keys, computes the weights and updates the index in four kernel calls
and a few temporaries: about 12 us for 32 keys here, most of it the calls' dispatch, against cpprb's whole
sample + update of 45 us. :func:`update_few` does the same work in one call for up to
``priority_tree.SET_SERIAL_MAX`` keys of a shard whose index is on the host and whose selector's weights
are known (``Uniform``: 1; ``Prioritized``: ``p ** alpha`` by the same ``pow`` as
:func:`~gear_mpi.kernels.weights.power_weights`), leaving the same leaves, levels, raw priorities and
counters. Anything else, and any bad input, goes the general way, which raises its own errors: the kernel
checks everything before it writes anything. Local: no communication.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from ..kernels.pipeline import SERIAL
from ..keys import GEN_MASK, RANK_MASK, SLOT_MASK, TAG_MASK, _GEN_SHIFT, _RANK_SHIFT, _TAG_SHIFT, as_key_array
from ..kernels import ring
from ..kernels.priority_tree import SET_SERIAL_MAX, _rebuild_prefix, _set_serial
from ..kernels.weights import _power
from ..spec import validate_priorities
from . import sampled_update
from .priority_index import PriorityIndex
from .selectors import Prioritized, Uniform

_NO_ROW = np.zeros(0, np.float64)  # update_few's raw-priority row where the table keeps none


@njit(cache=True, nogil=True, parallel=SERIAL)
def update_few(keys, priorities, tag, rank, max_items, status, raw, keep_raw, alpha, powered, tree, flags1,
               flags2):
    """Set the priorities of ``keys`` (one shard's, at most ``SET_SERIAL_MAX``): each live key's raw priority
    (``raw[slot] = p + 0.0`` where ``keep_raw``) and index weight (``p ** alpha`` as ``weights._power``
    where ``powered``, else 1), the last of duplicate keys winning; stale keys are skipped.

    Args:
        keys: int64 keys; priorities: float64, one per key.
        tag, rank, max_items: the shard's key tag, rank and table slots; status: the table's status row.
        raw: the table's raw-priority row (any float64 array when not ``keep_raw``).
        alpha, powered: the selector's exponent, and whether weights are powers (else all 1).
        tree, flags1, flags2: the host index's arrays (``PriorityIndex._arrays``, ``_flags1``, ``_flags2``).
    Returns:
        ``(code, i)``: ``(0, live keys applied)``; ``(1, i)``: priority ``i`` is NaN, infinite or negative;
        ``(2, i)``: key ``i`` is not this shard's. Nothing is written unless the code is 0. O(B log n).
    """
    n = keys.shape[0]
    for i in range(n):
        v = priorities[i]
        if not (v >= 0.0 and v < np.inf):
            return 1, i
    for i in range(n):
        k = keys[i]
        if k < 0 or ((k >> _TAG_SHIFT) & TAG_MASK) != tag or ((k >> _RANK_SHIFT) & RANK_MASK) != rank \
                or (k & SLOT_MASK) >= max_items:
            return 2, i
    slots = np.empty(n, np.int64)
    values = np.empty(n, np.float64)
    m = 0
    for i in range(n):
        k = keys[i]
        s = k & SLOT_MASK
        st = np.int64(status[s])
        if (st >> ring.ALIVE_SHIFT) == ring.LIVE and (st & GEN_MASK) == ((k >> _GEN_SHIFT) & GEN_MASK):
            p = priorities[i] + 0.0  # -0.0 as +0.0
            if keep_raw:
                raw[s] = p
            slots[m] = s
            values[m] = _power(p, alpha) if powered else 1.0
            m += 1
    if m:
        leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
        _set_serial(leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, flags1, flags2, slots[:m], values[:m])
        _rebuild_prefix(l2_sum, prefix)
    return 0, m


def update_priorities(shard, keys: Any, priorities: Any) -> int:
    """:meth:`Shard.update_priorities <gear_mpi.shard.Shard.update_priorities>`: the keys of the batch the last
    one-call sample (into ``out=`` or a new batch) filled through that sample's sorted draw
    (:func:`~gear_mpi.selection.sampled_update.update_batch`, any size); else through :func:`update_few`
    where it applies (a host index, ``Uniform`` or ``Prioritized`` exactly, a table whose raw-priority row
    does not stand for one value, at most ``SET_SERIAL_MAX`` keys, no bad input), else the general path.

    Args:
        shard: the :class:`~gear_mpi.shard.Shard`.
        keys: its keys (int, sequence, numpy array or tensor).
        priorities: one new priority per key.
    Returns:
        How many were applied (keys still live); the others are counted as stale.
    Raises:
        TypeError, InvalidKeyError, InvalidPriorityError, RuntimeError: as the shard's method documents
            (nothing changed).
    Cost: O(B log n), one numba call on the fast path; the general path's otherwise.
    """
    rep = shard._repeat
    drawn = rep.keys() if rep is not None else None  # the keys array of the last one-call sample's batch
    if drawn is not None and keys is not drawn:  # its tensor, while the batch lives, else another key set
        batch = rep.batch()
        drawn = drawn if batch is not None and batch.owns_keys(keys) else None
    if drawn is not None:
        keys = drawn
        applied = sampled_update.update_batch(shard, keys, priorities, rep)  # through that sample's sorted draw
        if applied is not None:
            return applied
    elif type(keys) is not np.ndarray and hasattr(keys, "detach"):
        try:
            keys = keys.numpy()  # a CPU tensor (a sample's keys), as keys.tensor_numpy takes it first
        except (RuntimeError, TypeError):  # one that needs grad or lives on a device: as_key_array's way
            pass
    keys = keys if type(keys) is np.ndarray and keys.dtype == np.int64 and keys.ndim == 1 else as_key_array(keys)
    n = keys.shape[0]
    store, index, sel = shard.store, shard.index, shard.selector
    layout = store.layout
    kind = type(sel)
    if 0 < n <= SET_SERIAL_MAX and type(index) is PriorityIndex and (kind is Prioritized or kind is Uniform) \
            and layout.priority_constant is None and store.arena is not None:
        pr = priorities
        if not (type(pr) is np.ndarray and pr.dtype == np.float64 and pr.shape == (n,)):
            pr = validate_priorities(priorities, n)  # raises for a bad one, naming it
        row = layout.priority
        keep = type(row) is np.ndarray
        alpha = sel.alpha if kind is Prioritized else 1.0
        code, i = update_few(np.ascontiguousarray(keys), np.ascontiguousarray(pr), store.tag, store.rank,
                             store.max_items, store.status, row if keep else _NO_ROW, keep, alpha,
                             kind is Prioritized, index._arrays, index._flags1, index._flags2)
        if code == 0:
            shard.stale_updates += n - i
            return i
    pr = validate_priorities(priorities, n)  # the general path, and its errors
    return int(shard.apply_priorities(keys, pr).sum())
