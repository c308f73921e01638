"""Windows of a compressed column (:mod:`gear_mpi.storage.compressed`) into a batch, in two numba calls.

A compressed column's ring of ``capacity`` steps is cut into chunks ``j = position // k``; chunk ``j`` is
*sealed* (``size[j] >= 0`` bytes of a blosc2 chunk at address ``addr[j]``, CRC-32 ``crc[j]``), *open*
(``j == open_index``: its raw steps in ``open_buf``) or *empty* (``size[j] < 0``: zeros).

- :func:`plan_chunks` lists the sealed chunks a set of windows covers, each once (sorted);
- :func:`decode_chunks` checks each one's CRC-32 and decompresses it into its scratch row, all of them in
  one call outside the GIL, in parallel over chunks (numba threads; each thread its own blosc2
  decompression context), by calling python-blosc2's bundled C library (``blosc2_decompress_ctx``)
  through its address: no Python between chunks;
- :func:`copy_windows` copies each window's steps from the scratch rows (or the open chunk, or zeros)
  into its batch row, padding zeroed, in parallel over windows.

The C function is passed as an address (not a ctypes object), so the kernels are cached on disk like the
others; a caller keeps the library loaded and one context per numba thread (see the storage module).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import get_thread_id, njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from .gather import SERIAL_BYTES, _memmove_from, _memzero


def _crc_table() -> np.ndarray:
    """CRC-32 (IEEE 802.3, reflected, zlib's) slice-by-8 tables, int64 ``[8, 256]``: row 0 the byte-wise table,
    row ``s`` a byte's contribution ``s`` bytes further on (:func:`crc32_at` folds 8 bytes a step)."""
    t = np.zeros((8, 256), np.int64)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (0xEDB88320 ^ (c >> 1)) if c & 1 else c >> 1
        t[0, n] = c
    for s in range(1, 8):
        t[s] = (t[s - 1] >> 8) ^ t[0][t[s - 1] & 0xFF]
    return t


#: zlib.crc32's lookup tables, slice-by-8 (the kernels' checksum equals ``zlib.crc32`` of the same bytes)
CRC_TABLE = _crc_table()

#: what :func:`decode_chunks` records per chunk
OK, BAD_CRC, BAD_FRAME = 0, 1, 2


@intrinsic
def _byte_at(typingctx, addr):
    """The byte at address ``addr`` (int64), as uint8."""
    sig = types.uint8(addr)

    def codegen(context, builder, signature, args):
        return builder.load(builder.inttoptr(args[0], ir.IntType(8).as_pointer()))

    return sig, codegen


@intrinsic
def _address(typingctx, arr):
    """The address of a 1-d array's first byte, as int64."""
    sig = types.int64(arr)

    def codegen(context, builder, signature, args):
        a = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.ptrtoint(a.data, ir.IntType(64))

    return sig, codegen


@intrinsic
def _decompress_call(typingctx, fn, ctx, src, src_size, dst, dst_size):
    """``((int (*)(void*, const void*, int32, void*, int32)) fn)(ctx, src, src_size, dst, dst_size)``: a call of
    ``blosc2_decompress_ctx`` by its address (all arguments integers)."""
    sig = types.int32(fn, ctx, src, src_size, dst, dst_size)

    def codegen(context, builder, signature, args):
        i32, vp = ir.IntType(32), cgutils.voidptr_t
        fnty = ir.FunctionType(i32, [vp, vp, i32, vp, i32])
        f = builder.inttoptr(args[0], fnty.as_pointer())
        return builder.call(f, [builder.inttoptr(args[1], vp), builder.inttoptr(args[2], vp),
                                builder.trunc(args[3], i32) if args[3].type.width > 32 else args[3],
                                builder.inttoptr(args[4], vp),
                                builder.trunc(args[5], i32) if args[5].type.width > 32 else args[5]])

    return sig, codegen


@intrinsic
def _u32_at(typingctx, addr):
    """The 4 bytes at address ``addr`` (int64, any alignment) as a little-endian unsigned integer, in an int64."""
    sig = types.int64(addr)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.zext(builder.load(builder.inttoptr(args[0], i32.as_pointer()), align=1), ir.IntType(64))

    return sig, codegen


@njit(cache=True, nogil=True)
def crc32_at(addr, n, table):
    """``zlib.crc32`` of the ``n`` bytes at address ``addr`` (``table``: :data:`CRC_TABLE`). O(n), 8 bytes a
    step (slice-by-8; little-endian machines), the last ``n % 8`` byte by byte."""
    c = np.int64(0xFFFFFFFF)
    i = 0
    while i + 8 <= n:
        one = _u32_at(addr + i) ^ c
        two = _u32_at(addr + i + 4)
        c = (table[7, one & 0xFF] ^ table[6, (one >> 8) & 0xFF] ^ table[5, (one >> 16) & 0xFF] ^ table[4, one >> 24]
             ^ table[3, two & 0xFF] ^ table[2, (two >> 8) & 0xFF] ^ table[1, (two >> 16) & 0xFF] ^ table[0, two >> 24])
        i += 8
    while i < n:
        c = table[0, (c ^ _byte_at(addr + i)) & 0xFF] ^ (c >> 8)
        i += 1
    return c ^ np.int64(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def plan_chunks(k, capacity, size, open_index, starts, n_valid, window):
    """The sealed chunks the windows cover, sorted, each once (int64), after checking every window.

    Args:
        k, capacity: steps per chunk and in the ring; size: each chunk's sealed bytes (-1: not sealed).
        open_index: the open chunk (-1: none); starts, n_valid: each window's first ring step and real steps.
        window: steps per batch row (for the checks).
    Raises:
        ValueError: a window outside the ring (nothing planned).
    Cost: O(chunks covered * log), serial.
    """
    b = starts.shape[0]
    count = 0
    for i in range(b):
        if not (0 <= starts[i] < capacity and 0 <= n_valid[i] <= min(window, capacity)):
            raise ValueError("compressed gather: a window lies outside the ring")
        if n_valid[i] > 0:
            count += (n_valid[i] + k - 1) // k + 2
    ids = np.empty(count, np.int64)
    m = 0
    for i in range(b):
        pos, left = starts[i], n_valid[i]
        while left > 0:
            j = pos // k
            take = min(left, min((j + 1) * k, capacity) - pos)
            if j != open_index and size[j] >= 0:
                ids[m] = j
                m += 1
            left -= take
            pos = (pos + take) % capacity
    ids = np.sort(ids[:m])
    u = 0
    for i in range(m):
        if i == 0 or ids[i] != ids[i - 1]:
            ids[u] = ids[i]
            u += 1
    return ids[:u].copy()


@njit(cache=True, inline="always")
def _decode_one(u, fn, contexts, addr, size, crc, table, ids, k, capacity, step_bytes, scratch, row_bytes, err):
    j = ids[u]
    n = min(k, capacity - j * k) * step_bytes
    if crc32_at(addr[j], size[j], table) != crc[j]:
        err[u] = BAD_CRC
        return
    got = _decompress_call(fn, contexts[get_thread_id()], addr[j], np.int32(size[j]),
                           _address(scratch) + u * row_bytes, np.int32(n))
    err[u] = OK if got == n else BAD_FRAME


@njit(cache=True, parallel=True, nogil=True)
def decode_chunks(fn, contexts, addr, size, crc, table, ids, k, capacity, step_bytes, scratch, err):
    """Check and decompress sealed chunks ``ids`` into scratch rows ``0..len(ids)-1`` (``k * step_bytes``
    bytes each); ``err[u]`` gets :data:`OK`, :data:`BAD_CRC` (its bytes differ from their checksum: not
    decompressed) or :data:`BAD_FRAME` (blosc2 did not give the chunk's raw size back).

    Args:
        fn: the address of ``blosc2_decompress_ctx``; contexts: one decompression context address per numba
            thread (``get_thread_id()`` picks it); the caller keeps other threads off them during the call.
        addr, size, crc: the ring's chunk table; table: :data:`CRC_TABLE`.
        ids: :func:`plan_chunks`' answer; k, capacity, step_bytes: the ring's geometry.
        scratch: uint8, at least ``len(ids) * k * step_bytes`` bytes; err: int64, ``len(ids)``.
    Cost: one CRC over each chunk's compressed bytes and one decompression each, in parallel over chunks
    past ``SERIAL_BYTES`` of output; no allocation, no GIL.
    """
    m = ids.shape[0]
    row_bytes = k * step_bytes
    if scratch.shape[0] < m * row_bytes or err.shape[0] < m:
        raise ValueError("decode_chunks: scratch or err too small")
    if m * row_bytes < SERIAL_BYTES or m < 2:
        for u in range(m):
            _decode_one(u, fn, contexts, addr, size, crc, table, ids, k, capacity, step_bytes, scratch, row_bytes,
                        err)
    else:
        for u in prange(m):
            _decode_one(u, fn, contexts, addr, size, crc, table, ids, k, capacity, step_bytes, scratch, row_bytes,
                        err)


@njit(cache=True, inline="always")
def _copy_one(i, ids, open_buf, open_index, k, capacity, sb, starts, n_valid, pad_front, out_rows, out, window,
              scratch):
    row_bytes = window * sb
    base = out_rows[i] * row_bytes
    pf, nv = pad_front[i], n_valid[i]
    if pf > 0:
        _memzero(out, base, pf * sb)
    at = base + pf * sb
    pos, left = starts[i], nv
    while left > 0:
        j = pos // k
        lo = j * k
        take = min(left, min(lo + k, capacity) - pos)
        nb = take * sb
        if j == open_index:
            _memmove_from(out, at, _address(open_buf) + (pos - lo) * sb, nb)
        else:
            u = np.searchsorted(ids, j)
            if u < ids.shape[0] and ids[u] == j:
                _memmove_from(out, at, _address(scratch) + u * k * sb + (pos - lo) * sb, nb)
            else:  # never written: zeros, as a new ring's steps
                _memzero(out, at, nb)
        at += nb
        left -= take
        pos = (pos + take) % capacity
    end = base + (pf + nv) * sb
    if end < base + row_bytes:
        _memzero(out, end, base + row_bytes - end)


@njit(cache=True, parallel=True, nogil=True)
def copy_windows(ids, open_buf, open_index, k, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out,
                 window, scratch):
    """Window ``i`` into batch row ``out_rows[i]`` of ``out`` (flat bytes, ``window * step_bytes`` a row):
    ``pad_front[i]`` zero steps, ``n_valid[i]`` steps from ring position ``starts[i]`` (wrapping; sealed
    chunks from their scratch rows as :func:`decode_chunks` left them, the open chunk from ``open_buf``,
    empty ones as zeros), then zeros.

    Raises:
        ValueError: a row outside ``out`` or padding that does not fit (checked before anything is written).
    Cost: each delivered byte copied once, parallel over windows past ``SERIAL_BYTES``; no allocation.
    """
    b = starts.shape[0]
    row_bytes = window * step_bytes
    for i in range(b):
        if not (0 <= out_rows[i] and (out_rows[i] + 1) * row_bytes <= out.shape[0]
                and 0 <= pad_front[i] <= window - n_valid[i]):
            raise ValueError("compressed gather: a window lies outside the batch")
    if b * row_bytes < SERIAL_BYTES:
        for i in range(b):
            _copy_one(i, ids, open_buf, open_index, k, capacity, step_bytes, starts, n_valid, pad_front, out_rows,
                      out, window, scratch)
    else:
        for i in prange(b):
            _copy_one(i, ids, open_buf, open_index, k, capacity, step_bytes, starts, n_valid, pad_front, out_rows,
                      out, window, scratch)


@njit(cache=True, inline="always")
def _step_address(p, ids, scratch_addr, open_addr, open_index, k, sb):
    """The address of ring step ``p`` among the decoded chunks (or the open one); 0: never written (zeros)."""
    j = p // k
    if j == open_index:
        return open_addr + (p - j * k) * sb
    u = np.searchsorted(ids, j)
    if u < ids.shape[0] and ids[u] == j:
        return scratch_addr + u * k * sb + (p - j * k) * sb
    return 0


@njit(cache=True, inline="always")
def _stack_window(i, ids, scratch_addr, open_addr, open_index, k, capacity, sb, win_start, before, n_valid, pad_front,
                  rows, frames, offset, pad_zeros, out, window):
    stack_bytes = frames * sb
    row_bytes = window * stack_bytes
    base = rows[i] * row_bytes
    pf, nv = pad_front[i], n_valid[i]
    if pf > 0:
        _memzero(out, base, pf * stack_bytes)
    first = -before[i]
    for t in range(nv):
        o = base + (pf + t) * stack_bytes
        for f in range(frames):
            rel = t + offset - (frames - 1) + f
            if rel < first:
                if pad_zeros:
                    _memzero(out, o + f * sb, sb)
                    continue
                rel = first
            a = _step_address((win_start[i] + rel) % capacity, ids, scratch_addr, open_addr, open_index, k, sb)
            if a == 0:
                _memzero(out, o + f * sb, sb)
            else:
                _memmove_from(out, o + f * sb, a, sb)
    end = base + (pf + nv) * stack_bytes
    if end < base + row_bytes:
        _memzero(out, end, base + row_bytes - end)


@njit(cache=True, parallel=True, nogil=True)
def stack_windows(ids, scratch, open_buf, open_index, k, capacity, step_bytes, win_start, before, n_valid, pad_front,
                  rows, frames, offset, pad_zeros, out, window):
    """A derived column (frame stacks or next steps, :mod:`gear_mpi.kernels.frames`' rule) of rows ``rows`` of
    ``out`` straight from decoded chunks (:func:`decode_chunks`' scratch rows for ``ids``, the open chunk,
    zeros for chunks never written): no context windows in between.

    Args: as :func:`gear_mpi.kernels.frames.rebuild_frames`, the source ring given by its chunks; every step a
    window reads (``before`` steps back to ``n_valid + offset`` on, wrapping) must lie in a chunk of ``ids``
    or the open one (the caller plans them so).
    Raises:
        ValueError: a window outside the ring or the batch (checked before anything is written).
    Cost: ``frames`` copies of ``step_bytes`` per real step, a binary search over ``ids`` each; parallel over
    windows past ``SERIAL_BYTES``; no allocation.
    """
    b = win_start.shape[0]
    row_bytes = window * frames * step_bytes
    for i in range(b):
        if not (0 <= win_start[i] < capacity and 0 <= n_valid[i] <= window and 0 <= pad_front[i] <= window - n_valid[i]
                and 0 <= before[i] and 0 <= rows[i] and (rows[i] + 1) * row_bytes <= out.shape[0]):
            raise ValueError("stack_windows: a window lies outside the ring or the batch")
    s_addr, o_addr = _address(scratch), _address(open_buf)
    if b * row_bytes < SERIAL_BYTES:
        for i in range(b):
            _stack_window(i, ids, s_addr, o_addr, open_index, k, capacity, step_bytes, win_start, before, n_valid,
                          pad_front, rows, frames, offset, pad_zeros, out, window)
    else:
        for i in prange(b):
            _stack_window(i, ids, s_addr, o_addr, open_index, k, capacity, step_bytes, win_start, before, n_valid,
                          pad_front, rows, frames, offset, pad_zeros, out, window)


@njit(cache=True, inline="always")
def _put_steps(i, src, r0, take, sb, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, first):
    """Every slot of window ``i``'s columns that reads one of the relative steps ``r0 .. r0 + take - 1`` (their
    bytes at address ``src`` on, one after the other; 0: zeros) gets its step."""
    nv = n_valid[i]
    for c in range(frames.shape[0]):
        out = outs[c]
        fr = frames[c]
        stack = fr * sb
        base = rows[i] * window * stack + pad_front[i] * stack
        d0 = offsets[c] - (fr - 1)
        for f in range(fr):
            d = d0 + f  # slot (t, f) reads relative step t + d
            t_lo = max(0, max(r0, first) - d)
            t_hi = min(nv, r0 + take - d)
            if t_hi > t_lo and fr == 1:  # one run of steps
                if src == 0:
                    _memzero(out, base + t_lo * sb, (t_hi - t_lo) * sb)
                else:
                    _memmove_from(out, base + t_lo * sb, src + (t_lo + d - r0) * sb, (t_hi - t_lo) * sb)
            else:
                for t in range(t_lo, t_hi):
                    if src == 0:
                        _memzero(out, base + t * stack + f * sb, sb)
                    else:
                        _memmove_from(out, base + t * stack + f * sb, src + (t + d - r0) * sb, sb)
            if not pad_zeros[c] and r0 <= first < r0 + take:  # steps before the trajectory: its first again
                for t in range(min(nv, first - d)):
                    if src == 0:
                        _memzero(out, base + t * stack + f * sb, sb)
                    else:
                        _memmove_from(out, base + t * stack + f * sb, src + (first - r0) * sb, sb)


@njit(cache=True, inline="always")
def _fill_window(i, fn, contexts, addr, size, crc, table, open_addr, open_index, k, capacity, sb, win_start, before,
                 n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, tmp_addr, err, bad):
    nv, pf, first = n_valid[i], pad_front[i], -before[i]
    lo, hi = np.int64(1) << 62, -(np.int64(1) << 62)
    for c in range(frames.shape[0]):  # padding and zero frames; the span of steps read
        out = outs[c]
        fr = frames[c]
        stack = fr * sb
        base = rows[i] * window * stack
        if pf > 0:
            _memzero(out, base, pf * stack)
        end = base + (pf + nv) * stack
        if end < base + window * stack:
            _memzero(out, end, base + window * stack - end)
        if nv > 0:
            d0 = offsets[c] - (fr - 1)
            lo = min(lo, max(first, d0))
            hi = max(hi, nv - 1 + offsets[c])
            if pad_zeros[c]:
                for t in range(min(nv, first - d0)):
                    for f in range(min(fr, first - d0 - t)):
                        _memzero(out, base + (pf + t) * stack + f * sb, sb)
    pos = (win_start[i] + lo) % capacity
    left = hi - lo + 1
    r0 = lo
    while left > 0:  # the span chunk by chunk, each decoded once into this thread's row
        j = pos // k
        cs = j * k
        take = min(left, min(cs + k, capacity) - pos)
        if j == open_index:
            src = open_addr + (pos - cs) * sb
        elif size[j] < 0:
            src = np.int64(0)
        else:
            if crc32_at(addr[j], size[j], table) != crc[j]:
                err[i], bad[i] = BAD_CRC, j
                return
            n = min(k, capacity - cs) * sb
            got = _decompress_call(fn, contexts[get_thread_id()], addr[j], np.int32(size[j]), tmp_addr, np.int32(n))
            if got != n:
                err[i], bad[i] = BAD_FRAME, j
                return
            src = tmp_addr + (pos - cs) * sb
        _put_steps(i, src, r0, take, sb, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, first)
        pos = (pos + take) % capacity
        left -= take
        r0 += take


@njit(cache=True, parallel=True, nogil=True)
def fill_windows(fn, contexts, addr, size, crc, table, open_buf, open_index, k, capacity, step_bytes, win_start,
                 before, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, tmp, err, bad):
    """Windows of one compressed column ring into batch columns, each window's chunks decoded where it is
    copied: for window ``i``, the chunks its steps cover (from ``before[i]`` steps before it to the last
    step any column reads) are checked and decompressed one after the other into this thread's row of
    ``tmp`` (L1/L2-sized, reused: no scratch of the whole batch) and, from there, every slot of every
    column of row ``rows[i]`` that reads one of their steps is copied; the open chunk is read in place,
    chunks never written as zeros.

    Columns ``c`` (``outs[c]``: flat bytes, ``[rows, window, frames[c], step]``) follow
    :mod:`gear_mpi.kernels.frames`' rule: slot ``(t, f)`` reads step ``t + offsets[c] - frames[c] + 1 + f``
    of the window, a step before the trajectory (``< -before[i]``) reading its first again or, with
    ``pad_zeros[c]``, zeros; ``frames = 1, offset = 0`` is the column's own window. ``pad_front[i]`` zero
    steps lead each row, zeros follow its ``n_valid[i]`` real ones.

    Args:
        fn, contexts, addr, size, crc, table: as :func:`decode_chunks`; open_buf, open_index: the open chunk.
        k, capacity, step_bytes: the ring's geometry.
        win_start, before, n_valid, pad_front, rows: int64 per window (``win_start`` in the ring).
        frames, offsets, pad_zeros: int64 / bool per column; outs: a tuple of the columns' flat bytes.
        window: steps per batch row. tmp: uint8, ``k * step_bytes`` bytes per numba thread (``len(contexts)``).
        err, bad: int64 per window, zeros: :data:`BAD_CRC` / :data:`BAD_FRAME` and the chunk for a window
            whose chunk failed (its row then partly written: the caller raises).
    Raises:
        ValueError: a window outside the ring or the batch (checked before anything is written).
    Cost: one CRC-32 (8 bytes a step) and one decompression per chunk per window covering it (a chunk
    shared by windows is decoded for each: a batch of rare overlaps costs no planning), ``frames`` step
    copies per window step and column, from a row still in cache; parallel over windows past
    ``SERIAL_BYTES`` of output; no allocation, no GIL.
    """
    b = win_start.shape[0]
    sb = step_bytes
    need, ahead = 0, 0
    for c in range(frames.shape[0]):
        need += window * frames[c] * sb
        ahead = max(ahead, offsets[c])
        if not (frames[c] >= 1 and 0 <= offsets[c] <= 1):
            raise ValueError("compressed gather: a column's frames or offset out of range")
    if tmp.shape[0] < contexts.shape[0] * k * sb or err.shape[0] < b or bad.shape[0] < b:
        raise ValueError("compressed gather: tmp, err or bad too small")
    for i in range(b):
        ok = (0 <= win_start[i] < capacity and 0 <= n_valid[i] <= window and 0 <= pad_front[i] <= window - n_valid[i]
              and 0 <= before[i] and before[i] + n_valid[i] + ahead <= capacity and 0 <= rows[i])
        for c in range(frames.shape[0]):
            ok = ok and (rows[i] + 1) * window * frames[c] * sb <= outs[c].shape[0]
        if not ok:
            raise ValueError("compressed gather: a window lies outside the ring or the batch")
    t_addr, o_addr = _address(tmp), _address(open_buf)
    row = k * sb
    if b * need < SERIAL_BYTES:
        for i in range(b):
            _fill_window(i, fn, contexts, addr, size, crc, table, o_addr, open_index, k, capacity, sb, win_start,
                         before, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window,
                         t_addr + get_thread_id() * row, err, bad)
    else:
        for i in prange(b):
            _fill_window(i, fn, contexts, addr, size, crc, table, o_addr, open_index, k, capacity, sb, win_start,
                         before, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window,
                         t_addr + get_thread_id() * row, err, bad)
