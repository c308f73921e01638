"""The GPU path on the CUDA simulator, run as ``mpiexec -n K python check_device.py SCENARIO``.

Needs ``NUMBA_ENABLE_CUDASIM=1`` (set by tests/test_device_path.py). Prints
``PASS <check> rank=R``.

- ``replay``: a ``device="cuda"`` replay (selection in CUDA kernels over a
  device index, zero-copy gather from mapped host memory, remote windows over
  torch.distributed -- gloo here, NCCL on GPUs -- or over MPI with device buffers)
  returns exactly the batches of a
  ``device="cpu"`` replay with the same seed, in every mode and on both window paths.
- ``torchcomm``: TorchComm.alltoallv over gloo with uneven counts, zeros included.
"""
from __future__ import annotations

import sys

import numpy as np
import torch
from mpi4py import MPI

import gear_mpi as gm

comm = MPI.COMM_WORLD
RANK, SIZE = comm.rank, comm.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "step": ((), "int64"), "flag": ((), "bool")}, max_length=6)


def passed(name: str) -> None:
    print(f"PASS {name} rank={RANK}", flush=True)


def same_batches(a: gm.Batch, b: gm.Batch) -> None:
    for name in SPEC.names:
        np.testing.assert_array_equal(a[name].cpu().numpy(), b[name].cpu().numpy(), err_msg=name)
    for attr in ("mask", "lengths", "probabilities", "weights"):
        np.testing.assert_array_equal(getattr(a, attr).cpu().numpy(), getattr(b, attr).cpu().numpy(), err_msg=attr)


def scenario_replay() -> None:
    assert gm.device.simulator_enabled(), "run with NUMBA_ENABLE_CUDASIM=1"
    for mode in ("decentralized", "centralized", "local"):
        for force in ((False, True) if mode != "local" and SIZE > 1 else (False,)):
            for sampler in (gm.Prioritized(0.7, 0.5), gm.MaxPriority()):  # (Fifo orders by wall-clock stamps)
                kw = dict(mode=mode, force_alltoallv=force, seed=11, timeout=60)
                # remote windows over torch.distributed, or (Prioritized) over MPI with device buffers
                transport = "mpi" if force and sampler.proportional else "nccl"
                gpu = gm.Replay(SPEC, 48, sampler, device="cuda", window_transport=transport, **kw)
                cpu = gm.Replay(SPEC, 48, sampler, device="cpu", **kw)
                rng = np.random.default_rng(RANK + 1)
                for i in range(2 + RANK):
                    n = int(rng.integers(1, 7))
                    t = {"obs": rng.random((n, 3)).astype(np.float32), "step": np.arange(n) + 100 * i + 1000 * RANK,
                         "flag": rng.random(n) < 0.5}
                    p = float(rng.uniform(0.2, 2.0))
                    gpu.insert(t, p)
                    cpu.insert(t, p)
                for align in ("random", "tail"):
                    b_gpu = gpu.sample(2 + RANK, 4, align)
                    b_cpu = cpu.sample(2 + RANK, 4, align)
                    assert b_gpu.device == gpu.device.torch_device
                    same_batches(b_gpu, b_cpu)
                    # the key's tag differs between two replays; owner and slot agree
                    ka, kb = gm.keys.decode(b_gpu.keys.cpu().numpy()), gm.keys.decode(b_cpu.keys.numpy())
                    np.testing.assert_array_equal(ka[1:], kb[1:])
                    assert gpu.update_priorities(b_gpu.keys, np.ones(len(b_gpu))) == len(b_gpu)
                    cpu.update_priorities(b_cpu.keys, np.ones(len(b_cpu)))
                st = gpu.stats()
                if force and SIZE > 1:
                    assert (gpu.torch_comm is not None) == (transport == "nccl")
                    if sampler.proportional:  # random owners: some windows surely crossed (fixed seed)
                        assert st["total_windows_mpi"] > 0, st
                gpu.close()
                cpu.close()
                passed(f"replay/{mode}/{'alltoallv' if force else 'shm'}/{type(sampler).__name__}")


def scenario_torchcomm() -> None:
    from gear_mpi.comm_torch import TorchComm
    tc = TorchComm(comm, "gloo", timeout=30)
    # rank r sends (r + d) % 3 elements to rank d: zeros included
    send_counts = np.array([(RANK + d) % 3 for d in range(SIZE)])
    recv_counts = np.array([(s + RANK) % 3 for s in range(SIZE)])
    send = torch.cat([torch.full((int(c),), 100 * RANK + d, dtype=torch.int64) for d, c in enumerate(send_counts)])
    recv = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    tc.alltoallv(send, send_counts, recv, recv_counts, "test")
    expect = torch.cat([torch.full((int(c),), 100 * s + RANK, dtype=torch.int64) for s, c in enumerate(recv_counts)])
    assert torch.equal(recv, expect), (recv, expect)
    tc.close()
    passed("torchcomm")


if __name__ == "__main__":
    {"replay": scenario_replay, "torchcomm": scenario_torchcomm}[sys.argv[1]]()
