"""The priority update of the batch just sampled into ``out=``, in the draw's slot order (issue 34).

A training loop calls ``Shard.sample(B, W, out=batch)`` then ``Shard.update_priorities(batch.keys, p)``.
The one-call sample drew the batch's slots in ascending order and left them in this thread's scratch
(:func:`~gear_mpi.kernels.local_sample.sorted_draw`); :func:`update_batch` sets the new priorities through
them (:mod:`~gear_mpi.kernels.priority_sampled`): no second grouping of the slots, the table's and tree's
lines in address order, the checks in one pass and the new leaves (the weights' powers, vectorised), the keys'
statuses and the tree writes in another, both shared among the threads. The same leaves, levels, raw
priorities and counts as the general path, bit for bit; where the scratch does not describe these keys
(another sample in between, keys changed in place), or anything is wrong with the input, it returns None and
the caller takes the general path, which raises the errors. Local: no communication.
"""
from __future__ import annotations

import numpy as np

from ..kernels import local_sample, priority_sampled, ring
from ..spec import validate_priorities
from .priority_index import PriorityIndex
from .selectors import Prioritized, Uniform

_NO_ROW = np.zeros(0, np.float64)  # the raw-priority row where the table keeps none


def update_batch(shard, keys: np.ndarray, priorities) -> int | None:
    """Set ``priorities`` for ``keys``, the keys of the batch ``shard``'s last one-call sample filled, through
    that sample's sorted draw.

    Args:
        shard: the :class:`~gear_mpi.shard.Shard` (a host index, ``Uniform`` or ``Prioritized`` exactly, a raw
            priority row that does not stand for one value: else None at once).
        keys: the batch's keys (int64, one-dimensional numpy).
        priorities: one new priority per key (a float64 numpy row is used as it is; anything else is
            validated first, raising as the general path does).
    Returns:
        How many were applied (keys still live; the others are counted as stale), or None when this path does
        not apply (nothing changed).
    Raises:
        InvalidPriorityError: priorities not numbers or not one per key (nothing changed).
    Cost: O(B), one kernel call with two passes, parallel from ``priority_sampled.PARALLEL_MIN`` keys.
    """
    n = keys.shape[0]
    drawn = local_sample.sorted_draw(n)
    store, index, sel = shard.store, shard.index, shard.selector
    kind = type(sel)
    if drawn is None or type(index) is not PriorityIndex or not (kind is Prioritized or kind is Uniform) \
            or store.layout.priority_constant is not None or store.arena is None:
        return None
    pr = priorities
    if not (type(pr) is np.ndarray and pr.dtype == np.float64 and pr.shape == (n,)):
        pr = validate_priorities(priorities, n)  # a list or a tensor: checked and converted
    row = store.layout.priority
    keep = type(row) is np.ndarray
    alpha = sel.alpha if kind is Prioritized else 1.0
    sslots, order, inv = drawn
    args = (np.ascontiguousarray(keys), np.ascontiguousarray(pr), sslots, order, inv, store.tag, store.rank,
            store.max_items, store.status, ring.ALIVE_SHIFT, ring.LIVE, row if keep else _NO_ROW, keep, alpha,
            kind is Prioritized, index._arrays, *local_sample.update_rows(n))
    if n >= priority_sampled.PARALLEL_MIN:
        applied = priority_sampled.update_sampled_parallel(*args, max(2, min(64, n // 1024)))
    else:
        applied = priority_sampled.update_sampled(*args)
    if applied < 0:
        return None
    shard.stale_updates += n - applied
    return int(applied)
