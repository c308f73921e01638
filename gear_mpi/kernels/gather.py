"""Window gather: copy sampled windows from a step ring into a batch (CPU kernels).

Every column of a shard is a ring of ``capacity`` steps viewed as bytes,
``src[capacity * step_bytes]``. A window is ``n_valid`` consecutive ring steps
from ``start`` (wrapping at the end of the ring) placed at row ``pad_front`` of a
``window``-step output row; the rest of that row is zero padding.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange


@njit(cache=True, parallel=True)
def gather_windows(src, capacity, step_bytes, starts, n_valid, pad_front, out_rows, out, window):
    """Copy windows into ``out`` (bytes, ``[B * window * step_bytes]``), in parallel over windows.

    ``out_rows[i]`` is the batch row that window ``i`` fills. Each delivered byte is
    copied once, padding bytes are written once (zeros). Cost: O(sum n_valid *
    step_bytes) copied plus O(padding) zeroed; memory-bandwidth bound; no allocation.
    """
    row_bytes = window * step_bytes
    for i in prange(starts.shape[0]):
        base = out_rows[i] * row_bytes
        front = pad_front[i] * step_bytes
        nv = n_valid[i]
        if front > 0:
            out[base:base + front] = 0
        first = min(nv, capacity - starts[i])
        o = base + front
        s = starts[i] * step_bytes
        nb = first * step_bytes
        out[o:o + nb] = src[s:s + nb]
        o += nb
        rest = nv - first
        if rest > 0:
            nb = rest * step_bytes
            out[o:o + nb] = src[0:nb]
            o += nb
        end = base + row_bytes
        if o < end:
            out[o:end] = 0


@njit(cache=True, parallel=True)
def fill_mask(n_valid, pad_front, out_rows, mask):
    """``mask[row, t]`` is True where step ``t`` of the row is a real step. Cost: O(B * window)."""
    window = mask.shape[1]
    for i in prange(n_valid.shape[0]):
        row = out_rows[i]
        lo = pad_front[i]
        hi = lo + n_valid[i]
        for t in range(window):
            mask[row, t] = lo <= t and t < hi


@njit(cache=True, parallel=True)
def place_windows(starts, lengths, window, align_code, uniforms, win_start, n_valid, pad_front):
    """Where each window lies: ring step it starts at, real steps, leading padding.

    ``align_code``: 0 random (offset uniform over the ``length - window + 1``
    windows inside the trajectory), 1 head, 2 tail. A trajectory shorter than the
    window is taken whole; it is padded at the end, except for ``tail``, which pads
    the front. ``starts`` are ring positions, so the caller wraps ``win_start``
    modulo the capacity. Cost: O(B).
    """
    for i in prange(starts.shape[0]):
        length = lengths[i]
        if length >= window:
            if align_code == 0:
                span = length - window + 1
                off = min(int(uniforms[i] * span), span - 1)
            elif align_code == 1:
                off = 0
            else:
                off = length - window
            win_start[i] = starts[i] + off
            n_valid[i] = window
            pad_front[i] = 0
        else:
            win_start[i] = starts[i]
            n_valid[i] = length
            pad_front[i] = window - length if align_code == 2 else 0
