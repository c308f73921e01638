"""Compressed columns on the ``device="cuda"`` path, on numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1, set by
tests/test_compressed_shm.py): a device replay decodes its compressed columns on the host (its own windows, node
peers' from their shared chunks, and the windows it sends to requesters on other nodes or through
``force_alltoallv``) into a page-locked staging buffer and copies them to the device; its batches equal a
``device="cpu"`` replay's with the same seed, bit for bit, in every mode and on both window paths.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

import gear_mpi as gm

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
SPEC = gm.TrajectorySpec({"pixels": ((3, 4), "uint8", gm.Compressed(chunk=3)), "step": ((), "int64"),
                          "score": ((2,), "float32", gm.Compressed(codec="zstd", chunk=2))}, max_length=6)
TIMEOUT = 60.0
#: the simulator (set by the wrapper test), or a real GPU when this module is run directly on a GPU node
CUDA_USABLE = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or torch.cuda.is_available()
PATHS = [(m, f) for m in ("decentralized", "centralized", "local")
         for f in ((False, True) if m != "local" and SIZE > 1 else (False,))]


@pytest.mark.skipif(not CUDA_USABLE, reason="no GPU, and NUMBA_ENABLE_CUDASIM=1 is not set")
@pytest.mark.parametrize("mode,force", PATHS, ids=[f"{m}-{'alltoallv' if f else 'shm'}" for m, f in PATHS])
def test_gpu_replay_with_compressed_columns_matches_cpu_replay(mode, force):
    kw = dict(mode=mode, force_alltoallv=force, seed=11, timeout=TIMEOUT)
    transport = "mpi" if force else "nccl"
    gpu = gm.Replay(SPEC, 40, gm.Prioritized(0.7, 0.5), device="cuda", window_transport=transport, **kw)
    cpu = gm.Replay(SPEC, 40, gm.Prioritized(0.7, 0.5), device="cpu", **kw)
    cpu._solo = False  # one host rank draws from its shard's stream (Replay._sample): compare the collective draw
    try:
        rng = np.random.default_rng(RANK + 1)
        for i in range(12 + RANK):  # the 40-step rings wrap
            n = int(rng.integers(1, 7))
            t = {"pixels": rng.integers(0, 4, (n, 3, 4)).astype(np.uint8), "step": np.arange(n) + 100 * i,
                 "score": rng.random((n, 2)).astype(np.float32)}
            p = float(rng.uniform(0.2, 2.0))
            gpu.insert(t, p)
            cpu.insert(t, p)
            if i % 4 == 3:
                for align in ("random", "tail"):
                    # this rank's mass and smallest weight as each replay's header carries them (for a failure's
                    # message: CI once saw every weight of a device batch 0, 2026-12-05, never reproduced since)
                    before = {"gpu": (gpu.shard.total_weight, gpu.shard.min_weight),
                              "cpu": (cpu.shard.total_weight, cpu.shard.min_weight)}
                    a, b = gpu.sample(2 + RANK, 4, align), cpu.sample(2 + RANK, 4, align)
                    assert a.device == gpu.device.torch_device
                    for name in SPEC.names:
                        np.testing.assert_array_equal(a[name].cpu().numpy(), b[name].numpy(), err_msg=name)
                    for attr in ("mask", "lengths", "probabilities", "weights"):
                        np.testing.assert_array_equal(getattr(a, attr).cpu().numpy(), getattr(b, attr).numpy(),
                                                      err_msg=f"{attr} at step {i}, {align}; keys {b.keys.tolist()}; "
                                                              f"(mass, smallest weight) of this rank: {before}")
                    gpu.update_priorities(a.keys, np.linspace(0.5, 1.5, len(a)))
                    cpu.update_priorities(b.keys, np.linspace(0.5, 1.5, len(b)))
    finally:
        gpu.close()
        cpu.close()
