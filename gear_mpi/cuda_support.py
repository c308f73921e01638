"""The one place that asks numba-cuda about the machine, and the device-array helpers.

Everything that runs CUDA code in gear_mpi (:mod:`gear_mpi.device`,
:mod:`gear_mpi.pinned`, the ``kernels/cuda_*`` modules and the device priority
index) asks :func:`simulator_enabled` whether numba-cuda runs on its CPU
simulator (``NUMBA_ENABLE_CUDASIM=1``), and converts or inspects device arrays
with the helpers below. numba-cuda is imported lazily, by the first call that
needs it, so importing this module costs nothing on a machine without it.
"""
from __future__ import annotations

from typing import Any

import numpy as np

INSTALL_HINT = ("gear_mpi's CUDA kernels need numba-cuda: pip install 'gear-mpi[cuda12]' (or [cuda13]); "
                "set NUMBA_ENABLE_CUDASIM=1 to run them on the CUDA simulator")

_CUDA: list = []  # the numba.cuda module, once imported


def cuda_module():
    """The ``numba.cuda`` module (imported on first use).

    Returns:
        The ``numba.cuda`` module.

    Raises:
        ImportError: numba-cuda is not installed (the message says how to install it).
    """
    if not _CUDA:
        try:
            from numba import cuda
        except ImportError as exc:  # pragma: no cover - depends on the installation
            raise ImportError(INSTALL_HINT) from exc
        _CUDA.append(cuda)
    return _CUDA[0]


def simulator_enabled() -> bool:
    """Whether numba-cuda runs on its CPU simulator (``NUMBA_ENABLE_CUDASIM=1``).

    Reads numba-cuda's configuration (``numba.cuda.core.config``; older layouts keep
    the flag in ``numba.core.config``). Without numba-cuda the answer is numba's own
    flag, False unless set.

    Returns:
        True when CUDA kernels run on the simulator.
    """
    try:
        from numba.cuda.core import config
    except ImportError:  # numba-cuda missing, or an older layout
        from numba.core import config
    return bool(getattr(config, "ENABLE_CUDASIM", False))


def is_device_array(x: Any) -> bool:
    """Whether ``x`` lives on the device.

    Args:
        x: any object.

    Returns:
        True for numba device arrays (simulator arrays included) and for objects that
        expose ``__cuda_array_interface__`` (CUDA tensors, CuPy arrays); False otherwise.
    """
    return bool(getattr(x, "__cuda_ndarray__", False)) or hasattr(x, "__cuda_array_interface__")


def as_device(x: Any, dtype, copy_host: bool = True):
    """``x`` as a numba device array of ``dtype``.

    Device arrays and CUDA tensors are used in place; host arrays are copied to the
    device. ``copy_host`` is accepted for compatibility and ignored.

    Args:
        x: a device array, an object with ``__cuda_array_interface__``, or anything
            numpy turns into an array.
        dtype: the dtype the kernel needs.

    Returns:
        A numba device array of ``dtype`` (the same memory as ``x`` when it is on the device).

    Raises:
        TypeError: ``x`` is on the device with another dtype (no silent conversion there).
        ImportError: numba-cuda is not installed.
    """
    dtype = np.dtype(dtype)
    if getattr(x, "__cuda_ndarray__", False):
        arr = x
    elif hasattr(x, "__cuda_array_interface__"):
        arr = cuda_module().as_cuda_array(x)
    else:
        return cuda_module().to_device(np.ascontiguousarray(x, dtype))
    if np.dtype(arr.dtype) != dtype:
        raise TypeError(f"device array has dtype {arr.dtype}; {dtype} is needed")
    return arr


def blocks_for(n: int, threads: int) -> int:
    """The number of CUDA blocks of ``threads`` threads that cover ``n`` items (at least 1).

    Args:
        n: items, one thread each.
        threads: threads per block.

    Returns:
        ``ceil(n / threads)``, at least 1.
    """
    return max(1, -(-int(n) // int(threads)))


def device_address(arr: Any) -> int:
    """The device address of a device array's first element.

    Args:
        arr: a numba device array, a simulator array or an object with
            ``__cuda_array_interface__``.

    Returns:
        The address as an int (under the simulator: the host address of the numpy data).
    """
    ary = getattr(arr, "_ary", None)  # the simulator's FakeCUDAArray wraps a numpy array
    if ary is not None:
        return int(ary.__array_interface__["data"][0])
    return int(arr.__cuda_array_interface__["data"][0])


def simulated_device_array(host: np.ndarray):
    """A simulator "device" array over the memory of numpy array ``host`` (no copy).

    Args:
        host: the numpy array to wrap.

    Returns:
        A ``FakeCUDAArray``; writes through it are seen in ``host`` and back.

    Raises:
        ImportError: numba-cuda is not installed.
    """
    cuda_module()
    from numba.cuda.simulator.cudadrv.devicearray import FakeCUDAArray
    return FakeCUDAArray(host)


__all__ = ["INSTALL_HINT", "as_device", "blocks_for", "cuda_module", "device_address", "is_device_array",
           "simulated_device_array", "simulator_enabled"]
