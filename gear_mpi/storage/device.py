"""DeviceContext: which GPU a rank uses, and device buffers shared by torch and numba-cuda.

``device="cuda"`` picks the GPU of the rank's *local* rank (its rank within the
node), as SPMD training code does; ``"cuda:N"`` names one. Batches are torch
CUDA tensors; numba-cuda kernels write into them through
``__cuda_array_interface__`` (no copy).

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``, no GPU) the same code runs
on the CPU: "device" tensors are CPU tensors and the kernels' device arrays wrap
their memory. That is how CI exercises the GPU path.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where used: importing gear_mpi does not import torch
    import torch

from ..kernels.cuda_support import check_versions, cuda_module, simulated_device_array, simulator_enabled

#: threads a block of the window gather on a GPU (see DeviceContext.gather_threads)
GATHER_THREADS = 512


def parse_device(device: str) -> tuple[str, int | None]:
    """Split a device name: ``"cpu"`` -> ("cpu", None); ``"cuda"`` -> ("cuda", None); ``"cuda:N"`` -> ("cuda", N).

    Args:
        device: the name.

    Returns:
        (kind, GPU index or None).

    Raises:
        TypeError: not a string.
        ValueError: another name.
    """
    if not isinstance(device, str):
        raise TypeError(f"device must be a string such as 'cpu', 'cuda' or 'cuda:1', got {device!r}")
    if device == "cpu":
        return "cpu", None
    if device == "cuda":
        return "cuda", None
    if device.startswith("cuda:") and device[5:].isdigit():
        return "cuda", int(device[5:])
    raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


def gpu_for(local_rank: int, gpus: int, index: int | None = None) -> int:
    """The GPU a rank uses: ``index`` if given, else its local rank modulo the node's GPUs.

    Args:
        local_rank: the rank within its node.
        gpus: GPUs on the node.
        index: an explicit GPU, or None.

    Returns:
        The GPU index.

    Raises:
        RuntimeError: no GPU.
        ValueError: ``index`` does not exist.
    """
    if gpus < 1:
        raise RuntimeError("no GPU on this node")
    chosen = local_rank % gpus if index is None else index
    if not 0 <= chosen < gpus:
        raise ValueError(f"device cuda:{chosen} does not exist: this node has {gpus} GPU(s)")
    return chosen


class DeviceContext:
    """The GPU of one rank: torch device, numba device, and buffer helpers.

    Args:
        device: ``"cuda"`` or ``"cuda:N"``.
        local_rank: picks the GPU when ``device == "cuda"`` (``local_rank % gpus``).

    Raises:
        ValueError: not a CUDA device name, or a GPU that does not exist.
        RuntimeError: no GPU (and no simulator), with the reason; or a numba-cuda / numpy
            pair that cannot compile kernels (the message names both versions and the fix).
    """

    def __init__(self, device: str = "cuda", local_rank: int = 0):
        import torch
        kind, index = parse_device(device)
        if kind != "cuda":
            raise ValueError("DeviceContext is for CUDA devices; use device='cpu' for the host path")
        self.simulator = simulator_enabled()
        if self.simulator:
            self.index = 0 if index is None else index
            self.torch_device = torch.device("cpu")
            self.threads = self.gather_threads = 32  # simulated threads are Python threads: keep launches small
        else:
            check_versions()  # before the GPU checks: a wrong install is the first thing to fix
            if not torch.cuda.is_available():
                raise RuntimeError("device='cuda' but torch sees no GPU (set NUMBA_ENABLE_CUDASIM=1 to simulate)")
            cuda = cuda_module()
            self.index = gpu_for(local_rank, torch.cuda.device_count(), index)
            torch.cuda.set_device(self.index)
            cuda.select_device(self.index)
            self.torch_device = torch.device("cuda", self.index)
            self.threads = 256
            # the window gather reads mapped host memory over the bus: more threads a block, more reads in
            # flight (H100, 64 KiB windows: 93.1% of a pinned copy's rate at 512 threads, 91.6% at 256)
            self.gather_threads = GATHER_THREADS
        self.name = f"cuda:{self.index}"

    def empty(self, shape: tuple[int, ...], dtype) -> torch.Tensor:
        """An uninitialised tensor on this device.

        Args:
            shape: its shape.
            dtype: a numpy dtype (mapped to torch's).

        Returns:
            The tensor (a CPU tensor under the simulator).

        Raises:
            TypeError: torch has no such dtype.
        """
        import torch
        return torch.empty(shape, dtype=_torch_dtype(dtype), device=self.torch_device)

    def staging(self, nbytes: int) -> torch.Tensor:
        """A page-locked host buffer of at least ``nbytes`` bytes (uint8; plain host memory under the simulator),
        kept and grown: where columns decoded on the host (compressed ones) are written before their copy to
        the device. Valid until the next call. O(1), or one allocation when it grows.
        """
        import torch
        buf = getattr(self, "_staging", None)
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(int(nbytes), 1 << 16), dtype=torch.uint8, pin_memory=not self.simulator)
            self._staging = buf
        return buf

    def numba_view(self, tensor: torch.Tensor):
        """A numba-cuda device array over the tensor's memory (no copy).

        Args:
            tensor: a tensor on this device.

        Returns:
            The device array (a simulator array under the simulator).
        """
        if self.simulator:
            return simulated_device_array(tensor.numpy())
        return cuda_module().as_cuda_array(tensor)

    def synchronize(self) -> None:
        """Wait for the work queued on this GPU (nothing to wait for under the simulator)."""
        if not self.simulator:
            import torch
            torch.cuda.synchronize(self.torch_device)


@lru_cache(maxsize=None)
def _torch_dtypes() -> dict:
    import torch
    return {np.dtype(k): v for k, v in [
        ("bool", torch.bool), ("uint8", torch.uint8), ("int8", torch.int8), ("int16", torch.int16),
        ("int32", torch.int32), ("int64", torch.int64), ("float16", torch.float16), ("float32", torch.float32),
        ("float64", torch.float64), ("complex64", torch.complex64), ("complex128", torch.complex128),
        ("uint16", torch.uint16), ("uint32", torch.uint32), ("uint64", torch.uint64)]}


def _torch_dtype(dtype) -> torch.dtype:
    try:
        return _torch_dtypes()[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"no torch dtype for {np.dtype(dtype)}") from None
