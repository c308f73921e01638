"""A ``device="cuda"`` replay (a device priority index) saved, and loaded onto the GPU path and
onto the CPU path, draws the same batches as the saved one.

One rank; run by tests/test_checkpoint.py with ``NUMBA_ENABLE_CUDASIM=1`` (the CUDA kernels
on numba's simulator) when no GPU is there.
"""
from __future__ import annotations

import os

import pytest

import gear_mpi as gm
from checkpoint_checks import SIZE, SPEC, drive, fill, same_batch, shared_dir  # noqa: F401


def _cuda_usable() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return True
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


@pytest.mark.skipif(SIZE != 1, reason="one rank")
@pytest.mark.skipif(not _cuda_usable(), reason="no GPU, and NUMBA_ENABLE_CUDASIM=1 is not set")
@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_device_index_restores_onto_gpu_and_cpu_paths(shared_dir, device):
    pytest.importorskip("numba.cuda")
    path = os.path.join(shared_dir, "device")
    replay = gm.Replay(SPEC, 60, gm.Prioritized(0.6, 0.4), seed=3, device="cuda")
    fill(replay, 16, base=1)
    drive(replay, 1, seed=1)
    replay.save(path)
    expect = drive(replay, 2, seed=2)
    loaded, _ = gm.Replay.load(path, device=device)
    for i, (a, b) in enumerate(zip(expect, drive(loaded, 2, seed=2))):
        same_batch(a, b, f"{device} batch {i}")
    loaded.close()
    replay.close()
