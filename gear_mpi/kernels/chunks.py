"""Windows of a compressed column (:mod:`gear_mpi.storage.compressed`) into a batch, in one numba call.

A compressed column's ring of ``capacity`` steps is cut into chunks ``j = position // k``; chunk ``j`` is
*sealed* (``size[j] >= 0`` bytes of a blosc2 chunk at address ``base + addr[j]``, CRC-32 ``crc[j]``), *open*
(``j == open_index``: its raw steps in ``open_buf``) or *empty* (``size[j] < 0``: zeros).

:func:`fill_windows` takes the windows in ring order, in parallel over windows (numba threads, each with
its own blosc2 decompression context and two chunk rows of scratch): a window's chunks are checked
(CRC-32, :func:`crc32_at`) and decompressed by python-blosc2's bundled C library
(``blosc2_decompress_ctx``, called through its address: no Python between chunks, no GIL) into a row
still in cache, and every slot of the batch columns that reads their steps is copied from there: the
column's own window and the frame stacks / next steps built on it (:mod:`gear_mpi.kernels.frames`' rule),
so a one-step transition with a stack of 4 and its next observation decodes the 2 chunks its 5 frames
lie in and writes its 9 frames once each. A chunk a thread's previous window left in a row is not decoded
again (windows sharing chunks: small rings, large batches).

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
from .hints import _fence  # orders a thread's non-temporal stores before what follows


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

#: what :func:`fill_windows` records per window
OK, BAD_CRC, BAD_FRAME = 0, 1, 2
#: output bytes of a call from which the batch is written with non-temporal stores (:func:`_copy_to`): past
#: the caches' share, writing lines without reading them first is faster (16 MiB of 84x84 stacks: about
#: 0.8 ms against 0.9-1.3 ms), below it slower (2 MiB: 0.10 against 0.055 ms)
STREAM_BYTES = 8 << 20


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
def _stream32(typingctx, dst, src, blocks):
    """``blocks`` 32-byte blocks from address ``src`` (any alignment) to address ``dst`` (32-aligned) with
    non-temporal stores: the destination's lines are written without being read first or kept in cache."""
    sig = types.void(dst, src, blocks)

    def codegen(context, builder, signature, args):
        vt = ir.VectorType(ir.IntType(64), 4)
        d, s = builder.inttoptr(args[0], vt.as_pointer()), builder.inttoptr(args[1], vt.as_pointer())
        streaming = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        with cgutils.for_range(builder, args[2]) as loop:
            v = builder.load(builder.gep(s, [loop.index]), align=1)
            builder.store(v, builder.gep(d, [loop.index]), align=32).set_metadata("nontemporal", streaming)
        return context.get_dummy_value()

    return sig, codegen


@njit(cache=True, inline="always")
def _copy_to(out, at, src, n, stream):
    """``out[at:at + n]`` = the ``n`` bytes at address ``src``: one ``memmove``, or with ``stream`` (and ``n`` of
    a few lines) non-temporal stores between two small ``memmove``s that align the destination."""
    if not stream or n < 256:
        _memmove_from(out, at, src, n)
        return
    dst = _address(out) + at
    h = (32 - dst % 32) % 32
    if h:
        _memmove_from(out, at, src, h)
    m = (n - h) // 32
    _stream32(dst + h, src + h, m)
    t = h + m * 32
    if t < n:
        _memmove_from(out, at + t, src + t, n - t)


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


@njit(cache=True, inline="always")
def _put_steps(i, src, r0, take, sb, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, first,
               stream):
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
                    _copy_to(out, base + t_lo * sb, src + (t_lo + d - r0) * sb, (t_hi - t_lo) * sb, stream)
            else:
                for t in range(t_lo, t_hi):
                    if src == 0:
                        _memzero(out, base + t * stack + f * sb, sb)
                    else:
                        _copy_to(out, base + t * stack + f * sb, src + (t + d - r0) * sb, sb, stream)
            if not pad_zeros[c] and r0 <= first < r0 + take:  # steps before the trajectory: its first again
                for t in range(min(nv, first - d)):
                    if src == 0:
                        _memzero(out, base + t * stack + f * sb, sb)
                    else:
                        _copy_to(out, base + t * stack + f * sb, src + (first - r0) * sb, sb, stream)


@njit(cache=True, inline="always")
def _fill_window(i, fn, contexts, chunk_base, addr, size, crc, table, open_addr, open_index, k, capacity, sb,
                 win_start, before,
                 n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, tmp_addr, held, err, bad, stream):
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
    row = k * sb
    while left > 0:  # the span chunk by chunk, each decoded into one of this thread's two rows (or still there)
        j = pos // k
        cs = j * k
        take = min(left, min(cs + k, capacity) - pos)
        if j == open_index:
            src = open_addr + (pos - cs) * sb
        elif size[j] < 0:
            src = np.int64(0)
        else:
            if held[0] == j:
                at = 0
            elif held[1] == j:
                at = 1
            else:
                at = 0 if held[2] == 1 else 1  # not the row decoded last: the window's chunk before stays
                held[at] = -1
                if crc32_at(chunk_base + addr[j], size[j], table) != crc[j]:
                    err[i], bad[i] = BAD_CRC, j
                    return
                n = min(k, capacity - cs) * sb
                got = _decompress_call(fn, contexts[get_thread_id()], chunk_base + addr[j], np.int32(size[j]),
                                       tmp_addr + at * row,
                                       np.int32(n))
                if got != n:
                    err[i], bad[i] = BAD_FRAME, j
                    return
                held[at] = j
            held[2] = at
            src = tmp_addr + at * row + (pos - cs) * sb
        _put_steps(i, src, r0, take, sb, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, first,
                   stream)
        pos = (pos + take) % capacity
        left -= take
        r0 += take
    if stream:
        _fence()


@njit(cache=True, parallel=True, nogil=True)
def fill_windows(fn, contexts, base, addr, size, crc, table, open_buf, open_index, k, capacity, step_bytes, win_start,
                 before, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window, tmp, err, bad):
    """Windows of one compressed column ring into batch columns, each window's chunks decoded where they
    are copied: the windows are taken in ring order; for window ``i``, the chunks its steps cover (from
    ``before[i]`` steps before it to the last step any column reads) are checked and decompressed one
    after the other into one of this thread's two rows of ``tmp`` (cache-sized, reused: no scratch of the
    whole batch; a chunk still in a row from the window before is not decoded again) and, from there,
    every slot of every column of row ``rows[i]`` that reads one of their steps is copied; the open chunk
    is read in place, chunks never written as zeros.

    Columns ``c`` (``outs[c]``: flat bytes, ``[rows, window, frames[c], step]``) follow
    :mod:`gear_mpi.kernels.frames`' rule: slot ``(t, f)`` reads step ``t + offsets[c] - frames[c] + 1 + f``
    of the window, a step before the trajectory (``< -before[i]``) reading its first again or, with
    ``pad_zeros[c]``, zeros; ``frames = 1, offset = 0`` is the column's own window. ``pad_front[i]`` zero
    steps lead each row, zeros follow its ``n_valid[i]`` real ones.

    Args:
        fn, contexts: the address of ``blosc2_decompress_ctx`` and one decompression context per numba
            thread (the caller keeps other threads off them); base, addr, size, crc: the ring's chunk table
            (chunk ``j``'s bytes at address ``base + addr[j]``: base 0 and addresses, or a mapping's address and
            offsets in it, as a node peer reads an owner's shared table);
            table: :data:`CRC_TABLE`; open_buf, open_index: the open chunk.
        k, capacity, step_bytes: the ring's geometry.
        win_start, before, n_valid, pad_front, rows: int64 per window (``win_start`` in the ring).
        frames, offsets, pad_zeros: int64 / bool per column; outs: a tuple of the columns' flat bytes.
        window: steps per batch row. tmp: uint8, ``2 * k * step_bytes`` bytes per numba thread
            (``len(contexts)``).
        err, bad: int64 per window, zeros: :data:`BAD_CRC` / :data:`BAD_FRAME` and the chunk for a window
            whose chunk failed (its row then partly written: the caller raises).
    Raises:
        ValueError: a window outside the ring or the batch (checked before anything is written).
    Cost: a sort of the windows by ring start; one CRC-32 (8 bytes a step) and one decompression per chunk
    per run of windows covering it in a thread's share; ``frames`` step copies per window step and column,
    from a row still in cache (non-temporal stores from :data:`STREAM_BYTES` of output); parallel over
    windows past ``SERIAL_BYTES`` of output; no GIL.
    """
    b = win_start.shape[0]
    sb = step_bytes
    need, ahead = 0, 0
    for c in range(frames.shape[0]):
        need += window * frames[c] * sb
        ahead = max(ahead, offsets[c])
        if not (frames[c] >= 1 and 0 <= offsets[c] <= 1):
            raise ValueError("compressed gather: a column's frames or offset out of range")
    threads = contexts.shape[0]
    if tmp.shape[0] < threads * 2 * k * sb or err.shape[0] < b or bad.shape[0] < b:
        raise ValueError("compressed gather: tmp, err or bad too small")
    for i in range(b):
        ok = (0 <= win_start[i] < capacity and 0 <= n_valid[i] <= window and 0 <= pad_front[i] <= window - n_valid[i]
              and 0 <= before[i] and before[i] + n_valid[i] + ahead <= capacity and 0 <= rows[i])
        for c in range(frames.shape[0]):
            ok = ok and (rows[i] + 1) * window * frames[c] * sb <= outs[c].shape[0]
        if not ok:
            raise ValueError("compressed gather: a window lies outside the ring or the batch")
    order = np.argsort(win_start)
    held = np.full((threads, 3), -1, np.int64)  # per thread: the chunks in its two rows, the row used last
    t_addr, o_addr = _address(tmp), _address(open_buf)
    row2 = 2 * k * sb
    stream = b * need >= STREAM_BYTES
    if b * need < SERIAL_BYTES:
        for q in range(b):
            th = get_thread_id()
            _fill_window(order[q], fn, contexts, base, addr, size, crc, table, o_addr, open_index, k, capacity, sb,
                         win_start, before, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window,
                         t_addr + th * row2, held[th], err, bad, stream)
    else:
        for q in prange(b):
            th = get_thread_id()
            _fill_window(order[q], fn, contexts, base, addr, size, crc, table, o_addr, open_index, k, capacity, sb,
                         win_start, before, n_valid, pad_front, rows, frames, offsets, pad_zeros, outs, window,
                         t_addr + th * row2, held[th], err, bad, stream)
