"""CUDA twins (numba-cuda) of :mod:`gear_mpi.kernels.gather`: window gather and mask.

The source is a shard column as bytes, ``src[capacity * step_bytes]``, normally
host memory that is page-locked and mapped into the device's address space
(:mod:`gear_mpi.storage.pinned`), so the kernel reads the ring straight from host memory
(zero copy); it may as well be device memory. The destination is a device batch
buffer viewed as bytes, ``out[B * window * step_bytes]``. Semantics are exactly
those of :func:`gather.gather_windows` / :func:`gather.fill_mask`: window ``i`` is
``n_valid[i]`` ring steps from ``starts[i]`` (wrapping at the end of the ring)
placed at step ``pad_front[i]`` of row ``out_rows[i]``; every other byte of the
row is zero.

One CUDA block per window (grid-stride over windows); the block's threads stride
over the bytes of each of the row's (at most four) contiguous pieces: leading
padding, the valid steps up to the end of the ring, the wrapped rest, trailing
padding. A piece is copied in ``vec``-byte chunks (``vec=16``: each thread moves
one 16-byte chunk as a pair of 8-byte words; ``vec=8``: one 8-byte word per
thread, fully coalesced) where the source and destination addresses are
congruent modulo ``vec`` -- with a byte prologue up to the first aligned address
and a byte epilogue -- and byte by byte otherwise (``vec=0`` forces bytes).
Padding is zeroed with the same chunked stores. Cost: each delivered byte read
once and written once, padding written once; O(B * W) for the mask.

Note: numba has no 128-bit load; compiled for sm_90, the 16-byte chunk is two
``ld.global.u64`` (NVVM does not fuse them into ``ld.global.v2.u64``), so
``vec=8`` (coalesced 8-byte words) may be as fast or faster: scripts/gpu_check.py
measures all three widths.
"""
from __future__ import annotations

import numpy as np

from .cuda_support import as_device, cuda_module, device_address, is_device_array, launch, simulator_enabled

cuda = cuda_module()  # ImportError with the install hint when numba-cuda is missing

VECS = (0, 8, 16)
MAX_GRID = 1 << 30


# ---- device functions --------------------------------------------------------------------
@cuda.jit(device=True)
def _copy(dst8, dst64, dhead, doff, src8, src64, shead, soff, nbytes, vec, tid, nt):
    """``dst8[doff:doff+nbytes] = src8[soff:soff+nbytes]`` by the threads of one block.

    ``dst64``/``src64`` are uint64 views starting ``dhead``/``shead`` bytes into the
    byte arrays, at a ``vec``-aligned address."""
    if nbytes <= 0:
        return
    aligned = False
    pre = 0
    if vec > 0:
        pre = (dhead + vec - doff % vec) % vec
        pre_s = (shead + vec - soff % vec) % vec
        aligned = pre == pre_s and nbytes >= pre + vec
    if aligned:
        nchunk = (nbytes - pre) // vec
        for k in range(tid, pre, nt):
            dst8[doff + k] = src8[soff + k]
        d = (doff + pre - dhead) // 8
        s = (soff + pre - shead) // 8
        if vec == 16:
            # four 16-byte chunks in flight per thread before their stores: reads of mapped host memory wait
            # on the bus, and more of them outstanding brings the gather closer to a copy engine's rate
            k = tid
            while k + 3 * nt < nchunk:
                k1 = k + nt
                k2 = k1 + nt
                k3 = k2 + nt
                a0 = src64[s + 2 * k]
                b0 = src64[s + 2 * k + 1]
                a1 = src64[s + 2 * k1]
                b1 = src64[s + 2 * k1 + 1]
                a2 = src64[s + 2 * k2]
                b2 = src64[s + 2 * k2 + 1]
                a3 = src64[s + 2 * k3]
                b3 = src64[s + 2 * k3 + 1]
                dst64[d + 2 * k] = a0
                dst64[d + 2 * k + 1] = b0
                dst64[d + 2 * k1] = a1
                dst64[d + 2 * k1 + 1] = b1
                dst64[d + 2 * k2] = a2
                dst64[d + 2 * k2 + 1] = b2
                dst64[d + 2 * k3] = a3
                dst64[d + 2 * k3 + 1] = b3
                k += 4 * nt
            while k < nchunk:
                a = src64[s + 2 * k]
                b = src64[s + 2 * k + 1]
                dst64[d + 2 * k] = a
                dst64[d + 2 * k + 1] = b
                k += nt
        else:
            for k in range(tid, nchunk, nt):
                dst64[d + k] = src64[s + k]
        for k in range(pre + nchunk * vec + tid, nbytes, nt):
            dst8[doff + k] = src8[soff + k]
    else:
        for k in range(tid, nbytes, nt):
            dst8[doff + k] = src8[soff + k]


@cuda.jit(device=True)
def _zero(dst8, dst64, dhead, doff, nbytes, vec, tid, nt):
    """``dst8[doff:doff+nbytes] = 0`` by the threads of one block (chunked where aligned)."""
    if nbytes <= 0:
        return
    if vec > 0:
        pre = min((dhead + vec - doff % vec) % vec, nbytes)
        nchunk = (nbytes - pre) // vec
    else:
        pre = nbytes
        nchunk = 0
    for k in range(tid, pre, nt):
        dst8[doff + k] = 0
    if nchunk > 0:
        d = (doff + pre - dhead) // 8
        w = vec // 8
        for k in range(tid, nchunk * w, nt):
            dst64[d + k] = 0
    for k in range(pre + nchunk * vec + tid, nbytes, nt):
        dst8[doff + k] = 0


# ---- kernels -----------------------------------------------------------------------------
#: registers a gather thread may use. Unbounded, the kernel took 80 and could not launch 1024 threads a block
#: (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES on an H100); at 64 any block size launches and more warps fit per
#: multiprocessor, so more reads of mapped host memory are in flight: 256 MiB of 64 KiB windows went from
#: 91.7% to 93.1% of a pinned host-to-device copy at 512 threads (H100, same run; 32 registers: 81%).
GATHER_MAX_REGISTERS = 64
_GATHER_OPTIONS = {} if simulator_enabled() else {"max_registers": GATHER_MAX_REGISTERS}  # (the simulator has none)


@cuda.jit(**_GATHER_OPTIONS)
def gather_kernel(src8, src64, shead, capacity, step_bytes, starts, n_valid, pad_front, out_rows,
                  out8, out64, ohead, window, vec):
    """One block per window (grid-stride). See the module docstring."""
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    row_bytes = window * step_bytes
    for i in range(cuda.blockIdx.x, starts.shape[0], cuda.gridDim.x):
        base = out_rows[i] * row_bytes
        front = pad_front[i] * step_bytes
        nv = n_valid[i]
        _zero(out8, out64, ohead, base, front, vec, tid, nt)
        first = min(nv, capacity - starts[i])
        o = base + front
        nb = first * step_bytes
        _copy(out8, out64, ohead, o, src8, src64, shead, starts[i] * step_bytes, nb, vec, tid, nt)
        o += nb
        rest = nv - first
        if rest > 0:
            nb = rest * step_bytes
            _copy(out8, out64, ohead, o, src8, src64, shead, 0, nb, vec, tid, nt)
            o += nb
        _zero(out8, out64, ohead, o, base + row_bytes - o, vec, tid, nt)


@cuda.jit
def fill_mask_kernel(n_valid, pad_front, out_rows, mask):
    """``mask[row, t]`` is True where step ``t`` of the row is a real step. One block per window."""
    window = mask.shape[1]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for i in range(cuda.blockIdx.x, n_valid.shape[0], cuda.gridDim.x):
        row = out_rows[i]
        lo = pad_front[i]
        hi = lo + n_valid[i]
        for t in range(tid, window, nt):
            mask[row, t] = lo <= t and t < hi


# ---- host side ---------------------------------------------------------------------------
_dummy = {}


def _dummy64():
    # a valid uint64 argument for kernels that never touch it (vec=0, or no aligned chunk exists)
    if "a" not in _dummy:
        _dummy["a"] = cuda.device_array(2, np.uint64)
    return _dummy["a"]


def word_view(arr8, vec: int):
    """``(view64, head)``: a uint64 view of byte array ``arr8`` starting ``head`` bytes in, at the
    first ``vec``-aligned address and covering every whole ``vec``-byte chunk after it."""
    if vec == 0:
        return _dummy64(), 0
    head = (-device_address(arr8)) % vec
    n = arr8.shape[0]
    m = (n - head) // vec if n > head else 0
    if m == 0:
        return _dummy64(), head
    return arr8[head:head + m * vec].view(np.uint64), head


def as_bytes(arr):
    """A C-contiguous device array (or CUDA tensor) as a flat uint8 device array, same memory."""
    if not getattr(arr, "__cuda_ndarray__", False):
        arr = cuda.as_cuda_array(arr)
    if not arr.is_c_contiguous():
        raise ValueError("the device buffer must be C-contiguous")
    size = int(np.prod(arr.shape))
    flat = arr.reshape(size) if arr.ndim != 1 else arr
    return flat.view(np.uint8)


def gather_windows(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, window,
                   threads: int = 128, vec: int = 16) -> None:
    """Device twin of :func:`gather.gather_windows`: ``src`` and ``out`` are device uint8 arrays
    (``src`` typically mapped host memory); the index arrays are device int64 arrays or host
    arrays (copied). ``starts`` must already be ring positions (``< capacity``)."""
    if vec not in VECS:
        raise ValueError(f"vec must be one of {VECS}, got {vec!r}")
    b = len(starts)
    if b == 0:
        return
    starts, n_valid, pad_front, out_rows = (as_device(a, np.int64) for a in (starts, n_valid, pad_front, out_rows))
    src64, shead = word_view(src, vec)
    out64, ohead = word_view(out, vec)
    launch(gather_kernel, min(b, MAX_GRID), threads)(src, src64, shead, int(capacity), int(step_bytes), starts,
                                                      n_valid, pad_front, out_rows, out, out64, ohead, int(window),
                                                      int(vec))


def fill_mask(n_valid, pad_front, out_rows, mask, threads: int = 128) -> None:
    """Device twin of :func:`gather.fill_mask` (``mask``: device bool ``[rows, window]``)."""
    b = len(n_valid)
    if b == 0:
        return
    n_valid, pad_front, out_rows = (as_device(a, np.int64) for a in (n_valid, pad_front, out_rows))
    launch(fill_mask_kernel, min(b, MAX_GRID), threads)(n_valid, pad_front, out_rows, mask)


def gather_into(byte_views, spec, capacity, win_start, n_valid, pad_front, out_rows, columns, mask,
                threads: int = 128, vec: int = 16) -> None:
    """Device twin of :func:`gear_mpi.storage.columns.gather_into`.

    ``byte_views``: column name -> device uint8 array of the shard's ring (e.g. from
    :func:`gear_mpi.storage.pinned.map_byte_views`, zero copy); ``columns``: name -> device
    array or CUDA tensor ``[rows, window, *shape]``; ``mask``: device bool ``[rows, window]``, or
    None to leave the mask to the caller (who fills it once for a batch gathered from several owners).
    Index arrays may be host (copied once) or device arrays; host ``win_start`` is
    reduced modulo ``capacity`` here, device ones must already be.
    """
    if len(out_rows) == 0:
        return
    if not is_device_array(win_start):
        win_start = np.ascontiguousarray(np.asarray(win_start, np.int64) % capacity, np.int64)
    idx = [as_device(a, np.int64) for a in (win_start, n_valid, pad_front, out_rows)]
    window = next(iter(columns.values())).shape[1] if mask is None else mask.shape[1]
    for c in spec.columns:
        if c.compression is not None:  # no ring to read on the device: decoded on the host (the transport's)
            continue
        gather_windows(byte_views[c.name], capacity, c.step_bytes, *idx, as_bytes(columns[c.name]), window,
                       threads, vec)
    if mask is not None:
        fill_mask(idx[1], idx[2], idx[3], mask, threads)


def _ptx_signatures():
    """Argument types of the kernels, for compiling them to PTX without a GPU (checks only)."""
    from numba import boolean, int64, uint8, uint64
    u8, u64, i64 = uint8[::1], uint64[::1], int64[::1]
    return {gather_kernel: (u8, u64, int64, int64, int64, i64, i64, i64, i64, u8, u64, int64, int64, int64),
            fill_mask_kernel: (i64, i64, i64, boolean[:, ::1])}


__all__ = ["gather_kernel", "fill_mask_kernel", "gather_windows", "fill_mask", "gather_into", "word_view",
           "as_bytes", "device_address", "simulator_enabled"]
