"""Twin replays for the compressed-column tests (test_compressed.py, test_compressed_shm.py): a raw replay and
its compressed twin fed the same trajectories must sample the same batches, bit for bit."""
from __future__ import annotations

import ctypes
from typing import Iterable, Mapping

import numpy as np

import gear_mpi as gm
from replay_checks import keys_of, same_batch


def twin_specs(columns: Mapping[str, tuple], chunk: int | None) -> tuple[gm.TrajectorySpec, gm.TrajectorySpec]:
    """(raw spec, the same with column "pixels" compressed: the default codec at level 1, ``chunk`` steps a
    chunk), trajectories of at most 9 steps."""
    comp = dict(columns, pixels=columns["pixels"] + (gm.Compressed(level=1, chunk=chunk),))
    return gm.TrajectorySpec(columns, max_length=9), gm.TrajectorySpec(comp, max_length=9)


def flip_a_byte(ring, j: int) -> None:
    """Damage sealed chunk ``j`` of ``ring`` (a ``CompressedRing``) where it lies, as bit rot would: the byte in its
    middle flipped in place, in process, node-shared or file memory alike, so that every reader of those bytes (the
    kernels through the ring's addresses, its Python path, node peers) meets the damage. (Replacing
    ``ring.chunks[j]`` by a damaged copy instead left the kernels reading the old object's memory after it was
    freed, and seeing the damage or not by chance.)"""
    c = ring.chunks[j]
    byte = ctypes.c_uint8.from_address(np.frombuffer(c, np.uint8).ctypes.data + len(c) // 2)
    byte.value ^= 0x10


def feed_and_compare(raw: gm.Replay, comp: gm.Replay, trajectories: Iterable[tuple[Mapping, float]],
                     names: Iterable[str], rank: int) -> None:
    """Insert every trajectory into both replays; after every 4th, sample windows of 4, 9 and 6 steps (aligned at
    random, head, tail) from both, check they are the same batch, and give both the same new priorities."""
    for i, (traj, p) in enumerate(trajectories):
        raw.insert(traj, p)
        comp.insert(traj, p)
        if i % 4 != 3:
            continue
        for align, window in (("random", 4), ("head", 9), ("tail", 6)):
            a, b = raw.sample(5 + rank, window, align), comp.sample(5 + rank, window, align)
            same_batch(a, b, names=names, keys="untagged")
            new = np.linspace(0.5, 2.0, len(a))
            raw.update_priorities(keys_of(a), new)
            comp.update_priorities(keys_of(b), new)
