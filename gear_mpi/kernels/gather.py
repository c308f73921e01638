"""Window gather: copy sampled windows from a step ring into a batch (CPU kernels).

Every column of a shard is a ring of ``capacity`` steps viewed as bytes,
``src[capacity * step_bytes]``. A window is ``n_valid`` consecutive ring steps
from ``start`` (wrapping at the end of the ring) placed at row ``pad_front`` of a
``window``-step output row; the rest of that row is zero padding.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .hints import prefetch as _prefetch
from .hints import counters, prefetch_address, take_next

# Smaller batches than these run on the calling thread: a parallel region costs microseconds
# of thread-pool hand-off when the pool is spinning, and a scheduler tick (~4 ms) when
# another process holds a core -- more than copying a small batch.
SERIAL_BYTES = 1 << 18
#: a plain copy (the gather kernels here, the one-call sample's) shares its runs among the threads from this many
#: bytes; SERIAL_BYTES stays the bound of the decoding kernels (chunks, frames), whose bytes cost more. Each
#: parallel region wakes the sleeping workers (gear_mpi.threads): rows of 4 KiB from a W2 shard's ring on the
#: reference VM, one thread / two, us: 256 KiB 16-20 / 48-54, 512 KiB 46-49 / 67-69, 1 MiB 110-113 / 93-96
COPY_THREADS_BYTES = 1 << 20
SERIAL_MASK_CELLS = 1 << 16
SERIAL_PLACE = 1 << 14
# While a window is copied, the first PREFETCH_BYTES of the window PREFETCH_AHEAD places later
# are requested from memory (random 4 KiB rows from DRAM: 90 -> 60 us for 256 rows, one thread).
PREFETCH_AHEAD = 4
PREFETCH_BYTES = 4096
# Windows of a page or more (PAGE_BYTES) ask for their first PAGE_PREFETCH_BYTES only, PAGE_AHEAD
# places later: the hardware streamer fetches the rest of a page once its first lines are asked
# for, so a few lines of many windows keep more misses in flight than whole pages of a few.
# W2 (256 random 4 KiB rows of a 400 MB ring, Shard.sample + update_priorities, one thread,
# 2-core EPYC VM, 2026-12-02, alternating): 0.244-0.355 ms -> 0.208-0.298 ms a cycle. Smaller
# windows keep the whole-window prefetch (hopper windows of 2.8 KiB from cache were 20-30 %
# slower with the short one).
PAGE_BYTES = 4096
PAGE_AHEAD = 16
PAGE_PREFETCH_BYTES = 256


def _destination(context, builder, dst_type, dst, offset):
    """``(void *) dst + offset``, ``dst`` a 1-d byte array or an integer address."""
    if isinstance(dst_type, types.Integer):
        return builder.gep(builder.inttoptr(dst, cgutils.voidptr_t), [offset])
    d = context.make_array(dst_type)(context, builder, dst)
    return builder.gep(builder.bitcast(d.data, cgutils.voidptr_t), [offset])


@intrinsic
def _memzero(typingctx, dst, dst_off, nbytes):
    """``dst[dst_off:dst_off + nbytes] = 0`` for a 1-d byte array or an address (int64), as one ``memset``."""
    sig = types.void(dst, types.intp, types.intp)

    def codegen(context, builder, signature, args):
        cgutils.memset(builder, _destination(context, builder, signature.args[0], args[0], args[1]), args[2], 0)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _gather_run(base, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, row_bytes, lo, hi):
    """Windows ``lo:hi`` of the column ring at address ``base`` into rows ``out_rows`` of ``out``, in
    order, each prefetched ``_ahead(row_bytes)`` windows before it is copied."""
    ahead = _ahead(row_bytes)
    for i in range(lo, min(lo + ahead, hi)):
        _prefetch_window_addr(base, capacity, step_bytes, starts[i], n_valid[i])
    for i in range(lo, hi):
        if i + ahead < hi:
            _prefetch_window_addr(base, capacity, step_bytes, starts[i + ahead], n_valid[i + ahead])
        _copy_window_from(base, capacity, step_bytes, starts[i], n_valid[i], pad_front[i], out,
                          out_rows[i] * row_bytes, row_bytes)


@njit(cache=True, inline="always")
def _check_windows(capacity, starts, n_valid, pad_front, out_rows, window, rows):
    for i in range(starts.shape[0]):
        if not (0 <= starts[i] < capacity and 0 <= n_valid[i] <= min(window, capacity)
                and 0 <= pad_front[i] <= window - n_valid[i] and 0 <= out_rows[i] < rows):
            raise ValueError("gather: a window lies outside the ring or the batch")


@njit(cache=True, inline="always")
def _gather_column(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, window):
    row_bytes = window * step_bytes
    b = starts.shape[0]
    if b * row_bytes < COPY_THREADS_BYTES:
        _gather_run(src.ctypes.data, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, row_bytes, 0, b)
    else:
        chunks = max(1, min(64, b // 32))  # runs of >= 32 windows, so each run prefetches ahead of itself
        taken = counters(1)  # runs handed out as the threads arrive (hints.take_next)
        for _ in prange(chunks):
            t = take_next(taken)
            while t < chunks:
                _gather_run(src.ctypes.data, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out,
                            row_bytes, t * b // chunks, (t + 1) * b // chunks)
                t = take_next(taken)


@njit(cache=True, parallel=True, nogil=True)
def gather_windows(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, window):
    """Copy windows into ``out`` (bytes, ``[B * window * step_bytes]``), in parallel over windows.

    ``out_rows[i]`` is the batch row that window ``i`` fills. Each delivered byte is
    copied once (``memmove`` of each contiguous run: at most two per window, for the
    ring's wrap-around), padding bytes are written once (zeros). Batches under
    ``COPY_THREADS_BYTES`` run on the calling thread; larger ones in runs of 32 windows or more, handed out as
    the threads arrive (``hints.take_next``). Cost: O(sum n_valid * step_bytes)
    copied plus O(padding) zeroed; memory-bandwidth bound; no allocation. Each thread
    prefetches the start of a window some places ahead of the one it copies (``_ahead``).
    ``out`` must not overlap ``src``. The copies are raw ``memmove`` calls, so every
    window is checked first (O(B), serial): a window outside the ring or the batch
    raises ``ValueError`` before anything is written.
    """
    if src.shape[0] < capacity * step_bytes:
        raise ValueError("gather: src is shorter than capacity * step_bytes")
    _check_windows(capacity, starts, n_valid, pad_front, out_rows, window,
                   out.shape[0] // (window * step_bytes) if window * step_bytes > 0 else 0)
    _gather_column(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, window)


@njit(cache=True, parallel=True, nogil=True)
def gather_columns(srcs, step_bytes, capacity, starts, n_valid, pad_front, out_rows, outs, window, mask):
    """:func:`gather_windows` for every column at once (``srcs``/``outs``: tuples of byte arrays,
    ``step_bytes[c]`` bytes per step of column ``c``), then the mask rows (:func:`fill_mask`) when
    ``mask`` has rows. One call instead of one per column; the same checks first, the same copies."""
    rows = mask.shape[0]
    for c in range(len(srcs)):
        sb = step_bytes[c]
        if srcs[c].shape[0] < capacity * sb:
            raise ValueError("gather: src is shorter than capacity * step_bytes")
        r = outs[c].shape[0] // (window * sb) if window * sb > 0 else 0
        rows = r if c == 0 or r < rows else rows
    _check_windows(capacity, starts, n_valid, pad_front, out_rows, window, rows)
    for c in range(len(srcs)):
        _gather_column(srcs[c], capacity, step_bytes[c], starts, n_valid, pad_front, out_rows, outs[c], window)
    if mask.shape[0] > 0:
        for i in range(starts.shape[0]):
            _mask_row(mask, out_rows[i], pad_front[i], pad_front[i] + n_valid[i], window)


@njit(cache=True, inline="always")
def _mask_row(mask, row, lo, hi, window):
    for t in range(window):
        mask[row, t] = lo <= t and t < hi


@njit(cache=True, parallel=True, nogil=True)
def fill_mask(n_valid, pad_front, out_rows, mask):
    """``mask[row, t]`` is True where step ``t`` of the row is a real step. Cost: O(B * window)."""
    window = mask.shape[1]
    b = n_valid.shape[0]
    if b * window < SERIAL_MASK_CELLS:
        for i in range(b):
            _mask_row(mask, out_rows[i], pad_front[i], pad_front[i] + n_valid[i], window)
    else:
        for i in prange(b):
            _mask_row(mask, out_rows[i], pad_front[i], pad_front[i] + n_valid[i], window)


@njit(cache=True, inline="always")
def _place_one(i, starts, lengths, window, align_code, uniforms, win_start, n_valid, pad_front):
    _place_one_values(i, starts[i], lengths[i], window, align_code, uniforms, win_start, n_valid, pad_front)


@njit(cache=True, inline="always")
def _placement(start, length, window, align_code, u):
    """(ring step the window starts at, real steps, leading padding) of a ``window``-step window of a
    trajectory at ring position ``start``; ``u`` in [0, 1) picks the offset for align 0 (random)."""
    if length >= window:
        if align_code == 0:
            span = length - window + 1
            off = min(int(u * span), span - 1)
        elif align_code == 1:
            off = 0
        else:
            off = length - window
        return start + off, window, 0
    return start, length, window - length if align_code == 2 else 0


@njit(cache=True, inline="always")
def _place_one_values(i, start, length, window, align_code, uniforms, win_start, n_valid, pad_front):
    u = uniforms[i] if align_code == 0 else 0.0
    win_start[i], n_valid[i], pad_front[i] = _placement(start, length, window, align_code, u)


@njit(cache=True, nogil=True)
def place_slots(slots, start, length, capacity, window, align_code, uniforms, win_start, n_valid, pad_front, tail=0):
    """:func:`place_windows` for table ``slots`` (their ``start`` and ``length`` read here), with
    ``win_start`` wrapped into the ring; ``tail`` steps at each trajectory's end are not covered (as
    :func:`fill_choices`). O(B), serial (one pass, no temporaries)."""
    for i in range(slots.shape[0]):
        s = slots[i]
        _place_one_values(i, start[s], length[s] - tail, window, align_code, uniforms, win_start, n_valid, pad_front)
        win_start[i] %= capacity


@njit(cache=True, parallel=True, nogil=True)
def place_windows(starts, lengths, window, align_code, uniforms, win_start, n_valid, pad_front):
    """Where each window lies: ring step it starts at, real steps, leading padding.

    ``align_code``: 0 random (offset uniform over the ``length - window + 1``
    windows inside the trajectory), 1 head, 2 tail. A trajectory shorter than the
    window is taken whole; it is padded at the end, except for ``tail``, which pads
    the front. ``starts`` are ring positions, so the caller wraps ``win_start``
    modulo the capacity. Cost: O(B); serial below ``SERIAL_PLACE`` windows.
    """
    b = starts.shape[0]
    if b < SERIAL_PLACE:
        for i in range(b):
            _place_one(i, starts, lengths, window, align_code, uniforms, win_start, n_valid, pad_front)
    else:
        for i in prange(b):
            _place_one(i, starts, lengths, window, align_code, uniforms, win_start, n_valid, pad_front)


# ---- the replay's exchange: a choice per sampled item, from its owner to its requester ----
# A *choice* is the 48-byte record that tells a requester which window to copy and how to describe
# it. Python reads it through the structured dtype CHOICE (fields by name); kernels and MPI see the
# same bytes as CHOICE_WIDTH int64 words a row, the float fields as their IEEE bits.
CHOICE = np.dtype([("key", np.int64), ("start", np.int64), ("valid", np.int64), ("pad_front", np.int64),
                   ("probability", np.float64), ("weight", np.float64)])
CHOICE_WIDTH = 6  # int64 words per choice
# the word of each field (for kernels)
KEY, START, VALID, PAD_FRONT, PROBABILITY, WEIGHT = range(CHOICE_WIDTH)
assert CHOICE.itemsize == 8 * CHOICE_WIDTH and list(CHOICE.names)[START] == "start"
CHOICE_AHEAD = 16  # table rows requested this many slots ahead


def choice_records(words: np.ndarray) -> np.ndarray:
    """The choices of an ``[n, CHOICE_WIDTH]`` int64 array (C-contiguous rows) as ``n`` records of
    dtype :data:`CHOICE` (a view: no copy), for reading fields by name."""
    return words.view(CHOICE).reshape(words.shape[0])


@njit(cache=True, nogil=True)
def fill_choices(slots, start, length, generation, key_head, gen_shift, gen_mask, capacity, window, align_code,
                 uniforms, leaves, total, choices, weights, tail=0):
    """Owner side: the choice of each chosen slot in ``choices`` (``[B, CHOICE_WIDTH]`` int64): key,
    placement (ring start, real steps, leading padding) and probability ``w / total``; and the index
    weight ``w`` of each in ``weights`` (``leaves`` empty: ordered selectors, probability 1). The
    importance weights (field ``weight``) are the caller's. ``tail``: steps at the end of each trajectory
    that windows do not cover (1 for a spec whose last step holds the final observation,
    :mod:`gear_mpi.frames`). O(B), one pass."""
    proportional = leaves.shape[0] > 0
    b = slots.shape[0]
    for i in range(b):
        if i + CHOICE_AHEAD < b:  # random table rows: ask for later ones while this one is served
            t = slots[i + CHOICE_AHEAD]
            _prefetch(start, t)
            _prefetch(length, t)
            _prefetch(generation, t)
        s = slots[i]
        choices[i, KEY] = key_head | ((generation[s] & gen_mask) << gen_shift) | s
        u = uniforms[i] if align_code == 0 else 0.0
        ws, nv, pf = _placement(start[s], length[s] - tail, window, align_code, u)
        choices[i, START] = ws % capacity
        choices[i, VALID] = nv
        choices[i, PAD_FRONT] = pf
        w = leaves[s] if proportional else 1.0
        weights[i] = w
        choices[i, PROBABILITY] = _float_bits(w / total if proportional else 1.0)


@intrinsic
def _float_bits(typingctx, x):
    """The IEEE bits of a float64, as an int64 (numpy's ``.view(np.int64)`` of one value)."""
    sig = types.int64(types.float64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


@intrinsic
def _bits_float(typingctx, x):
    """The float64 whose IEEE bits are the int64 ``x``."""
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


@intrinsic
def _memmove_from(typingctx, dst, dst_off, src_addr, nbytes):
    """``memmove(dst + dst_off, (void *) src_addr, nbytes)``: a copy from a mapping given by address, as
    one libc ``memmove`` (numba's slice assignment checks for overlap and copies through a temporary
    outside ``prange``: about 10x slower); ``dst`` a 1-d byte array or an address (int64). No bounds
    check: the callers check every window (and, for addresses, every output's size) first."""
    sig = types.void(dst, types.intp, types.int64, types.intp)

    def codegen(context, builder, signature, args):
        dp = _destination(context, builder, signature.args[0], args[0], args[1])
        sp = builder.inttoptr(args[2], cgutils.voidptr_t)
        cgutils.raw_memmove(builder, dp, sp, args[3], 1)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _copy_window_from(base, capacity, step_bytes, start, nv, front_steps, out, row_base, row_bytes):
    """Window ``(start, nv, front_steps)`` of the column ring at address ``base`` into
    ``out[row_base:row_base + row_bytes]``: at most two copies (the ring wraps), two zero fills."""
    front = front_steps * step_bytes
    if front > 0:
        _memzero(out, row_base, front)
    first = min(nv, capacity - start)
    o = row_base + front
    nb = first * step_bytes
    if nb > 0:
        _memmove_from(out, o, base + start * step_bytes, nb)
        o += nb
    rest = nv - first
    if rest > 0:
        nb = rest * step_bytes
        _memmove_from(out, o, base, nb)
        o += nb
    end = row_base + row_bytes
    if o < end:
        _memzero(out, o, end - o)


def out_addresses(outs, rows: int, window: int, step_bytes: np.ndarray) -> np.ndarray:
    """The addresses (int64) of the batch columns ``outs`` (flat byte arrays, C-contiguous), for kernels
    that take them instead of a tuple of arrays: one compiled kernel then serves every column count
    (numba compiles a kernel again for each length of a tuple argument, 20 s each for the one-call
    sampler here). Checks that output ``c`` holds ``rows`` windows of ``window * step_bytes[c]`` bytes.
    The caller keeps ``outs`` alive during the kernel call. O(columns).

    Raises:
        ValueError: a column count that is not ``len(step_bytes)``, a non-contiguous or short output.
    """
    if len(outs) != len(step_bytes):
        raise ValueError(f"gather: {len(outs)} outputs for {len(step_bytes)} columns")
    addresses = np.empty(len(outs), np.int64)
    for c, out in enumerate(outs):
        if not out.flags.c_contiguous or out.nbytes < rows * window * int(step_bytes[c]):
            raise ValueError(f"gather: output {c} is not a contiguous buffer of at least {rows} windows")
        addresses[c] = out.ctypes.data
    return addresses


def gather_from_owners(addrs, step_bytes, capacity, direct, row_of_owner, choices, outs, window, mask, keys,
                       lengths, probabilities) -> None:
    """:func:`gather_rows_from_owners` into the batch columns ``outs`` (a tuple of flat byte arrays, checked
    and passed by address: :func:`out_addresses`)."""
    gather_rows_from_owners(addrs, step_bytes, capacity, direct, row_of_owner, choices,
                            out_addresses(outs, choices.shape[0], window, step_bytes), window, mask, keys, lengths,
                            probabilities)


@njit(cache=True, parallel=True, nogil=True)
def gather_rows_from_owners(addrs, step_bytes, capacity, direct, row_of_owner, choices, outs, window, mask, keys,
                            lengths, probabilities, weights=None):
    """Requester side (``outs``: the addresses of the batch's columns, int64, each holding the batch's
    rows): the rows of a batch from the choices its owners sent (``choices``,
    ``[B, CHOICE_WIDTH]`` int64, in owner order:
    owner ``o`` has rows ``row_of_owner[o]:row_of_owner[o + 1]``). Keys, lengths, probabilities and the
    mask of every row; the data of the rows whose owner's columns this process maps (``direct[o]``),
    copied from ``addrs[o, c]``, the address of owner ``o``'s column ``c`` (a ring of ``capacity``
    steps of ``step_bytes[c]`` bytes, kept mapped by the caller). Every window is checked first: one
    outside the ring raises ValueError before anything is copied. One call per sample; the copies run
    on the calling thread under ``COPY_THREADS_BYTES`` bytes, else in parallel over runs of >= 32 rows, handed out
    as the threads arrive (``hints.take_next``), each prefetching some windows ahead (``_ahead``).
    ``weights`` (float32, optional): each row's importance weight too, the float64 of its choice rounded as
    numpy's assignment rounds it (a ``Replay.sample`` would otherwise copy the strided column in numpy, about
    3 us a call).
    Cost: O(B W) for the mask, each delivered byte copied once."""
    nb = choices.shape[0]
    for i in range(nb):
        if not (0 <= choices[i, START] < capacity and 0 <= choices[i, VALID] <= min(window, capacity)
                and 0 <= choices[i, PAD_FRONT] <= window - choices[i, VALID]):
            raise ValueError("gather: a window lies outside the ring")
        keys[i] = choices[i, KEY]
        lengths[i] = choices[i, VALID]
        probabilities[i] = _bits_float(choices[i, PROBABILITY])
        if weights is not None:
            weights[i] = _bits_float(choices[i, WEIGHT])
        _mask_row(mask, i, choices[i, PAD_FRONT], choices[i, PAD_FRONT] + choices[i, VALID], window)
    # tasks: runs of rows of one direct owner
    n_owners = direct.shape[0]
    ntask = 0
    for o in range(n_owners):
        if direct[o]:
            ntask += max(1, (row_of_owner[o + 1] - row_of_owner[o]) // 32)
    task_owner = np.empty(ntask, np.int64)
    task_lo = np.empty(ntask, np.int64)
    task_hi = np.empty(ntask, np.int64)
    t = 0
    for o in range(n_owners):
        if direct[o]:
            lo = row_of_owner[o]
            cnt = row_of_owner[o + 1] - lo
            runs = max(1, cnt // 32)
            for k in range(runs):
                task_owner[t] = o
                task_lo[t] = lo + k * cnt // runs
                task_hi[t] = lo + (k + 1) * cnt // runs
                t += 1
    starts, n_valid, pad_front = choices[:, START], choices[:, VALID], choices[:, PAD_FRONT]
    rows = np.empty(nb, np.int64)  # filled by a plain loop: np.arange would be a parallel loop (parfor) here
    for i in range(nb):
        rows[i] = i
    row_bytes = 0
    for c in range(step_bytes.shape[0]):
        row_bytes += window * step_bytes[c]
    if nb * row_bytes < COPY_THREADS_BYTES:  # a small batch: waking the workers costs more than the copies
        for t in range(ntask):
            _gather_task(addrs, capacity, step_bytes, starts, n_valid, pad_front, rows, outs, window,
                         task_owner[t], task_lo[t], task_hi[t])
    else:
        taken = counters(1)  # tasks handed out as the threads arrive (hints.take_next)
        for _ in prange(ntask):
            t = take_next(taken)
            while t < ntask:
                _gather_task(addrs, capacity, step_bytes, starts, n_valid, pad_front, rows, outs, window,
                             task_owner[t], task_lo[t], task_hi[t])
                t = take_next(taken)


@njit(cache=True, inline="always")
def _gather_task(addrs, capacity, step_bytes, starts, n_valid, pad_front, rows, outs, window, o, lo, hi):
    for c in range(step_bytes.shape[0]):
        _gather_run(addrs[o, c], capacity, step_bytes[c], starts, n_valid, pad_front, rows, outs[c],
                    window * step_bytes[c], lo, hi)


@njit(cache=True, inline="always")
def _ahead(row_bytes):
    """How many windows ahead to prefetch: about PREFETCH_AHEAD * PREFETCH_BYTES bytes in flight,
    so narrow columns (a few bytes a window, one cache miss each) look further ahead; PAGE_AHEAD for
    windows of a page or more."""
    if row_bytes >= PAGE_BYTES:
        return PAGE_AHEAD
    return min(64, max(PREFETCH_AHEAD, PREFETCH_AHEAD * PREFETCH_BYTES // max(row_bytes, 64)))


@njit(cache=True, inline="always")
def _prefetch_window_addr(base, capacity, step_bytes, start, nv):
    nb = min(nv, capacity - start) * step_bytes
    a = base + start * step_bytes
    for q in range(0, min(nb, PREFETCH_BYTES) if nb < PAGE_BYTES else PAGE_PREFETCH_BYTES, 64):
        prefetch_address(a + q)
