"""Page-lock an existing host buffer and map it into the GPU's address space (zero copy).

A shard keeps its columns in one host arena (:mod:`gear_mpi.storage.arenas`: private memory
or a POSIX shared-memory segment). :func:`map_host` registers such a buffer with
the CUDA driver (``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_DEVICEMAP``,
through numba-cuda's ``Context.mempin(..., mapped=True)``, the call behind
``numba.cuda.mapped``) and returns a :class:`MappedBuffer` whose ``device`` array
is a device view of the same bytes: a CUDA kernel reads it directly over the
bus, without a copy into device memory. :meth:`MappedBuffer.view` turns a numpy
view inside the buffer (e.g. one column of the arena) into the matching device
view; :func:`map_byte_views` does that for a shard's ``byte_views()``.

Register the whole arena once, not each column: columns are 64-byte aligned, so
neighbouring columns share pages, and the driver refuses to register a page
twice. :func:`map_host` therefore returns the live mapping that already covers a
buffer (the same object, or a view of a larger one) instead of registering again.

Cost: registration pins every page of the buffer once (it commits lazily
allocated memory; scripts/gpu_check.py reports the time per ring); :meth:`close`
unregisters.
Registration uses the current CUDA context (numba's primary context of the
current device, shared with torch), so no ``PORTABLE`` flag is set: map the
buffer again from a process's other contexts if it uses several.

Under the CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) nothing is registered: the
simulator's device arrays are numpy arrays, so ``device`` is a plain,
zero-copy wrapper of the host buffer (``mode == "simulator"``), and writes
through either side are seen by the other, as with real mapped memory.

This module needs numba-cuda only when a function is called.
"""
from __future__ import annotations

import weakref

import numpy as np

from ..kernels.cuda_support import cuda_module, simulated_device_array, simulator_enabled

is_simulator = simulator_enabled  # the name this module has always exported

__all__ = ["MappedBuffer", "map_host", "map_byte_views", "is_simulator"]


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


# live registrations: host address -> MappedBuffer (weak), to reuse instead of registering twice
_LIVE: "weakref.WeakValueDictionary[int, MappedBuffer]" = weakref.WeakValueDictionary()


class MappedBuffer:
    """A host buffer page-locked and mapped into the device's address space.

    - ``host``: the numpy array (unchanged; keep using it on the CPU);
    - ``device``: a device array of the same shape and dtype over the same memory;
    - ``device_bytes``: the same memory as a flat device uint8 array;
    - ``mode``: ``"mapped"`` (registered with the driver) or ``"simulator"``.

    Close it (or use it as a context manager) before the host memory goes away;
    device views are invalid after :meth:`close`. Closing a mapping obtained for a
    sub-range (see :func:`map_host`) does nothing: its parent owns the registration.
    Build it with :func:`map_host`, not directly.

    Args:
        host: the host array.
        device: the device array over the same memory.
        device_bytes: the same memory as a flat device uint8 array.
        mode: ``"mapped"`` or ``"simulator"``.
        pin: the driver's registration, freed by :meth:`close` (None: not owned).
        parent: the mapping that owns the registration, for a sub-range (None: this one).
    """

    def __init__(self, host: np.ndarray, device, device_bytes, mode: str, pin=None, parent=None):
        self.host = host
        self.device = device
        self.device_bytes = device_bytes
        self.mode = mode
        self._pin = pin
        self._parent = parent
        self.closed = False

    @property
    def nbytes(self) -> int:
        """The size of the mapped buffer in bytes. O(1)."""
        return int(self.host.nbytes)

    @property
    def address(self) -> int:
        """The host address of the buffer. O(1)."""
        return _address(self.host)

    def contains(self, a: np.ndarray) -> bool:
        """Whether numpy array ``a`` lies wholly inside this buffer (by address). O(1).

        Args:
            a: any numpy array.

        Returns:
            True when its bytes are inside ``host``.
        """
        lo = _address(a)
        return self.address <= lo and lo + a.nbytes <= self.address + self.nbytes

    def view(self, a: np.ndarray):
        """The device view of ``a``, a numpy view inside ``host``. O(1), no copy.

        Args:
            a: a C-contiguous numpy array lying inside ``host``.

        Returns:
            A device array of ``a``'s shape and dtype over the same bytes.

        Raises:
            ValueError: the mapping is closed, or ``a`` is not C-contiguous or not inside ``host``.
        """
        if self.closed:
            raise ValueError("this mapping is closed")
        if not a.flags.c_contiguous:
            raise ValueError("only C-contiguous views of a mapped buffer have a device view")
        if not self.contains(a):
            raise ValueError("the array does not lie inside this mapped buffer")
        off = _address(a) - self.address
        flat = self.device_bytes[off:off + a.nbytes]
        if a.dtype != np.uint8:
            flat = flat.view(a.dtype)
        return flat.reshape(a.shape) if a.ndim != 1 else flat

    def close(self) -> None:
        """Unregister (page-unlock) the buffer; O(pages) once. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if self._parent is None and _LIVE.get(self.address) is self:
            del _LIVE[self.address]
        pin, self._pin = self._pin, None
        if pin is not None:
            unregister(pin)
        self.device = self.device_bytes = None

    def __enter__(self) -> "MappedBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else self.mode
        return f"MappedBuffer({self.nbytes} bytes at {self.address:#x}, {state})"


def unregister(pin) -> None:
    """Unregister a registration made by numba's ``Context.mempin(..., mapped=True)`` now. O(pages).

    ``mempin`` returns an owned pointer to numba's mapped-memory record, which counts the
    pointers and views over it and unregisters the memory when that count falls to zero.
    A mapping is closed before its host memory goes away, so the record is freed here at once,
    whatever views are still alive (they are invalid after :meth:`MappedBuffer.close`); the
    record is then marked as no longer managed, so that when those views and the owned
    pointer die their count reaching zero frees nothing twice (numba would raise "Freeing
    dead memory" in their finalizers, printed as an ignored exception; seen on an H100).

    Args:
        pin: what ``mempin`` returned (an owned pointer), or the memory record itself.
    """
    record = getattr(pin, "_mem", pin)   # the record behind numba's owned pointer (a weak proxy to it)
    try:
        if record.is_managed:
            record.free()
            record.is_managed = False
    except ReferenceError:  # the record is gone already (its context was torn down): nothing is registered
        pass


def _host_bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def map_host(array: np.ndarray) -> MappedBuffer:
    """Page-lock ``array`` and map it into the device's address space.

    Args:
        array: a C-contiguous, writable, non-empty numpy array.

    Returns:
        A :class:`MappedBuffer`. If a live mapping already covers ``array``: that mapping
        (same range) or a non-owning view of it (sub-range). O(pages) once.

    Raises:
        TypeError: not a numpy array.
        ValueError: not C-contiguous, empty or read-only.
        ImportError: numba-cuda is not installed.
    """
    if not isinstance(array, np.ndarray):
        raise TypeError(f"map_host takes a numpy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError("map_host needs a C-contiguous array")
    if array.nbytes == 0:
        raise ValueError("cannot map an empty array")
    if not array.flags.writeable:
        raise ValueError("map_host needs a writable array")
    for m in list(_LIVE.values()):
        if not m.closed and m.contains(array):
            if m.address == _address(array) and m.nbytes == array.nbytes and m.host.dtype == array.dtype \
                    and m.host.shape == array.shape:
                return m
            return MappedBuffer(array, m.view(array), m.view(_host_bytes(array)), m.mode, parent=m)
    cuda = cuda_module()
    if simulator_enabled():
        m = MappedBuffer(array, simulated_device_array(array), simulated_device_array(_host_bytes(array)), "simulator")
    else:
        from numba.cuda.cudadrv import devicearray, driver
        ctx = cuda.current_context()
        pin = ctx.mempin(array, driver.host_pointer(array), driver.host_memory_size(array), mapped=True)
        dev = devicearray.from_array_like(array, gpu_data=pin)
        dev_bytes = devicearray.DeviceNDArray(shape=(array.nbytes,), strides=(1,), dtype=np.uint8, gpu_data=pin)
        m = MappedBuffer(array, dev, dev_bytes, "mapped", pin=pin)
    _LIVE[m.address] = m
    return m


def map_byte_views(buffer: np.ndarray, views: dict) -> tuple[MappedBuffer, dict]:
    """Map ``buffer`` once and give the device view of each numpy view inside it. O(pages) once, then O(views).

    Args:
        buffer: the host buffer, e.g. ``shard.store.arena.buffer``.
        views: name -> numpy view inside ``buffer``, e.g. ``shard.store.byte_views()``.

    Returns:
        (the mapping, name -> device view). Close the mapping when done.

    Raises:
        ValueError: a view does not lie inside ``buffer``.
    """
    lo, hi = _address(buffer), _address(buffer) + buffer.nbytes
    for name, v in views.items():
        if not (lo <= _address(v) and _address(v) + v.nbytes <= hi):
            raise ValueError(f"view {name!r} does not lie inside the buffer")
    m = map_host(buffer)
    return m, {name: m.view(v) for name, v in views.items()}
