"""One-call sampling from, and priority updates of, a shard's own host priority index (CPU kernels).

A :class:`~gear_mpi.shard.Shard` with a Uniform or Prioritized selector on a host index
draws, describes and copies a batch in one kernel call (:func:`sample_proportional`)
instead of a chain of them (draw, choices, importance weights, gather, use counts) with
Python and temporaries in between. The draw is :mod:`priority_draw`'s, bit for bit
(the same slot for every uniform); keys, placements, probabilities, importance weights,
mask and data are what ``gather.fill_choices``, the selector and
``gather.gather_from_owners`` give, for the same rows.

Large batches are drawn in ascending order of their uniforms (``priority_draw``'s runs);
each run then reads the table rows, leaves and ring steps of its items in ascending slot
order, on the thread that drew them, into scratch arrays in that sorted order; the batch
rows are finally written in draw order from the scratch. So the batch is in draw order,
exactly as before, while the random reads of the big arrays go in address order.

Updates (:func:`resolve_live`) check every key, then resolve them, drop stale ones and
write the raw priorities in one pass, producing the compacted slots the index update takes.
Table arrays may have any integer dtypes (they are read, never assumed int64).
"""
from __future__ import annotations

import threading

import numpy as np
from numba import njit, prange

from ..keys import GEN_MASK, RANK_MASK, SLOT_MASK, TAG_MASK, _GEN_SHIFT, _RANK_SHIFT, _TAG_SHIFT
from .gather import COPY_THREADS_BYTES, _gather_run, _mask_row, _placement, out_addresses
from .hints import prefetch as _prefetch
from .hints import WAIT_CYCLES, WAIT_SPINS, counters, raise_flag, staggered_flat, take_next, wait_flag
from . import bitgen
from .pcg_fill import STATE_WORDS, _draw_slice, _jump
from .priority_tree import least_positive
from .weights import importance_powers_into
from .pipeline import SERIAL
from .thread_share import caller_alone, give_back
from .priority_draw import (DRAW_PIPE, DRAW_RUNS, DRAW_THREADS_MIN, _bucket, _draw_run, _insertion_fix,
                            _sort_order_into, draw_one)

AHEAD = 16  # table rows requested this many items ahead


@njit(cache=True, inline="always")
def _place_run(sslots, lo, hi, leaves, start, length, generation, key_head, gen_shift, gen_mask, capacity, window,
               align_code, place_u, order, skey, sw, ws, nv, pf):
    """Items ``lo:hi`` in draw-sorted order (slot ``sslots[k]``, batch row ``order[k]``): key, leaf weight and
    window placement into the scratch arrays, at ``k`` (sequential writes; table rows read in slot order).

    The placement is ``gather._placement``, wrapped into the ring, with two shortcuts that give the same
    values: ``place_u[order[k]]`` (a random read) only where the trajectory holds more than one window (a
    single window has offset 0 whatever the uniform), and the wrap by one subtraction (a live slot's start
    lies in the ring and its offset is below its length, so the sum is below twice the capacity; a 64-bit
    division costs about as much as the rest of the item)."""
    for k in range(lo, hi):
        if k + AHEAD < hi:  # table rows of a later item, asked for while this one is served
            t = sslots[k + AHEAD]
            _prefetch(start, t)
            _prefetch(length, t)
            _prefetch(generation, t)
        s = sslots[k]
        sw[k] = leaves[s]
        skey[k] = key_head | ((generation[s] & gen_mask) << gen_shift) | s
        u = place_u[order[k]] if align_code == 0 and length[s] > window else 0.0
        a, b, c = _placement(start[s], length[s], window, align_code, u)
        ws[k] = a - capacity if a >= capacity else a
        nv[k] = b
        pf[k] = c


@njit(cache=True, inline="always")
def _copy_run(addrs, step_bytes, capacity, window, ws, nv, pf, order, outs, lo, hi):
    for c in range(step_bytes.shape[0]):
        _gather_run(addrs[c], capacity, step_bytes[c], ws, nv, pf, order, outs[c], window * step_bytes[c], lo, hi)


@njit(cache=True, inline="always")
def _describe_rows(lo, hi, inv, skey, sw, nv, pf, total, wmin, prioritized, window, keys, lengths, probabilities,
                   weights, mask):
    """Batch rows ``lo:hi`` from the scratch arrays (row ``i`` is sorted item ``inv[i]``): key, real steps,
    probability, importance weight and mask row (sequential writes, reads from cache-resident scratch)."""
    for i in range(lo, hi):
        k = inv[i]
        w = sw[k]
        keys[i] = skey[k]
        lengths[i] = nv[k]
        probabilities[i] = w / total
        # prioritized: the ratio min w / w (float64, stored as float32), raised to beta afterwards in one
        # vectorised pass over the batch (_raise_weights; a scalar pow here costs ~20 ns an item)
        weights[i] = wmin / w if prioritized else 1.0
        _mask_row(mask, i, pf[k], pf[k] + nv[k], window)


@njit(cache=True, inline="always")
def _place_rows_run(sslots, lo, hi, leaves, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                    window, align_code, place_u, order, ws, nv, pf, total, wmin, prioritized, keys, lengths,
                    probabilities, weights, mask, fixed_rows, sratio):
    """:func:`_place_run` and :func:`_describe_rows` in one pass over sorted items ``lo:hi``: the placement
    into the scratch rows the copy reads (``ws``, ``nv``, ``pf``, at ``k``) and the batch row of each item
    (at ``order[k]``: key, real steps, probability, mask row; where ``prioritized``, the importance weight's
    ratio goes to ``sratio[k]``, float32 in a float64 row, for :func:`_raise_weights`), with the same values.
    One pass and one parallel region less than the two (a region wakes the sleeping workers: about 45 us on
    this VM). ``fixed_rows``: the real steps and mask rows are left to the caller (:func:`_fill_fixed_rows`: the
    same for every item of a one-step spec)."""
    for k in range(lo, hi):
        if k + AHEAD < hi:
            t = sslots[k + AHEAD]
            _prefetch(start, t)
            _prefetch(length, t)
            _prefetch(generation, t)
        s = sslots[k]
        i = order[k]
        w = np.float64(leaves[s])
        keys[i] = key_head | ((generation[s] & gen_mask) << gen_shift) | s
        u = place_u[i] if align_code == 0 and length[s] > window else 0.0
        a, b, c = _placement(start[s], length[s], window, align_code, u)
        ws[k] = a - capacity if a >= capacity else a
        nv[k] = b
        pf[k] = c
        probabilities[i] = w / total
        if prioritized:
            sratio[k] = np.float64(np.float32(wmin / w))
        else:
            weights[i] = 1.0
        if not fixed_rows:
            lengths[i] = b
            _mask_row(mask, i, c, c + b, window)


@njit(cache=True, inline="always")
def _fill_fixed_rows(lo, hi, lengths, mask, window, align_code):
    """Batch rows ``lo:hi``'s real steps and mask rows where every trajectory has one step (a one-step spec):
    the placement of a 1-step trajectory is the same for every item (:func:`gather._placement`), so they are
    written in row order here instead of at each item's row (random writes: on W3, two threads, the sample's
    lengths and mask rows cost 0.3-0.45 ms that way)."""
    _, b, c = _placement(0, 1, window, align_code, 0.0)
    for i in range(lo, hi):
        lengths[i] = b
        _mask_row(mask, i, c, c + b, window)


@njit(cache=True, inline="always")
def _raise_weights(ratios, spow, rows, weights, beta, lo, hi):
    """Importance weights from their ratios ``ratios[lo:hi]`` (float32 values): raised to ``beta`` in one vectorised
    pass into ``spow`` (:func:`weights.importance_powers_into`), each then written at its batch row ``rows[k]``. A
    run's sorted items (``rows`` the sort's order), or a small batch's rows in place (``ratios`` the batch's
    weights, where :func:`_describe_rows` left them, ``rows`` the identity: every ratio is read first)."""
    importance_powers_into(ratios, beta, spow, lo, hi)
    for k in range(lo, hi):
        weights[rows[k]] = spow[k]


def sample_proportional(tree, uniforms, place_u, start, length, generation, key_head, gen_shift,
                        gen_mask, capacity, window, align_code, prioritized, addrs, step_bytes, outs,
                        mask, keys, lengths, probabilities, weights, beta=1.0):
    """Draw ``len(uniforms)`` slots from ``tree`` and fill a batch with them, in one call.

    Row ``i`` of the batch is the slot ``uniforms[i]`` selects (as :func:`priority_draw.draw`): its key
    (``key_head | generation << gen_shift | slot``), window (placed by ``align_code``, ``place_u[i]`` for
    random alignment, as ``gather.fill_choices``), real steps, probability ``w / total``, importance weight
    (``prioritized``: ``float32(r ** beta)`` for the ratio ``r = float32(wmin / w)``, as
    :func:`weights.importance_weights` makes it, with ``wmin`` the smallest positive weight, read from the tree's
    level-2 minima; the default ``beta`` 1 leaves the ratio; else 1) and
    mask row; the window's steps are copied from the column rings at ``addrs`` (``step_bytes[c]`` bytes a
    step, ``capacity`` steps, kept mapped by the caller) into ``outs`` (flat byte views of the batch
    columns, checked; or their addresses as int64, from ``Batch.column_addresses``: not checked). Uses are not
    counted (the caller takes this path only without ``max_times_sampled``, where the table keeps no use
    counts). ``generation`` may be the table's ``status`` row: ``gen_mask`` keeps its generation bits. The
    table is trusted (placements lie in the ring).

    Cost: the draw's (see ``priority_draw.draw``) plus, per item, its table rows, leaf and window read in
    ascending slot order within each of the draw's runs (prefetched ahead), then the batch rows written in
    order from O(B) scratch; parallel from ``thread_share.THREADS_MIN_ITEMS`` items, or where the copy
    reaches ``COPY_THREADS_BYTES`` (:func:`thread_share.caller_alone`; under ``DRAW_THREADS_MIN`` items, one
    parallel region in which the first thread in draws while the others wake, then all copy). The caller
    guarantees a positive total. The O(B) scratch is this thread's, kept between calls (:func:`_scratch`):
    fresh scratch pages fault in on every call (about 1000 faults, 1-2 ms a call at B=65536 on this VM).
    """
    iscr, fscr = _scratch(uniforms.shape[0])
    # the columns by address: one compiled kernel for every column count (gather.out_addresses); a batch's
    # own addresses (an int64 array, Batch.column_addresses) are trusted as they are
    if isinstance(outs, np.ndarray) and outs.dtype == np.int64:
        if outs.shape != (step_bytes.shape[0],):
            raise ValueError(f"gather: {outs.shape} output addresses for {step_bytes.shape[0]} columns")
        out_addrs = outs
    else:
        out_addrs = out_addresses(outs, uniforms.shape[0], window, step_bytes)
    nb = uniforms.shape[0]
    alone = caller_alone(nb, DRAW_THREADS_MIN, nb * window * int(step_bytes.sum()))
    try:
        _sample_kernel(tree, uniforms, place_u, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                       window, align_code, prioritized, addrs, step_bytes, out_addrs, mask, keys, lengths,
                       probabilities, weights, iscr, fscr, NO_GEN, False, float(beta))
    finally:
        give_back(alone)


NO_GEN = np.zeros(0, np.uint64)  # _sample_kernel's gen when the uniforms are given
_I_ROWS, _F_ROWS = 8, 2  # int64 rows: sslots skey ws nv pf order inv ident; float64 rows: sw, sorted uniforms
_U_ROWS = 3  # and the update of the batch's rows (update_rows): priorities, generations, new leaves in slot order
SCRATCH_ROWS = _I_ROWS + _F_ROWS + _U_ROWS  # the rows of one scratch allocation (staggered_flat)
_SCRATCH_KEEP = 1 << 20  # batches up to this many items keep their scratch (104 bytes an item) for the next call
_local = threading.local()


@njit(cache=True, inline="always")
def _row(flat, r, nb):
    """Row ``r`` (its first ``nb`` entries) of a scratch allocation of ``SCRATCH_ROWS`` staggered rows."""
    at = r * (flat.shape[0] // SCRATCH_ROWS)
    return flat[at:at + nb]


def _scratch(nb: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's scratch for a batch of ``nb`` items: one allocation of ``SCRATCH_ROWS`` staggered rows
    (:func:`hints.staggered_flat`; the kernel slices them, :func:`_row`), ``_I_ROWS`` int64 ones, then
    ``_F_ROWS`` float64 ones, then the ``_U_ROWS`` of :func:`update_rows`, as the flat int64 array and its float64
    view; kept for the next call (grown when a larger batch comes; batches larger than ``_SCRATCH_KEEP`` get a
    fresh one, whose update rows stay unused). Per thread, so concurrent samplers (a prefetch thread) never share
    it. O(1) for the batch size of the last call."""
    if getattr(_local, "nb", -1) == nb:
        return _local.flat
    if nb > getattr(_local, "size", 0):
        size = max(nb, DRAW_PIPE)
        raw = staggered_flat(SCRATCH_ROWS, size)
        if size > _SCRATCH_KEEP:
            return raw, raw.view(np.float64)
        _local.raw, _local.size = raw, size
    raw = _local.raw
    _local.flat = (raw, raw.view(np.float64))
    _local.sorted = (_row(raw, 0, nb), _row(raw, 5, nb), _row(raw, 6, nb))  # sslots, order, inv (sorted_draw)
    u = _I_ROWS + _F_ROWS  # (each row as the kernel slices it, _row: one definition of the stride)
    _local.update = (_row(raw, u, nb).view(np.float64), _row(raw, u + 1, nb), _row(raw, u + 2, nb).view(np.float64))
    _local.nb = nb
    return _local.flat


def update_rows(nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The scratch rows of ``nb`` entries the update of this thread's last sample's batch works in
    (:mod:`~gear_mpi.kernels.priority_sampled`): the priorities (float64), the keys' generations (int64) and the
    new leaves (float64), in slot order. Valid where :func:`sorted_draw` of ``nb`` returned rows. O(1).

    Args:
        nb: the batch size.
    Returns:
        ``(sorted_p, sorted_gen, sorted_leaf)``, views kept with the sample's scratch.
    """
    if getattr(_local, "nb", -1) != nb:
        raise ValueError(f"update_rows: this thread's scratch holds no sample of {nb} items")
    return _local.update


def sorted_draw(nb: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """What this thread's last one-call sample of ``nb`` items left in its scratch: the slots in ascending order,
    the batch row of each and the inverse (views, valid until this thread's next sample), for the update of that
    batch (:mod:`~gear_mpi.kernels.priority_sampled`, which checks them against the keys); None when the
    scratch holds no sorted draw of ``nb`` items (fewer than ``DRAW_PIPE`` are drawn unsorted). O(1).

    Args:
        nb: the batch size.
    Returns:
        ``(sslots, order, inv)`` int64 rows of ``nb``, or None.
    """
    if nb < DRAW_PIPE or getattr(_local, "nb", -1) != nb:
        return None
    return _local.sorted


@njit(cache=True, parallel=True, nogil=True)
def _sample_kernel(tree, uniforms, place_u, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                   window, align_code, prioritized, addrs, step_bytes, outs, mask, keys, lengths,
                   probabilities, weights, iscr, fscr, gen, one_step=False, beta=1.0):
    """:func:`sample_proportional` on the scratch of :func:`_scratch` (``iscr`` the flat int64 allocation, ``fscr``
    its float64 view: rows sliced here, :func:`_row`),
    with ``outs`` the batch columns' addresses (int64, :func:`gather.out_addresses`). ``gen``, told apart by its
    length: :data:`NO_GEN` (empty: ``uniforms`` and ``place_u`` are given); ``pcg_fill.STATE_WORDS`` words, a
    PCG64 state and increment from which ``uniforms`` are drawn here first, as ``Generator.random`` would draw
    them (:mod:`pcg_fill`; by the bucket pass's threads from ``SORT_PARALLEL_MIN`` items); or ``bitgen.WORDS``
    words of a bit generator (:func:`bitgen.generator_words`) from which ``uniforms`` then ``place_u`` are drawn
    first, on the calling thread, as ``Generator.random`` fills them.
    ``one_step``: every stored trajectory has exactly one step (the spec's ``max_length`` is 1), so the runs write
    the batch's real steps and mask rows in row order (:func:`_fill_fixed_rows`). ``beta``: the importance
    weights' exponent (``prioritized``), applied here: by each run to its own items, or after a small batch's
    draw, where two threads share the copy by the drawing thread once the others may copy (:func:`_raise_weights`)."""
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    nb = uniforms.shape[0]
    total = prefix[l2_sum.shape[0]]
    wmin = least_positive(l2_min) if prioritized else 1.0  # (PriorityIndex.min_positive)
    sslots, skey, ws, nv = _row(iscr, 0, nb), _row(iscr, 1, nb), _row(iscr, 2, nb), _row(iscr, 3, nb)
    pf, order, inv, ident = _row(iscr, 4, nb), _row(iscr, 5, nb), _row(iscr, 6, nb), _row(iscr, 7, nb)
    sw = _row(fscr, _I_ROWS, nb)
    spare = _row(fscr, _I_ROWS + 1, nb)  # the sorted uniforms; free once drawn (the weights' powers then)
    skeys = spare  # draws land in sorted order: sslots[k] is the slot of the k-th smallest uniform
    if gen.shape[0] == STATE_WORDS and nb < SORT_PARALLEL_MIN:  # (from SORT_PARALLEL_MIN the bucket pass draws them)
        _draw_slice(gen[0], gen[1], gen[2], gen[3], uniforms, 0, nb)
    elif gen.shape[0] == bitgen.WORDS:  # the draws, then the placements, as rng.random fills them (bitgen)
        bitgen.fill_doubles(gen, uniforms, 0, nb)
        bitgen.fill_doubles(gen, place_u, 0, place_u.shape[0])
    row_bytes = 0
    for c in range(step_bytes.shape[0]):
        row_bytes += window * step_bytes[c]
    runs = _runs(nb, row_bytes)
    if runs == 0:  # (otherwise each run fills its part of ident and inv below)
        for k in range(nb):
            ident[k] = k
    if nb < DRAW_PIPE:
        order = ident
        inv = ident
        skeys = uniforms
    elif nb >= SORT_PARALLEL_MIN:  # the bucket pass on the threads; each run below sorts its buckets
        _bucket_parallel(uniforms, inv, order, skeys, gen)
    elif runs > 0:  # (fewer draws are sorted by the thread that draws them, _draw_small)
        _sort_order_into(uniforms, inv, order, skeys)  # inv serves as the sort's bucket bounds first
    if runs > 0:  # draw, place and copy each run of sorted uniforms on one thread
        rb = np.empty(runs + 1, np.int64)  # where each run starts: whole buckets when the runs end the sort
        for t in range(runs):
            rb[t] = t * nb // runs
        rb[runs] = nb
        nbk = max(1, nb // 2)
        if nb >= SORT_PARALLEL_MIN:
            for t in range(1, runs):  # the end of the bucket before the run's first (the last slice's offsets)
                kb = t * nbk // runs
                rb[t] = inv[(SORT_PARTS - 1) * nbk + kb - 1] if kb > 0 else 0
        if nb >= SORT_PARALLEL_MIN:
            # a fixed share of runs a thread, not take_next: each thread then reads one contiguous part of the
            # tree and ring (W3, N=1e6, 2 threads: 5.90 against 6.12 ms a step handed out); the region's thread
            # wake-up is small beside these batches' work
            for t in prange(runs):
                _sample_run(rb[t], rb[t + 1], True, one_step, leaves, l0_sum, l1_sum, l2_sum, prefix, start, length,
                            generation, key_head, gen_shift, gen_mask, capacity, window, align_code, place_u,
                            prioritized, total, wmin, sslots, ws, nv, pf, order, inv, ident, skeys, keys, lengths,
                            probabilities, weights, mask, addrs, step_bytes, outs, sw, beta)
        else:  # handed out as the threads arrive (take_next): the caller works while a sleeping worker wakes
            taken = counters(1)
            for _ in prange(runs):
                t = take_next(taken)
                while t < runs:
                    _sample_run(rb[t], rb[t + 1], False, one_step, leaves, l0_sum, l1_sum, l2_sum, prefix, start,
                                length, generation, key_head, gen_shift, gen_mask, capacity, window, align_code,
                                place_u, prioritized, total, wmin, sslots, ws, nv, pf, order, inv, ident, skeys, keys,
                                lengths, probabilities, weights, mask, addrs, step_bytes, outs, sw, beta)
                    t = take_next(taken)
    elif nb * row_bytes < COPY_THREADS_BYTES:
        _draw_small(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms, place_u, start, length, generation, key_head,
                    gen_shift, gen_mask, capacity, window, align_code, prioritized, total, wmin, sslots, skey, ws, nv,
                    pf, order, inv, ident, sw, skeys, keys, lengths, probabilities, weights, mask)
        if prioritized:
            _raise_weights(weights, spare, ident, weights, beta, 0, nb)
        _copy_run(addrs, step_bytes, capacity, window, ws, nv, pf, order, outs, 0, nb)
    else:  # one region: the first thread in draws and places the rows while the others wake (a sleeping worker
        # takes tens of microseconds), then all copy runs of >= 32 windows (each run prefetches ahead of
        # itself), handed out as the threads arrive (take_next)
        chunks = max(1, min(64, nb // 32))
        ctl = counters(3)
        ticket = ctl[0:1]  # the draw's: the thread that takes 0 draws
        ready = ctl[1:2]  # raised once the rows are placed and described
        taken = ctl[2:3]  # copy runs handed out
        for _ in prange(chunks):
            drawn = True
            if take_next(ticket) == 0:
                _draw_small(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms, place_u, start, length, generation,
                            key_head, gen_shift, gen_mask, capacity, window, align_code, prioritized, total, wmin,
                            sslots, skey, ws, nv, pf, order, inv, ident, sw, skeys, keys, lengths, probabilities,
                            weights, mask)
                raise_flag(ready)  # (the copy reads the placements only: the weights are finished beside it)
                if prioritized:
                    _raise_weights(weights, spare, ident, weights, beta, 0, nb)
            else:  # a thread that waits past its bound leaves the copy to the drawing thread, which copies too
                drawn = wait_flag(ready, WAIT_SPINS, WAIT_CYCLES)
            if drawn:
                t = take_next(taken)
                while t < chunks:
                    _copy_run(addrs, step_bytes, capacity, window, ws, nv, pf, order, outs, t * nb // chunks,
                              (t + 1) * nb // chunks)
                    t = take_next(taken)


@njit(cache=True, nogil=True, parallel=SERIAL)
def _sample_run(lo, hi, fix_sort, one_step, leaves, l0_sum, l1_sum, l2_sum, prefix, start, length, generation,
                key_head, gen_shift, gen_mask, capacity, window, align_code, place_u, prioritized, total, wmin, sslots,
                ws, nv, pf, order, inv, ident, skeys, keys, lengths, probabilities, weights, mask, addrs, step_bytes,
                outs, sratio, beta):
    """One run ``lo:hi`` of :func:`_sample_kernel`'s sorted items on one thread: its part of the sort finished
    (``fix_sort``: the bucket pass left its buckets unsorted), its identity and inverse rows, its draws,
    placements, batch metadata, importance weights (``prioritized``: through ``sratio`` and the run's sorted
    uniforms ``skeys``, free once drawn) and window copies (``one_step``: the real steps and mask of batch rows
    ``lo:hi``, the same for every item, written in row order; the runs cover every row)."""
    if fix_sort:
        _insertion_fix(order, skeys, lo, hi)
    for k in range(lo, hi):  # the identity (where the draws land) and the sort's inverse, this run's part
        ident[k] = k
        inv[order[k]] = k
    _draw_run(leaves, l0_sum, l1_sum, l2_sum, prefix, skeys, ident, lo, hi, sslots)
    _place_rows_run(sslots, lo, hi, leaves, start, length, generation, key_head, gen_shift, gen_mask, capacity,
                    window, align_code, place_u, order, ws, nv, pf, total, wmin, prioritized, keys, lengths,
                    probabilities, weights, mask, one_step, sratio)
    if prioritized:
        _raise_weights(sratio, skeys, order, weights, beta, lo, hi)
    if one_step:
        _fill_fixed_rows(lo, hi, lengths, mask, window, align_code)
    _copy_run(addrs, step_bytes, capacity, window, ws, nv, pf, order, outs, lo, hi)


@njit(cache=True, nogil=True, parallel=SERIAL)
def _draw_small(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms, place_u, start, length, generation, key_head,
                gen_shift, gen_mask, capacity, window, align_code, prioritized, total, wmin, sslots, skey, ws, nv, pf,
                order, inv, ident, sw, skeys, keys, lengths, probabilities, weights, mask):
    """The one-call sample's draw, placement and batch metadata of fewer than ``DRAW_THREADS_MIN`` items, on
    one thread (:func:`_sample_kernel`'s scratch rows; under ``DRAW_PIPE`` items ``order`` and ``inv`` are
    ``ident`` and ``skeys`` the uniforms)."""
    nb = uniforms.shape[0]
    if nb < DRAW_PIPE:
        for i in range(nb):
            sslots[i] = draw_one(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms[i])
    else:
        _sort_order_into(uniforms, inv, order, skeys)  # inv serves as the sort's bucket bounds first
        for k in range(nb):
            inv[order[k]] = k
        _draw_run(leaves, l0_sum, l1_sum, l2_sum, prefix, skeys, ident, 0, nb, sslots)
    _place_run(sslots, 0, nb, leaves, start, length, generation, key_head, gen_shift, gen_mask, capacity,
               window, align_code, place_u, order, skey, sw, ws, nv, pf)
    _describe_rows(0, nb, inv, skey, sw, nv, pf, total, wmin, prioritized, window, keys, lengths, probabilities,
                   weights, mask)


#: from this many items the uniforms are bucketed by the threads (SORT_PARTS slices), and each run of the draw
#: finishes the sort of its own buckets (:func:`_bucket_parallel`)
SORT_PARALLEL_MIN = 8192
SORT_PARTS = 2


@njit(cache=True, inline="always")
def _bucket_parallel(uniforms, cnt, order, keys, gen):
    """The bucket pass of ``priority_draw._sort_order_into`` on the threads: ``SORT_PARTS`` slices of the
    uniforms each counted into their own buckets, one offset per (bucket, slice) in bucket then slice order,
    each slice scattered from its offsets. So a bucket holds its values in index order, as the serial pass
    leaves them (the insertion sort, :func:`priority_draw._insertion_fix` over whole buckets, then gives the
    same ``order`` and ``keys``). ``cnt`` (int64, at least ``SORT_PARTS * max(1, n // 2)`` entries) keeps
    the offsets: after the pass ``cnt[(SORT_PARTS - 1) * nbk + k]`` is where bucket ``k`` ends. With a
    generator state ``gen`` (``STATE_WORDS`` words, see :func:`_sample_kernel`) each slice draws its uniforms
    first."""
    b = uniforms.shape[0]
    nbk = max(1, b // 2)
    for p in prange(SORT_PARTS):
        base = p * nbk
        lo = p * b // SORT_PARTS
        if gen.shape[0] == STATE_WORDS:
            h, l = _jump(gen[0], gen[1], gen[2], gen[3], lo)
            _draw_slice(h, l, gen[2], gen[3], uniforms, lo, (p + 1) * b // SORT_PARTS)
        for k in range(nbk):
            cnt[base + k] = 0
        for i in range(lo, (p + 1) * b // SORT_PARTS):
            cnt[base + _bucket(uniforms[i], nbk)] += 1
    run = 0
    for k in range(nbk):
        for p in range(SORT_PARTS):
            c = cnt[p * nbk + k]
            cnt[p * nbk + k] = run
            run += c
    for p in prange(SORT_PARTS):
        base = p * nbk
        for i in range(p * b // SORT_PARTS, (p + 1) * b // SORT_PARTS):
            u = uniforms[i]
            j = base + _bucket(u, nbk)
            q = cnt[j]
            order[q] = i
            keys[q] = u
            cnt[j] = q + 1


@njit(cache=True, inline="always")
def _runs(nb, row_bytes):
    """How many runs of sorted items the threads draw, place and copy (0: one thread draws). Small batches are
    drawn by one thread even where their copy is shared (4 KiB rows, B = 256: the threads drawing too made no
    difference, 154-157 against 152-154 us a W2 step, round 4); where the copy is shared, the draw runs inside
    the copy's parallel region, by the first thread in, while a sleeping worker wakes (:func:`_sample_kernel`)."""
    if nb >= DRAW_THREADS_MIN:
        return max(2, min(DRAW_RUNS, nb // 256))
    return 0


@njit(cache=True, nogil=True, parallel=SERIAL)
def resolve_live(keys, priorities, tag, rank, max_items, status, alive_shift, live_code, priority, keep_raw,
                 slots_out, values_out, live):
    """Resolve ``keys`` of one shard and, where the table keeps raw priorities (``keep_raw``), write those
    of the live ones: ``priority[slot] = priorities[i]``; the live slots, compacted in key order, go to
    ``slots_out`` and their priorities to ``values_out``; ``live[i]`` tells whether key ``i`` was live
    (``status[slot] >> alive_shift == live_code``, and the key's generation in ``status``'s low bits).
    Nothing is written unless every key is this shard's.

    Returns:
        ``(applied count, -1)``, or ``(0, index of the first foreign key)`` (negative, another tag or
        rank, or a slot past ``max_items``) with nothing written. O(B), two passes (checks, then writes).
    """
    n = keys.shape[0]
    for i in range(n):
        k = keys[i]
        if k < 0 or ((k >> _TAG_SHIFT) & TAG_MASK) != tag or ((k >> _RANK_SHIFT) & RANK_MASK) != rank \
                or (k & SLOT_MASK) >= max_items:
            return 0, i
    m = 0
    for i in range(n):
        if i + AHEAD < n:
            t = keys[i + AHEAD] & SLOT_MASK
            _prefetch(status, t)
            if keep_raw:
                _prefetch(priority, t)
        k = keys[i]
        s = k & SLOT_MASK
        st = np.int64(status[s])
        ok = (st >> alive_shift) == live_code and (st & GEN_MASK) == ((k >> _GEN_SHIFT) & GEN_MASK)
        live[i] = ok
        if ok:
            if keep_raw:
                priority[s] = priorities[i]
            slots_out[m] = s
            values_out[m] = priorities[i]
            m += 1
    return m, -1
