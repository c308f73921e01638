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
    """The CRC-32 (IEEE 802.3, reflected, zlib's) table of 256 entries."""
    t = np.zeros(256, np.uint32)
    for n in range(256):
        c = n
        for _ in range(8):
            c = (0xEDB88320 ^ (c >> 1)) if c & 1 else c >> 1
        t[n] = c
    return t


#: zlib.crc32's lookup table (the kernels' checksum equals ``zlib.crc32`` of the same bytes)
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


@njit(cache=True, nogil=True)
def crc32_at(addr, n, table):
    """``zlib.crc32`` of the ``n`` bytes at address ``addr``. O(n), byte by byte (chunks are small)."""
    c = np.uint32(0xFFFFFFFF)
    for i in range(n):
        c = table[(c ^ _byte_at(addr + i)) & 0xFF] ^ (c >> np.uint32(8))
    return c ^ np.uint32(0xFFFFFFFF)


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
