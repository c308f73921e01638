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
from ..kernels.compiled import entry_point, type_fingerprint
from ..spec import validate_priorities
from .priority_index import PriorityIndex
from .selectors import Prioritized, Uniform

_NO_ROW = np.zeros(0, np.float64)  # the raw-priority row where the table keeps none


class PreparedUpdate:
    """The serial sampled update's call for one thread's sorted draw (:func:`prepare_update`): the compiled entry
    point (:func:`~gear_mpi.kernels.compiled.entry_point`; the dispatcher where there is none), the arguments
    around the keys, the priorities and the selector's exponent, and what fixes their types: the scratch rows
    (``drawn``, the tuple ``local_sample.sorted_draw`` returns, replaced when the scratch is re-cut), the table's
    raw-priority row (``row``) and the fingerprint of the priorities' array type (``numba``'s, so that an array
    of another layout or dtype never reaches the entry point). ``run`` is None where there is no entry point."""

    __slots__ = ("run", "head", "tail", "drawn", "row", "fingerprint")

    def __init__(self, run, head: tuple, tail: tuple, drawn: tuple, row, fingerprint: bytes | None):
        self.run, self.head, self.tail = run, head, tail
        self.drawn, self.row, self.fingerprint = drawn, row, fingerprint


def _update_args(shard, drawn: tuple, row) -> tuple[tuple, tuple]:
    """``update_sampled``'s arguments between the priorities and the exponent, and after it. O(1)."""
    store, n = shard.store, drawn[0].shape[0]
    keep = type(row) is np.ndarray
    head = (*drawn, store.tag, store.rank, store.max_items, store.status, ring.ALIVE_SHIFT, ring.LIVE,
            row if keep else _NO_ROW, keep)
    return head, (type(shard.selector) is Prioritized, shard.index._arrays, *local_sample.update_rows(n))


def prepare_update(shard, keys: np.ndarray, priorities: np.ndarray, alpha: float, drawn: tuple, head: tuple,
                   tail: tuple) -> PreparedUpdate:
    """The :class:`PreparedUpdate` for updates of ``keys`` with priorities typed as ``priorities`` (float64, one
    a key) through this thread's sorted draw ``drawn`` (``head`` and ``tail``: :func:`_update_args`), after a
    call through the dispatcher compiled it. Where there is no entry point to call its ``run`` is None (and every
    update of this draw goes through the dispatcher). O(1): about 10 us (see
    :func:`~gear_mpi.kernels.compiled.entry_point`)."""
    run = entry_point(priority_sampled.update_sampled, (keys, priorities, *head, alpha, *tail))
    fingerprint = type_fingerprint(priorities)
    return PreparedUpdate(run if fingerprint is not None else None, head, tail, drawn, shard.store.layout.priority,
                          fingerprint)


def update_batch(shard, keys: np.ndarray, priorities, rep=None) -> int | None:
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
    store = shard.store
    layout = store.layout
    call = rep.update_call if rep is not None else None
    if call is not None and (call.drawn is not drawn or call.row is not layout.priority):
        call = None  # made for another scratch cut (drawn None or re-cut) or before the row changed: made again below
    elif call is not None and call.run is not None and store.arena is not None and layout.priority_constant is None:
        pr = priorities  # (the shard's index and selector are fixed; its raw row is the one the call holds)
        if type(pr) is np.ndarray and pr.shape == (n,) and type_fingerprint(pr) == call.fingerprint:
            applied = call.run(keys, pr, *call.head, _alpha(shard.selector), *call.tail)
            if applied < 0:
                return None
            shard.stale_updates += n - applied
            return int(applied)
    index, sel = shard.index, shard.selector
    kind = type(sel)
    if drawn is None or type(index) is not PriorityIndex or not (kind is Prioritized or kind is Uniform) \
            or layout.priority_constant is not None or store.arena is None:
        return None
    pr = priorities
    if not (type(pr) is np.ndarray and pr.dtype == np.float64 and pr.shape == (n,)):
        pr = validate_priorities(priorities, n)  # a list or a tensor: checked and converted
    pr = np.ascontiguousarray(pr)
    keys = np.ascontiguousarray(keys)
    row = layout.priority
    head, tail = _update_args(shard, drawn, row)
    alpha = _alpha(sel)
    if n >= priority_sampled.PARALLEL_MIN:
        applied = priority_sampled.update_sampled_parallel(keys, pr, *head, alpha, *tail, max(2, min(64, n // 1024)))
    else:
        applied = priority_sampled.update_sampled(keys, pr, *head, alpha, *tail)
        if rep is not None and call is None and applied >= 0:  # the next update of this draw's size: called directly
            rep.update_call = prepare_update(shard, keys, pr, alpha, drawn, head, tail)
    if applied < 0:
        return None
    shard.stale_updates += n - applied
    return int(applied)


def _alpha(selector) -> float:
    """The exponent of the index weights: ``Prioritized``'s alpha, 1 for ``Uniform`` (the kernel powers only
    where the selector is ``Prioritized``)."""
    return float(selector.alpha) if type(selector) is Prioritized else 1.0
