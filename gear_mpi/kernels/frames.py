"""Frame rebuild: a sample's derived columns (frame stacks, next steps) from frames stored once.

A derived column (:mod:`gear_mpi.frames`) of ``frames`` steps a row, ``offset`` 0 (a stack ending at the
window's step ``t``) or 1 (ending at ``t + 1``: a next step), reads the source column's steps
``t + offset - frames + 1 .. t + offset`` of the same trajectory. The source is a ring of ``capacity``
steps at an address: a shard's column ring, a node peer's mapped one, or a buffer of received context
windows (then ``capacity`` is the buffer's steps and no window wraps). A window is given by its first
step's ring position ``win_start``, how many of the trajectory's steps lie before it that may be read
(``before``: the window's offset in its trajectory, capped at what the columns need), its real steps
``n_valid`` and leading padding ``pad_front``; steps before the trajectory's first are the padding
("first": its first frame again; "zeros").
"""
from __future__ import annotations

from numba import njit, prange

from .gather import SERIAL_BYTES, _memmove_from, _memzero


@njit(cache=True, inline="always")
def _rebuild_window(i, src_addr, capacity, step_bytes, win_start, before, n_valid, pad_front, rows, frames, offset,
                    pad_zeros, out, window):
    stack_bytes = frames * step_bytes
    row_bytes = window * stack_bytes
    base = rows[i] * row_bytes
    pf = pad_front[i]
    nv = n_valid[i]
    if pf > 0:
        _memzero(out, base, pf * stack_bytes)
    first = -before[i]
    for t in range(nv):
        o = base + (pf + t) * stack_bytes
        for k in range(frames):
            rel = t + offset - (frames - 1) + k
            if rel < first:
                if pad_zeros:
                    _memzero(out, o + k * step_bytes, step_bytes)
                    continue
                rel = first
            s = (win_start[i] + rel) % capacity
            _memmove_from(out, o + k * step_bytes, src_addr + s * step_bytes, step_bytes)
    end = base + (pf + nv) * stack_bytes
    if end < base + row_bytes:
        _memzero(out, end, base + row_bytes - end)


@njit(cache=True, parallel=True, nogil=True)
def rebuild_frames(src_addr, capacity, step_bytes, win_start, before, n_valid, pad_front, rows, frames, offset,
                   pad_zeros, out, window):
    """Write the derived column rows ``rows[i]`` of ``out`` (flat bytes, ``[rows, window, frames, step]``).

    Args (arrays int64, one entry per window):
        src_addr: the address of the source ring (``capacity * step_bytes`` bytes, kept mapped by the caller).
        capacity: steps in the source ring; step_bytes: bytes of one source step.
        win_start: ring position of each window's first step (in ``[0, capacity)``).
        before: steps of the trajectory before the window that may be read (its offset, capped).
        n_valid, pad_front: real steps and leading padding of each window.
        rows: the output row of each window.
        frames, offset, pad_zeros: the column (:class:`gear_mpi.frames.DerivedColumn`).
        out: the batch column as bytes; window: steps per row.
    Every window is checked first (ValueError before anything is written: a window outside the source or
    ``out``). Cost: ``frames`` copies of ``step_bytes`` per real step, zero fills for padding; parallel over
    windows above ``SERIAL_BYTES`` of output; no allocation.
    """
    b = win_start.shape[0]
    row_bytes = window * frames * step_bytes
    for i in range(b):
        if not (0 <= win_start[i] < capacity and 0 <= n_valid[i] <= window and 0 <= pad_front[i] <= window - n_valid[i]
                and 0 <= before[i] and 0 <= rows[i] and (rows[i] + 1) * row_bytes <= out.shape[0]):
            raise ValueError("rebuild_frames: a window lies outside the source or the batch")
    if b * row_bytes < SERIAL_BYTES:
        for i in range(b):
            _rebuild_window(i, src_addr, capacity, step_bytes, win_start, before, n_valid, pad_front, rows, frames,
                            offset, pad_zeros, out, window)
    else:
        for i in prange(b):
            _rebuild_window(i, src_addr, capacity, step_bytes, win_start, before, n_valid, pad_front, rows, frames,
                            offset, pad_zeros, out, window)


@njit(cache=True, nogil=True)
def context_before(slots, choice_start, traj_start, capacity, need, out):
    """Owner side: ``out[i] = min(offset of window i in its trajectory, need)``, the offset being
    ``(choice_start[i] - traj_start[slots[i]]) mod capacity``. O(B)."""
    for i in range(slots.shape[0]):
        off = (choice_start[i] - traj_start[slots[i]]) % capacity
        out[i] = min(off, need)
