"""The ``device="cuda"`` path on numba's CUDA simulator, and the torch.distributed communicator.

- ``test_gpu_replay_matches_cpu_replay`` (needs ``NUMBA_ENABLE_CUDASIM=1``, set by
  tests/test_device_path.py): a ``device="cuda"`` replay (selection in CUDA kernels over
  a device index, zero-copy gather from mapped host memory, remote windows over
  torch.distributed -- gloo here, NCCL on GPUs -- or over MPI with device buffers)
  returns exactly the batches of a ``device="cpu"`` replay with the same seed, in every
  mode and on both window paths.
- ``test_torch_comm_alltoallv_over_gloo``: torch_comm.TorchComm.alltoallv over gloo with uneven
  counts, zeros included.
"""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from mpi4py import MPI

import gear_mpi as gm

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "step": ((), "int64"), "flag": ((), "bool")}, max_length=6)
#: collective deadline: the simulator runs every CUDA thread in Python, so it is longer than elsewhere
TIMEOUT = 60.0
#: the simulator (set by the wrapper test), or a real GPU when this module is run directly on a GPU node
CUDA_USABLE = os.environ.get("NUMBA_ENABLE_CUDASIM") == "1" or torch.cuda.is_available()


def same_batches(a: gm.Batch, b: gm.Batch) -> None:
    for name in SPEC.names:
        np.testing.assert_array_equal(a[name].cpu().numpy(), b[name].cpu().numpy(), err_msg=name)
    for attr in ("mask", "lengths", "probabilities", "weights"):
        np.testing.assert_array_equal(getattr(a, attr).cpu().numpy(), getattr(b, attr).cpu().numpy(), err_msg=attr)


PATHS = [(m, f) for m in ("decentralized", "centralized", "local")
         for f in ((False, True) if m != "local" and SIZE > 1 else (False,))]


@pytest.mark.skipif(not CUDA_USABLE, reason="no GPU, and NUMBA_ENABLE_CUDASIM=1 is not set")
@pytest.mark.parametrize("selector", ["Prioritized", "MaxPriority"])  # (Fifo orders by wall-clock stamps)
@pytest.mark.parametrize("mode,force", PATHS, ids=[f"{m}-{'alltoallv' if f else 'shm'}" for m, f in PATHS])
def test_gpu_replay_matches_cpu_replay(mode, force, selector):
    sampler = gm.Prioritized(0.7, 0.5) if selector == "Prioritized" else gm.MaxPriority()
    kw = dict(mode=mode, force_alltoallv=force, seed=11, timeout=TIMEOUT)
    # remote windows over torch.distributed, or (Prioritized) over MPI with device buffers
    transport = "mpi" if force and sampler.proportional else "nccl"
    gpu = gm.Replay(SPEC, 48, sampler, device="cuda", window_transport=transport, **kw)
    cpu = gm.Replay(SPEC, 48, sampler, device="cpu", **kw)
    cpu._solo = False  # one host rank draws from its shard's stream (Replay._sample): compare the collective draw
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
            assert st["total"]["windows_mpi"] > 0, st
    gpu.close()
    cpu.close()


def _called_from(path_end: str) -> bool:
    """Whether a frame of the current call stack runs code of a file whose path ends with ``path_end``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith(path_end):
            return True
        frame = frame.f_back
    return False


@pytest.mark.skipif(os.environ.get("NUMBA_ENABLE_CUDASIM") != "1", reason="counts the simulator's uploads")
@pytest.mark.parametrize("mode", ["local", "decentralized"])
def test_device_sample_uploads_its_rows_once(mode, monkeypatch):
    """A device sample's gathers, its mask and its metadata tensors (keys, probabilities, weights, lengths) all
    read one upload of the rows' choices: one host-to-device copy by the window transport a sample, however many
    owners, where there were eleven on one rank (the H100 profile of 2026-12-05 counted 13 pageable copies a
    sample, selection included). Counted under the simulator: numba's ``to_device`` and torch's ``Tensor.to``
    onto the replay's device, called from gear_mpi/distributed/transport.py; and the whole sample's copies each
    way: 2 uploads (the draw's uniforms and that one) and, after an update, 2 downloads (the index's total and
    smallest weight together, the drawn slots with their weights), where the profile counted 13 and 6."""
    from numba import cuda
    transport = os.path.join("distributed", "transport.py")
    replay = gm.Replay(SPEC, 48, gm.Uniform(), device="cuda", mode=mode, seed=3, timeout=TIMEOUT)
    rng = np.random.default_rng(RANK)
    for i in range(3):
        replay.insert({"obs": rng.random((4, 3)).astype(np.float32), "step": np.arange(4) + 10 * i,
                       "flag": rng.random(4) < 0.5}, 1.0)
    uploads = []
    to_device, tensor_to = cuda.to_device, torch.Tensor.to

    def counted_to_device(*args, **kwargs):
        uploads.append(("numba", _called_from(transport)))
        return to_device(*args, **kwargs)

    def counted_to(self, *args, **kwargs):
        if (args[0] if args else kwargs.get("device")) == replay.device.torch_device:
            uploads.append(("torch", _called_from(transport)))
        return tensor_to(self, *args, **kwargs)

    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    downloads = []
    copy_to_host = FakeCUDAArray.copy_to_host

    def counted_copy_to_host(self, *args, **kwargs):
        downloads.append(1)
        return copy_to_host(self, *args, **kwargs)

    monkeypatch.setattr(cuda, "to_device", counted_to_device)
    monkeypatch.setattr(torch.Tensor, "to", counted_to)
    monkeypatch.setattr(FakeCUDAArray, "copy_to_host", counted_copy_to_host)
    for align in ("random", "tail"):
        uploads.clear()
        downloads.clear()
        batch = replay.sample(3 + RANK, 4, align)
        assert [kind for kind, by_transport in uploads if by_transport] == ["torch"], uploads
        assert sorted(kind for kind, _ in uploads) == ["numba", "torch"], uploads
        replay.update_priorities(batch.keys, np.linspace(0.5, 2.0, len(batch)))
        downloads.clear()
        replay.sample(3 + RANK, 4, align)
        assert len(downloads) == 2, downloads
        assert len(batch) == 3 + RANK and batch.lengths.dtype == torch.int64 and batch.keys.dtype == torch.int64
        assert batch.probabilities.dtype == torch.float64 and batch.weights.dtype == torch.float32
        np.testing.assert_array_equal(batch.mask.numpy().sum(1), batch.lengths.numpy())
        probabilities = batch.probabilities.numpy()
        assert ((probabilities > 0) & (probabilities <= 1)).all(), probabilities
    monkeypatch.undo()
    replay.close()


REAL_GPU = os.environ.get("NUMBA_ENABLE_CUDASIM") != "1" and torch.cuda.is_available()


@pytest.mark.skipif(not REAL_GPU, reason="a real GPU: the simulator registers no host memory")
def test_pinned_mapping_outlives_dropped_views_and_closes_quietly():
    """Seen on an H100: numba unpins a registration when the last view sliced from it dies, and a view dying
    after ``close()`` printed "Freeing dead memory". The mapping holds the registration until ``close()``."""
    import gc
    import sys
    import warnings
    from gear_mpi.kernels import cuda_priority
    from gear_mpi.storage import pinned
    host = np.arange(1 << 20, dtype=np.uint8)
    m = pinned.map_host(host)
    view = m.view(host[4096:8192])
    sub = pinned.map_host(host[:65536])   # a sub-range: a non-owning mapping over views of this one
    del view
    sub.close()
    del sub
    gc.collect()
    np.testing.assert_array_equal(m.device.copy_to_host(), host)   # still registered: the bytes read back
    kept = m.view(host[:4096])
    unraisable = []
    old_hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        m.close()
        del kept
        gc.collect()
    finally:
        sys.unraisablehook = old_hook
    assert not unraisable, [str(u.exc_value) for u in unraisable]
    with pinned.map_host(host) as again:   # unregistered by close(): the buffer can be registered again
        np.testing.assert_array_equal(again.device.copy_to_host(), host)
    # gear_mpi's own small launches print no low-occupancy warning (numba's, at fewer than 128 blocks)
    from numba import cuda
    values = cuda.to_device(np.arange(1.0, 9.0))
    out = cuda.device_array(1, np.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cuda_priority.smallest(values, out)
        cuda.synchronize()
    assert out.copy_to_host()[0] == 1.0
    assert not [w for w in caught if "under-utilization" in str(w.message)], [str(w.message) for w in caught]


def test_torch_comm_alltoallv_over_gloo():
    from gear_mpi.distributed import torch_comm
    tc = torch_comm.TorchComm(COMM, "gloo", timeout=30)
    # rank r sends (r + d) % 3 elements to rank d: zeros included
    send_counts = np.array([(RANK + d) % 3 for d in range(SIZE)])
    recv_counts = np.array([(s + RANK) % 3 for s in range(SIZE)])
    send = torch.cat([torch.full((int(c),), 100 * RANK + d, dtype=torch.int64) for d, c in enumerate(send_counts)])
    recv = torch.empty(int(recv_counts.sum()), dtype=torch.int64)
    tc.alltoallv(send, send_counts, recv, recv_counts, "test")
    expect = torch.cat([torch.full((int(c),), 100 * s + RANK, dtype=torch.int64) for s, c in enumerate(recv_counts)])
    assert torch.equal(recv, expect), (recv, expect)
    tc.close()


def test_init_torch_process_group_joins_every_rank():
    """gm.init_torch_process_group: a gloo group over the MPI ranks, set up twice in one job (the second call
    finds torch.distributed initialised and makes a new group over the same ranks); a bad backend is refused
    on every rank before any communication."""
    import torch.distributed as dist
    with pytest.raises(ValueError, match="backend must be"):
        gm.init_torch_process_group(COMM, "mpi")
    created = not dist.is_initialized()
    groups = [gm.init_torch_process_group(COMM, "gloo", timeout=30) for _ in range(2)]
    if created:
        assert groups[0] is dist.group.WORLD and groups[1] is not dist.group.WORLD
    for g in groups:
        t = torch.tensor([RANK + 1], dtype=torch.int64)
        dist.all_reduce(t, group=g)
        assert int(t) == SIZE * (SIZE + 1) // 2
    dist.destroy_process_group()
