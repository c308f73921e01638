"""The ``device="cuda"`` path without a GPU: CUDA kernels on numba's simulator, exchange over gloo.

Each test starts ``mpiexec`` with ``NUMBA_ENABLE_CUDASIM=1`` on
tests/mpi_programs/check_device.py, which compares a GPU replay against a CPU
replay with the same seed, bit for bit.
"""
from __future__ import annotations

import pytest

from gear_mpi.device import gpu_for, parse_device
from mpi_util import expect_passes, run_mpi


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")


@pytest.mark.parametrize("nprocs", [1, 2])
def test_gpu_replay_matches_cpu_replay(simulated, nprocs):
    proc = run_mpi(nprocs, "check_device.py", "replay", timeout=600)
    names = []
    for mode in ("decentralized", "centralized", "local"):
        for path in (("shm", "alltoallv") if mode != "local" and nprocs > 1 else ("shm",)):
            names += [f"replay/{mode}/{path}/{s}" for s in ("Prioritized", "MaxPriority")]
    expect_passes(proc, nprocs, names)


def test_torch_communicator_over_gloo():
    proc = run_mpi(3, "check_device.py", "torchcomm", timeout=180)
    expect_passes(proc, 3, ["torchcomm"])


def test_gpu_follows_the_local_rank():
    assert [gpu_for(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert gpu_for(3, 4, index=1) == 1
    with pytest.raises(ValueError, match="cuda:5 does not exist"):
        gpu_for(0, 2, index=5)
    with pytest.raises(RuntimeError, match="no GPU"):
        gpu_for(0, 0)
    assert parse_device("cuda:2") == ("cuda", 2) and parse_device("cuda") == ("cuda", None)
    with pytest.raises(ValueError, match="device must be"):
        parse_device("gpu")
