"""Column rings: where a shard's columns are, attaching another process's, and host window copies.

A sample's windows (:func:`gear_mpi.batch.check_window`) are read from column rings: this process's,
or another's mapped from POSIX shared memory (:func:`attach_columns`); the gather
kernels read them by address (:func:`column_addresses`) or by view
(:func:`gather_into`).
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..batch import Batch
from ..kernels import gather as gather_kernels
from .arenas import SharedArena, attach_arena, check_header, column_layout
from ..spec import TrajectorySpec

def gather_into(byte_views: Mapping[str, np.ndarray], spec: TrajectorySpec, capacity: int,
                win_start: np.ndarray, n_valid: np.ndarray, pad_front: np.ndarray,
                out_rows: np.ndarray, batch: Batch) -> None:
    """Copy windows from a shard's columns into rows of a batch, with padding and mask.

    Cost: one kernel call; a parallel pass per column, each delivered byte copied once; O(B W) for the mask.

    Args:
        byte_views: column name -> the shard's ring as flat bytes (possibly another process's shared memory).
        spec: the columns.
        capacity: steps in the shard's ring.
        win_start: each window's first ring step (int64; taken modulo ``capacity``).
        n_valid: each window's real steps (int64).
        pad_front: each window's leading padding steps (int64).
        out_rows: the batch row of each window (int64).
        batch: a host batch to fill (its ``window`` is the window length).
    """
    if len(out_rows) == 0:
        return
    starts = np.ascontiguousarray(win_start % capacity, np.int64)
    gather_kernels.gather_columns(tuple(byte_views[name] for name in spec.names), spec.step_bytes_array, capacity,
                                  starts, n_valid, pad_front, out_rows, batch.byte_views(), batch.window,
                                  batch._mask_np)


def column_addresses(byte_views: Mapping[str, np.ndarray], spec: TrajectorySpec, capacity: int) -> np.ndarray:
    """The address of each column ring, for the gather kernels that read by address. O(columns).

    The views must stay mapped while the addresses are used.

    Args:
        byte_views: column name -> the ring as flat bytes.
        spec: the columns.
        capacity: steps in the ring.

    Returns:
        int64 addresses, in column order.

    Raises:
        ValueError: a view is shorter than its ring.
    """
    out = np.empty(len(spec.columns), np.int64)
    for c, col in enumerate(spec.columns):
        view = byte_views[col.name]
        if col.compression is None and view.nbytes < col.step_bytes * capacity:
            raise ValueError(f"column {col.name!r} has {view.nbytes} bytes, shorter than its ring of {capacity} steps")
        out[c] = view.ctypes.data
    return out


def attach_columns(name: str, spec: TrajectorySpec, capacity_steps: int) -> tuple[SharedArena, dict[str, np.ndarray]]:
    """Map another process's shard columns (``shard.shm_name`` of a ``memory="shm"`` or ``"file"`` shard).
    Cost: one mmap; no copy.

    Args:
        name: the shared-memory segment's name, or the columns file's absolute path.
        spec: the shard's spec.
        capacity_steps: the shard's ring size in steps.

    Returns:
        ``(arena, views)``: the arena (close it when done) and column name -> byte view of the column's ring.

    Raises:
        FileNotFoundError: no such segment (its shard was closed).
        ValueError: an invalid name, or not a gear_mpi shard of this spec and capacity (then unmapped).
    """
    arena = attach_arena(name)
    offsets, nbytes = column_layout(spec, capacity_steps)
    try:
        if arena.nbytes != nbytes:
            raise ValueError(f"arena {name!r} has {arena.nbytes} bytes; "
                             f"this spec and capacity need {nbytes}")
        check_header(arena.buffer, spec, capacity_steps, name)
    except ValueError:
        arena.close()
        raise
    # a compressed column has no ring here (its chunks: storage.shared_chunks): an empty view the kernels read
    # nothing from (the store's gather_step_bytes is 0 for it)
    views = {c.name: arena.buffer[offsets[c.name]:offsets[c.name] + (c.step_bytes * capacity_steps
                                                                     if c.compression is None else 0)]
             for c in spec.columns}
    return arena, views
