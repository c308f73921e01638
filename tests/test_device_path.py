"""The ``device="cuda"`` path without a GPU: CUDA kernels on numba's simulator, exchange over gloo.

Each test starts ``mpiexec`` with ``NUMBA_ENABLE_CUDASIM=1`` on the pytest module
tests/mpi/test_device.py, which compares a GPU replay against a CPU replay with the
same seed, bit for bit (its torch.distributed test runs with tests/test_replay_mpi.py).
"""
from __future__ import annotations

import pytest

from gear_mpi.storage import gpu_for, parse_device
from mpi_util import run_pytest_mpi


@pytest.mark.parametrize("nprocs", [1, 2])
def test_gpu_replay_matches_cpu_replay(nprocs):
    """On the CUDA simulator, in one job (one start-up of the simulator): tests/mpi/test_device.py's device
    replay against a CPU replay and its count of a device sample's uploads, and tests/mpi/test_device_compressed.py's device replay with compressed
    columns (decoded on the host: own windows, node peers' shared chunks, windows sent) against a CPU replay."""
    run = run_pytest_mpi(nprocs, "test_device.py::test_gpu_replay_matches_cpu_replay",
                         "test_device.py::test_device_sample_uploads_its_rows_once", "test_device_compressed.py",
                         env={"NUMBA_ENABLE_CUDASIM": "1"}, timeout=600)
    paths = 5 if nprocs > 1 else 3   # (mode, window path) pairs
    device = [t for t in run.passed(0) if "test_gpu_replay_matches_cpu_replay" in t]
    compressed = [t for t in run.passed(0) if "test_device_compressed" in t]
    uploads = [t for t in run.passed(0) if "test_device_sample_uploads_its_rows_once" in t]
    assert len(device) == 2 * paths, sorted(run.passed(0))
    assert len(compressed) == paths, sorted(run.passed(0))
    assert len(uploads) == 2, sorted(run.passed(0))


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


def test_device_cuda_names_incompatible_versions(monkeypatch):
    """device="cuda" with a numba-cuda that cannot compile for this numpy: a clear error first."""
    from gear_mpi.kernels import cuda_support
    from gear_mpi.storage import device
    monkeypatch.setattr(device, "simulator_enabled", lambda: False)
    monkeypatch.setattr(cuda_support, "installed_versions", lambda: ("2.5.5", "0.30.4"))
    with pytest.raises(RuntimeError, match=r"numba-cuda 0\.30\.4 cannot compile CUDA kernels with numpy 2\.5\.5"):
        device.DeviceContext("cuda")
    monkeypatch.setattr(cuda_support, "installed_versions", lambda: ("2.4.6", "0.30.4"))
    import torch
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="torch sees no GPU"):   # past the version check
            device.DeviceContext("cuda")
