"""The one place that asks numba-cuda about the machine, and the device-array helpers.

Everything that runs CUDA code in gear_mpi (:mod:`gear_mpi.storage.device`,
:mod:`gear_mpi.storage.pinned`, the ``kernels/cuda_*`` modules and the device priority
index) asks :func:`simulator_enabled` whether numba-cuda runs on its CPU
simulator (``NUMBA_ENABLE_CUDASIM=1``), and converts or inspects device arrays
with the helpers below. numba-cuda is imported lazily, by the first call that
needs it, so importing this module costs nothing on a machine without it.

Before numba-cuda is used on a real GPU, :func:`check_versions` refuses the
numba-cuda / numpy pairs that cannot compile a kernel (see its docstring); the
simulator runs kernels as Python and is not affected.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import re
from typing import Any, Optional

import numpy as np

INSTALL_HINT = ("gear_mpi's CUDA kernels need numba-cuda: pip install 'gear-mpi[cuda12]' (or [cuda13]); "
                "set NUMBA_ENABLE_CUDASIM=1 to run them on the CUDA simulator")

_CUDA: list = []  # the numba.cuda module, once imported

# numpy 2.5 removed ``np.row_stack``. numba-cuda 0.21.1 (the first 0.21 on PyPI) to 0.30.4 (the
# newest when this was written; every release's wheel in between was read) register an overload of it at
# module level in ``numba/cuda/np/arrayobj.py``, which the first kernel compilation imports: it
# fails with "module 'numpy' has no attribute 'row_stack'". numba itself guards it since 0.68.
ROW_STACK_NUMBA_CUDA = ((0, 21), (0, 30, 4))  # first and last numba-cuda known to fail
NUMPY_WITHOUT_ROW_STACK = (2, 5)


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric part of a version string: ``"2.5.0rc1"`` -> ``(2, 5, 0)``."""
    m = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def installed_versions() -> tuple[str, Optional[str]]:
    """The versions :func:`check_versions` judges.

    Returns:
        ``(numpy version, numba-cuda version)``; the second is None when numba-cuda
        is not installed (as a distribution).
    """
    try:
        numba_cuda = importlib.metadata.version("numba-cuda")
    except importlib.metadata.PackageNotFoundError:
        numba_cuda = None
    return np.__version__, numba_cuda


def _registers_row_stack() -> bool:
    """Whether importing numba-cuda's array overloads fails on the missing ``np.row_stack``.

    Asked only for numba-cuda releases newer than the last one read (their code is unknown).
    """
    try:
        importlib.import_module("numba.cuda.np.arrayobj")
    except AttributeError as exc:
        return "row_stack" in str(exc)
    except ImportError:  # another layout: whatever it does, it does not fail this way here
        return False
    return False


def check_versions(numpy_version: Optional[str] = None, numba_cuda_version: Optional[str] = None) -> None:
    """Refuse a numba-cuda / numpy pair that cannot compile CUDA kernels.

    numpy 2.5 removed ``np.row_stack``, and numba-cuda 0.21 to 0.30.4 still refer to it when
    they compile a kernel. For a numba-cuda newer than 0.30.4 with numpy 2.5 or later, its
    array overloads are imported once to find out. No cost on a working pair beyond reading
    two versions. The CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) compiles nothing and is
    not affected; :func:`cuda_module` skips this check there.

    Args:
        numpy_version: the numpy version to judge (default: the installed one).
        numba_cuda_version: the numba-cuda version to judge (default: the installed one;
            nothing is checked when it is not installed).

    Raises:
        RuntimeError: the pair cannot compile kernels; the message names both versions and
            the fix (``pip install 'numpy<2.5'``, as gear-mpi's ``cuda12``/``cuda13`` extras pin).
    """
    installed_numpy, installed_numba_cuda = installed_versions()
    numpy_version = numpy_version or installed_numpy
    numba_cuda_version = numba_cuda_version or installed_numba_cuda
    if numba_cuda_version is None or _release(numpy_version) < NUMPY_WITHOUT_ROW_STACK:
        return
    first, last = ROW_STACK_NUMBA_CUDA
    release = _release(numba_cuda_version)
    broken = first <= release <= last or (release > last and _registers_row_stack())
    if broken:
        raise RuntimeError(
            f"numba-cuda {numba_cuda_version} cannot compile CUDA kernels with numpy {numpy_version}: "
            f"numpy 2.5 removed np.row_stack, which numba-cuda (0.21 to at least 0.30.4) still registers. "
            f"Fix: pip install 'numpy<2.5' (gear-mpi's [cuda12]/[cuda13] extras pin it), or a numba-cuda "
            f"release newer than {numba_cuda_version} that supports numpy 2.5. The CUDA simulator "
            f"(NUMBA_ENABLE_CUDASIM=1) is not affected.")


def cuda_module():
    """The ``numba.cuda`` module (imported on first use).

    On a real GPU (not the simulator) the first call checks the numba-cuda / numpy pair
    with :func:`check_versions`.

    Returns:
        The ``numba.cuda`` module.

    Raises:
        ImportError: numba-cuda is not installed (the message says how to install it).
        RuntimeError: this numba-cuda cannot compile kernels with this numpy (see
            :func:`check_versions`).
    """
    if not _CUDA:
        if not simulator_enabled():
            check_versions()
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


#: numba warns (NumbaPerformanceWarning) at every launch of fewer blocks than this
LOW_OCCUPANCY_BLOCKS = 128


def _launch_settings():
    """numba-cuda's settings module (the one its dispatcher reads at each launch), or None."""
    try:
        from numba.cuda.core import config
    except ImportError:  # an older numba-cuda, or numba's built-in CUDA target
        from numba.core import config
    return config


def launch(kernel, grid: int, threads: int):
    """``kernel[grid, threads]``, without numba's low-occupancy warning for a small grid. O(1).

    numba warns at every launch of fewer than 128 blocks. gear_mpi launches small grids on purpose
    (the one-block prefix over the top level, the draws and gathers of a small batch), and without
    this a program would print the warning at every sample. The setting is lowered for this launch
    alone and put back, so a user's own kernels still warn; under the simulator nothing is changed.

    Args:
        kernel: a ``numba.cuda.jit`` kernel.
        grid: blocks.
        threads: threads per block.

    Returns:
        The configured kernel, ready to be called with its arguments.
    """
    if grid >= LOW_OCCUPANCY_BLOCKS or simulator_enabled():
        return kernel[grid, threads]
    settings = _launch_settings()
    before = getattr(settings, "CUDA_LOW_OCCUPANCY_WARNINGS", None)
    if not before:  # off already, or a numba-cuda without the setting
        return kernel[grid, threads]
    settings.CUDA_LOW_OCCUPANCY_WARNINGS = 0
    try:
        return kernel[grid, threads]
    finally:
        settings.CUDA_LOW_OCCUPANCY_WARNINGS = before


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


__all__ = ["INSTALL_HINT", "as_device", "blocks_for", "check_versions", "cuda_module", "device_address",
           "installed_versions", "is_device_array", "simulated_device_array", "simulator_enabled"]
