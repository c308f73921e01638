"""CUDA twins (numba-cuda) of :mod:`gear_mpi.kernels.priority_tree` and :mod:`gear_mpi.kernels.priority_draw`.

The device structure is a :class:`~gear_mpi.kernels.priority_tree.Tree` of device
arrays with exactly the CPU layout (``leaves``, ``l0_sum``, ``l1_sum``,
``l1_min``, ``l2_sum``, ``l2_min``, ``prefix``; lines of 8, fan-out 64), and every
kernel performs the CPU kernel's float64 operations in the CPU kernel's order, so:

- a draw returns the same leaf as :func:`priority_draw.draw` for the same uniform
  (same binary search, same 64-entry and two 8-entry scans, same fallback to the
  last positive entry when rounding leaves the target past the end);
- after an update, leaves, level sums/mins and ``prefix`` are bit-identical to
  what :func:`priority_tree.set_leaves` computes (each line and block is re-summed
  from its children left to right; minima are exact however computed; ``prefix`` is
  accumulated sequentially, in one thread, from shared-memory tiles).

Kernels (one CUDA thread per draw / per update):

- :func:`draw_kernel` -- ``out[i] = draw_one(..., uniforms[i])`` (and, given a ``weights`` array of
  entries, ``weights[i] = leaves[out[i]]``). Cost per draw:
  ``log2(n / 4096)`` reads of ``prefix`` plus at most 64 + 8 + 8 contiguous reads.
- an update is six launches: ``_claim_kernel`` (atomic max of a marker
  ``0x7FF8000000000000 + i`` into the int64 view of each touched leaf, so the last
  of duplicate slots wins without any scratch array), ``_write_kernel`` (the
  winner of each slot writes its value), ``_l0_kernel`` / ``_l1_kernel`` /
  ``_l2_kernel`` (each update's thread recomputes its line, then its level-1 block
  -- sum from the 8 line sums, minimum from the 64 leaves -- then its level-2 block:
  idempotent, so duplicates only repeat identical writes) and ``_prefix_kernel``
  (one block; ``n / 4096`` dependent float64 adds). Cost: O(B * 64) reads for the
  blocks, O(n / 4096) for the prefix.

Values must be non-negative and not NaN (weights), as for the CPU index; NaN
bit patterns are used as the claim markers during an update.

This module needs ``numba-cuda``; it is imported only for ``device="cuda"`` and by
the tests (under ``NUMBA_ENABLE_CUDASIM=1`` it runs on the CUDA simulator).
"""
from __future__ import annotations

import math

import numpy as np
from numba import float32, float64

from .cuda_support import blocks_for, cuda_module, launch, simulator_enabled
from .priority_tree import FANOUT, FANOUT2, LEAF_MAX, LEAF_TINY, LINE

cuda = cuda_module()  # ImportError with the install hint when numba-cuda is missing

TILE = 1024            # prefix-scan tile (float64 in shared memory: 8 KiB)
MAX_THREADS = 1024     # largest block the single-block kernels accept
CLAIM_MARK = 0x7FF8000000000000  # above the bits of every non-NaN non-negative float64


# ---- device functions: the same operations, in the same order, as the CPU kernels ----
@cuda.jit(device=True)
def _sum(values, lo, hi):
    s = 0.0
    for i in range(lo, hi):
        s += values[i]
    return s


@cuda.jit(device=True)
def _min_positive(values, lo, hi):
    m = math.inf
    for i in range(lo, hi):
        v = values[i]
        if v > 0.0 and v < m:
            m = v
    return m


@cuda.jit(device=True)
def _line(leaves, l0_sum, g):
    lo = g * LINE
    l0_sum[g] = _sum(leaves, lo, min(lo + LINE, leaves.shape[0]))


@cuda.jit(device=True)
def _block(leaves, l0_sum, l1_sum, l1_min, b):
    lo = b * LINE
    l1_sum[b] = _sum(l0_sum, lo, min(lo + LINE, l0_sum.shape[0]))
    lo = b * FANOUT
    l1_min[b] = _min_positive(leaves, lo, min(lo + FANOUT, leaves.shape[0]))


@cuda.jit(device=True)
def _children_sum_min(sums, mins, lo, hi):
    s = 0.0
    m = math.inf
    for i in range(lo, hi):
        s += sums[i]
        if mins[i] < m:
            m = mins[i]
    return s, m


@cuda.jit(device=True)
def _scan(sums, lo, hi, r):
    acc = 0.0
    last = -1
    for i in range(lo, hi):
        v = sums[i]
        if v > 0.0:
            if r < acc + v:
                return i, r - acc
            last = i
            acc += v
    if last < 0:
        return lo, 0.0
    return last, sums[last] * 0.5


@cuda.jit(device=True)
def draw_one(leaves, l0_sum, l1_sum, l2_sum, prefix, u):
    """Twin of :func:`priority_draw.draw_one`."""
    n = leaves.shape[0]
    n0 = l0_sum.shape[0]
    n1 = l1_sum.shape[0]
    n2 = l2_sum.shape[0]
    target = u * prefix[n2]
    lo = 0
    hi = n2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if prefix[mid] <= target:
            lo = mid
        else:
            hi = mid
    j = lo
    while j > 0 and l2_sum[j] <= 0.0:
        j -= 1
    while j < n2 - 1 and l2_sum[j] <= 0.0:
        j += 1
    r = target - prefix[j]
    b, r = _scan(l1_sum, j * FANOUT, min(j * FANOUT + FANOUT, n1), r)
    g, r = _scan(l0_sum, b * LINE, min(b * LINE + LINE, n0), r)
    leaf, r = _scan(leaves, g * LINE, min(g * LINE + LINE, n), r)
    return leaf


# ---- kernels ----------------------------------------------------------------------------
@cuda.jit
def draw_kernel(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms, out, weights):
    """``out[i]``: the leaf chosen by ``uniforms[i]``; ``weights[i]``: its weight, when ``weights`` has entries
    (an empty array: slots only). One thread per draw."""
    i = cuda.grid(1)
    if i < uniforms.shape[0]:
        leaf = draw_one(leaves, l0_sum, l1_sum, l2_sum, prefix, uniforms[i])
        out[i] = leaf
        if weights.shape[0] > 0:
            weights[i] = leaves[leaf]


@cuda.jit
def _claim_kernel(leaf_bits, slots):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        cuda.atomic.max(leaf_bits, slots[i], CLAIM_MARK + i)


@cuda.jit(device=True)
def _leaf_value(v):
    """:func:`priority_tree.leaf_value` on the device: ``v`` rounded to float32, a positive one kept in
    ``[LEAF_TINY, LEAF_MAX]`` (held in a float64 leaf: the host index's value, bit for bit)."""
    if v > LEAF_MAX:
        return LEAF_MAX
    if v > 0.0 and v < LEAF_TINY:
        return LEAF_TINY
    return float64(float32(v))


@cuda.jit
def _write_kernel(leaves, leaf_bits, slots, values):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        s = slots[i]
        if leaf_bits[s] == CLAIM_MARK + i:  # the last update of this slot
            leaves[s] = _leaf_value(values[i])


@cuda.jit
def _l0_kernel(leaves, l0_sum, slots):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        _line(leaves, l0_sum, slots[i] // LINE)


@cuda.jit
def _l1_kernel(leaves, l0_sum, l1_sum, l1_min, slots):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        _block(leaves, l0_sum, l1_sum, l1_min, slots[i] // FANOUT)


@cuda.jit
def _l2_kernel(l1_sum, l1_min, l2_sum, l2_min, slots):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        c = slots[i] // FANOUT2
        lo = c * FANOUT
        s, m = _children_sum_min(l1_sum, l1_min, lo, min(lo + FANOUT, l1_sum.shape[0]))
        l2_sum[c] = s
        l2_min[c] = m


@cuda.jit
def _l0_all_kernel(leaves, l0_sum):
    g = cuda.grid(1)
    if g < l0_sum.shape[0]:
        _line(leaves, l0_sum, g)


@cuda.jit
def _l1_all_kernel(leaves, l0_sum, l1_sum, l1_min):
    b = cuda.grid(1)
    if b < l1_sum.shape[0]:
        _block(leaves, l0_sum, l1_sum, l1_min, b)


@cuda.jit
def _l2_all_kernel(l1_sum, l1_min, l2_sum, l2_min):
    c = cuda.grid(1)
    if c < l2_sum.shape[0]:
        lo = c * FANOUT
        s, m = _children_sum_min(l1_sum, l1_min, lo, min(lo + FANOUT, l1_sum.shape[0]))
        l2_sum[c] = s
        l2_min[c] = m


@cuda.jit
def _prefix_kernel(l2_sum, prefix):
    """Launch with ONE block. ``prefix[j + 1] = l2_sum[0] + ... + l2_sum[j]``, added left to right
    in one thread (the CPU order, hence bit-identical); the block stages tiles in shared memory."""
    tile = cuda.shared.array(TILE, np.float64)
    carry = cuda.shared.array(1, np.float64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    n2 = l2_sum.shape[0]
    if tid == 0:
        carry[0] = 0.0
        prefix[0] = 0.0
    cuda.syncthreads()
    base = 0
    while base < n2:
        cnt = min(TILE, n2 - base)
        for k in range(tid, cnt, nt):
            tile[k] = l2_sum[base + k]
        cuda.syncthreads()
        if tid == 0:
            acc = carry[0]
            for k in range(cnt):
                acc += tile[k]
                tile[k] = acc
            carry[0] = acc
        cuda.syncthreads()
        for k in range(tid, cnt, nt):
            prefix[base + k + 1] = tile[k]
        cuda.syncthreads()
        base += TILE


@cuda.jit
def _min_kernel(values, out):
    """Launch with ONE block of at most MAX_THREADS threads: ``out[0] = min(values)`` (inf if empty)."""
    part = cuda.shared.array(MAX_THREADS, np.float64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    m = math.inf
    for k in range(tid, values.shape[0], nt):
        if values[k] < m:
            m = values[k]
    part[tid] = m
    cuda.syncthreads()
    if tid == 0:
        for k in range(1, nt):
            if part[k] < m:
                m = part[k]
        out[0] = m


@cuda.jit
def _fill_kernel(values, v):
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, values.shape[0], stride):
        values[i] = v


@cuda.jit
def _take_kernel(values, slots, out):
    i = cuda.grid(1)
    if i < slots.shape[0]:
        out[i] = values[slots[i]]


# ---- host-side launchers: the structure as one Tree of device arrays ----------------------
_NO_WEIGHTS = []  # the empty float64 device array draw passes for "slots only" (made at the first draw)


def draw(tree, uniforms, out, threads: int = 256, weights=None) -> None:
    """Device twin of :func:`priority_draw.draw`: ``out[i]`` = the leaf chosen by ``uniforms[i]``; with
    ``weights`` (a float64 device array), also ``weights[i]`` = that leaf's weight, in the same launch, so a
    caller that needs both copies them back together.

    ``tree`` is a :class:`~gear_mpi.kernels.priority_tree.Tree` of device arrays;
    ``uniforms`` (float64) and ``out`` (int64) are device arrays. One thread per draw.
    The caller guarantees a positive total.
    """
    b = uniforms.shape[0]
    if b:
        if weights is None:
            if not _NO_WEIGHTS:
                _NO_WEIGHTS.append(cuda.device_array(0, np.float64))
            weights = _NO_WEIGHTS[0]
        launch(draw_kernel, blocks_for(b, threads), threads)(tree.leaves, tree.l0_sum, tree.l1_sum, tree.l2_sum,
                                                             tree.prefix, uniforms, out, weights)


def set_leaves(tree, slots, values, threads: int = 256) -> None:
    """Device twin of :func:`priority_tree.set_leaves`: ``leaves[slots[i]] = values[i]``, last of
    duplicates wins; touched blocks and ``prefix`` recomputed (bit-identical to the CPU kernel).
    ``slots`` (int64) and ``values`` (float64) are device arrays. Six launches."""
    b = slots.shape[0]
    if b == 0:
        return
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    grid = blocks_for(b, threads)
    bits = leaves.view(np.int64)
    launch(_claim_kernel, grid, threads)(bits, slots)
    launch(_write_kernel, grid, threads)(leaves, bits, slots, values)
    launch(_l0_kernel, grid, threads)(leaves, l0_sum, slots)
    launch(_l1_kernel, grid, threads)(leaves, l0_sum, l1_sum, l1_min, slots)
    launch(_l2_kernel, grid, threads)(l1_sum, l1_min, l2_sum, l2_min, slots)
    launch(_prefix_kernel, 1, min(threads, MAX_THREADS))(l2_sum, prefix)


def rebuild(tree, threads: int = 256) -> None:
    """Device twin of :func:`priority_tree.rebuild`: every level of ``tree`` from its leaves. O(n) reads."""
    leaves, l0_sum, l1_sum, l1_min, l2_sum, l2_min, prefix = tree
    launch(_l0_all_kernel, blocks_for(l0_sum.shape[0], threads), threads)(leaves, l0_sum)
    launch(_l1_all_kernel, blocks_for(l1_sum.shape[0], threads), threads)(leaves, l0_sum, l1_sum, l1_min)
    launch(_l2_all_kernel, blocks_for(l2_sum.shape[0], threads), threads)(l1_sum, l1_min, l2_sum, l2_min)
    launch(_prefix_kernel, 1, min(threads, MAX_THREADS))(l2_sum, prefix)


def fill(values, v: float, threads: int = 256) -> None:
    """``values[:] = v`` on the device (grid-stride; few blocks on the simulator, where a thread is costly)."""
    n = values.shape[0]
    if n:
        launch(_fill_kernel, min(blocks_for(n, threads), 2 if simulator_enabled() else 4096), threads)(values, v)


def smallest(values, out, threads: int = 256) -> None:
    """``out[0] = min(values)`` (inf if empty): one single-block reduction on the device."""
    launch(_min_kernel, 1, min(threads, MAX_THREADS))(values, out)


def take(values, slots, out, threads: int = 256) -> None:
    """``out[i] = values[slots[i]]`` on the device, one thread per entry."""
    b = slots.shape[0]
    if b:
        launch(_take_kernel, blocks_for(b, threads), threads)(values, slots, out)
