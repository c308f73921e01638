"""Batch: the result of a sample -- one ``[B, W, ...]`` tensor per column plus per-item metadata."""
from __future__ import annotations

import collections.abc
import functools
import os
import sys
from types import MappingProxyType
from typing import TYPE_CHECKING, Iterator, Mapping

import numpy as np
from numba import njit

if TYPE_CHECKING:  # torch is imported at the first tensor read: a process that reads none never imports it
    import torch

from .batch_memory import MIN_BYTES as POOLED_BYTES, byte_buffer
from .spec import TrajectorySpec


@njit(cache=True, nogil=True)
def _address(array):
    """The address of ``array``'s first byte (an int). O(1)."""
    return array.ctypes.data


# Column buffers of a page or more start on a page boundary, smaller ones on a cache line. A sample
# copies ring rows into them with memmove; on AMD Zen (this project's 2-core EPYC VM) glibc's memmove of
# 4 KiB page-aligned ring rows into a destination 16 bytes past a page boundary (where numpy's allocator
# puts large arrays) ran about 5x slower than into an aligned one: 256 random rows of 4 KiB took 459 us
# against 89 us (scripts: docs/benchmarks/issue15_copy_alignment.py).
PAGE_ALIGN = 4096
LINE_ALIGN = 64


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on a page boundary (``PAGE_ALIGN``) when it
    holds a page or more, else on a cache line (``LINE_ALIGN``). O(1); at most one alignment unit of
    memory more than the array needs.

    Args:
        shape: the array's shape.
        dtype: its dtype.
    Returns:
        The array (a view of a slightly larger byte buffer, which it keeps alive).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    align = PAGE_ALIGN if nbytes >= PAGE_ALIGN else LINE_ALIGN
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes].view(dtype).reshape(shape)


_FROM_NUMPY = []  # torch.from_numpy, once torch is imported (at the first batch)


def _torch_from_numpy():
    if not _FROM_NUMPY:
        import torch
        _FROM_NUMPY.append(torch.from_numpy)
    return _FROM_NUMPY[0]


def _host_fields(batch: "Batch", data: Mapping[str, np.ndarray], mask: np.ndarray, meta: tuple, squeezed,
                 stored: int | None = None, addresses: np.ndarray | None = None) -> None:
    """Set a host batch's attributes, in one update: the column buffers ``data``, ``mask`` and ``meta`` (keys,
    probabilities, weights, lengths), ``stored`` (the columns the gather kernels fill, the stored ones first;
    None: all) and the columns' ``addresses`` (None: computed at first use). No tensor is made here: each is
    made at its first read (:class:`_ColumnTensors`, :class:`_MetaTensor`), so that a process that never reads
    one never imports torch. O(1)."""
    batch.__dict__.update(squeezed=bool(squeezed), _np=data, _fits=None, _bytes=None, _stored=stored,
                          _addresses=addresses, _meta_np=meta, _mask_np=mask, _made=None)


class _LazyColumns(collections.abc.Mapping):
    """A new host batch's column buffers (name -> numpy array over the batch's one allocation, :meth:`Batch.empty`),
    each array made at its first read and kept: a sample fills the columns through their addresses, so a
    caller that reads no column as numpy pays for none (``np.ndarray`` over the allocation, about 0.4 us a
    column: 2.4 of a 20 us sample of 32 one-step transitions into a new batch). A read-only mapping in spec
    order, as the dict of a batch built from arrays. O(1) a read.

    Args:
        raw: the batch's allocation (uint8); off: where its aligned part starts in it.
        views: :func:`_layout`'s ``(offset, nbytes, dtype, shape)`` of each column (then the other buffers').
        index: column name -> its place in ``views`` (one dict per layout).
    """

    __slots__ = ("_raw", "_off", "_views", "_index", "_arrays")

    def __init__(self, raw: np.ndarray, off: int, views: list, index: dict[str, int]):
        self._raw, self._off, self._views, self._index, self._arrays = raw, off, views, index, {}

    def __getitem__(self, name: str) -> np.ndarray:
        array = self._arrays.get(name)
        if array is None:
            at, _, dtype, shape = self._views[self._index[name]]  # KeyError for a name of no column
            array = self._arrays[name] = np.ndarray(shape, dtype, self._raw, self._off + at)
        return array

    def __iter__(self) -> Iterator[str]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


def _column_tensor(batch: "Batch", name: str):
    """Host batch ``batch``'s tensor of column ``name``, made at its first read and kept (``_made``), so that
    ``batch[name]`` and ``batch.data[name]`` are one tensor. O(1). Raises KeyError for an unknown column."""
    made = batch._made
    if made is None:
        made = batch.__dict__["_made"] = {}  # (past __setattr__'s check)
    tensor = made.get(name)
    if tensor is None:
        tensor = made[name] = _torch_from_numpy()(batch._np[name])
    return tensor


class _ColumnTensors:
    """A host batch's ``data`` (column name -> tensor, read-only), made at its first read and then kept in the batch's
    ``__dict__`` (a non-data descriptor, as :class:`_MetaTensor`): a sample makes no tensor, and a caller
    pays ``torch.from_numpy`` (about 0.5 us a column) for the columns it reads (``batch[name]`` makes one;
    ``batch.data`` all of them, the same tensor objects). A device batch sets ``data`` as a plain attribute."""

    def __get__(self, batch, owner=None):
        if batch is None:
            return self
        if batch._made is None:  # (the common case, in one comprehension: no column read yet)
            from_numpy = _torch_from_numpy()
            data = {name: from_numpy(array) for name, array in batch._np.items()}
        else:  # the columns read so far keep their tensors
            data = {name: _column_tensor(batch, name) for name in batch._np}
        view = MappingProxyType(data)  # read-only: a tensor put in a column's place would not be refilled
        batch.__dict__.update(data=view, _made=data)
        return view


#: a host batch's metadata tensors, in the order of its buffers after the columns (mask, then ``_meta_np``'s)
_META_NAMES = ("mask", "keys", "probabilities", "weights", "lengths")
#: what a batch's ``__setattr__`` refuses: what it hands out and its shape
_READ_ONLY = frozenset(("data", "squeezed") + _META_NAMES)


@functools.cache
def _use_count():
    """A function of a tensor: its storage's use count beyond a tensor that nothing shares (0 for one made by
    ``torch.from_numpy`` and not viewed), or False where torch does not report use counts. Imports torch at
    the first call; then O(1)."""
    import torch
    raw = getattr(torch._C, "_storage_Use_Count", None)
    if raw is None:  # pragma: no cover - every supported torch has it
        return False
    probe = torch.from_numpy(np.zeros(1))  # (alive while its count is read)
    alone = raw(probe.untyped_storage()._cdata)
    return lambda t: raw(t.untyped_storage()._cdata) - alone


class _MetaTensor:
    """A host batch's metadata tensor (``mask``, ``keys``, ...), made at its first use and kept in the batch's
    ``__dict__``, which later reads find first (a non-data descriptor): a small batch's sample pays one
    ``torch.from_numpy`` (about 0.5 us) only for the tensors its caller reads, and a first read costs about
    0.4 us besides (it cost 2 us through ``__getattr__``, after Python's failed lookup). A device batch
    (``Batch.from_tensors``) sets them as plain attributes."""

    __slots__ = ("name", "index")

    def __init__(self, index: int):
        self.index = index  # in ``_meta_np`` (-1: the mask)

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, batch, owner=None):
        if batch is None:
            return self
        i = self.index
        value = batch.__dict__[self.name] = _torch_from_numpy()(batch._mask_np if i < 0 else batch._meta_np[i])
        return value


class Batch:
    """Sampled windows, as torch tensors that share memory with numpy buffers.

    - ``batch[name]`` -- ``[B, W, *shape]`` tensor of column ``name`` (zero where padded);
    - ``mask`` -- ``[B, W]`` bool, True on real steps;
    - ``keys`` -- ``[B]`` int64 keys, for :meth:`update_priorities`;
    - ``probabilities`` -- ``[B]`` float64, the probability each item had of being chosen per draw;
    - ``weights`` -- ``[B]`` float32 importance weights (1 unless prioritized);
    - ``lengths`` -- ``[B]`` int64, real steps in each window.

    A *squeezed* batch (``squeezed``: one-step windows, ``W = 1``) holds each column as ``[B, *shape]``
    instead of ``[B, 1, *shape]`` (the same bytes; ``mask`` stays ``[B, 1]``): what one-step transitions
    (DQN, SAC) want. :meth:`squeeze` gives that view of any ``W = 1`` batch.

    Its attributes (``data``, ``mask``, ``keys``, ..., ``squeezed``) and its mappings (``data``, :meth:`numpy`)
    cannot be rebound or changed (the tensors' and arrays' contents can: they are the batch's buffers): a later
    ``sample(out=batch)`` refills the batch's own buffers, so a value put in their place would go stale.

    Construction keeps the buffers: O(1), no copy. A host batch makes each tensor at its first read (about
    0.5 us; :meth:`numpy` and :meth:`meta_numpy` make none), so a process that never reads one never imports
    torch (about 1.4 s of a process's start here).
    Args:
        data: column name -> ``[B, W, *shape]`` numpy buffer.
        mask: ``[B, W]`` bool numpy buffer.
        keys: ``[B]`` int64 numpy buffer.
        probabilities: ``[B]`` float64 numpy buffer.
        weights: ``[B]`` float32 numpy buffer.
        lengths: ``[B]`` int64 numpy buffer.
        squeezed: whether ``data`` holds ``[B, *shape]`` one-step columns (``mask`` is ``[B, 1]``).
    """

    data = _ColumnTensors()  # column name -> tensor (made at first read; set by from_tensors)
    mask = _MetaTensor(-1)
    keys = _MetaTensor(0)
    probabilities = _MetaTensor(1)
    weights = _MetaTensor(2)
    lengths = _MetaTensor(3)

    def __init__(self, data: dict[str, np.ndarray], mask: np.ndarray, keys: np.ndarray,
                 probabilities: np.ndarray, weights: np.ndarray, lengths: np.ndarray, squeezed: bool = False):
        _host_fields(self, data, mask, (keys, probabilities, weights, lengths), squeezed)

    @classmethod
    def from_tensors(cls, data: dict[str, torch.Tensor], mask: torch.Tensor, keys: torch.Tensor,
                     probabilities: torch.Tensor, weights: torch.Tensor, lengths: torch.Tensor) -> "Batch":
        """A batch over existing tensors (e.g. on a GPU); :meth:`numpy` is then unavailable. O(1), no copy.

        Args:
            data: column name -> ``[B, W, *shape]`` tensor.
            mask: ``[B, W]`` bool tensor.
            keys: ``[B]`` int64 tensor.
            probabilities: ``[B]`` float64 tensor.
            weights: ``[B]`` float32 tensor.
            lengths: ``[B]`` int64 tensor.
        Returns:
            The batch.
        """
        self = cls.__new__(cls)
        self.__dict__.update(squeezed=False, _made=None, _np=None, _fits=None, _bytes=None, _stored=None,
                             _addresses=None, _meta_np=None, _mask_np=None, data=MappingProxyType(dict(data)),
                             mask=mask, keys=keys, probabilities=probabilities, weights=weights, lengths=lengths)
        return self

    @classmethod
    def empty(cls, spec: TrajectorySpec, batch_size: int, window: int, squeeze: bool = False) -> "Batch":
        """Fresh, uninitialised host buffers, aligned as :func:`aligned_empty` aligns one (a column of a page
        or more on a page boundary, smaller ones on a cache line), carved from one allocation whose layout
        is computed once per spec and size (a small batch's allocation is the per-call cost of a sample that
        returns a new batch: one numpy allocation and one tensor per buffer). O(B W step_bytes) memory.

        Args:
            spec: the columns.
            batch_size: windows (``B``).
            window: steps per window (``W``).
            squeeze: columns as ``[B, *shape]`` (``window`` must be 1; see the class docstring).
        Returns:
            The batch.
        Raises:
            ValueError: ``squeeze`` with a window other than 1.
        """
        if squeeze and window != 1:
            raise ValueError(f"squeeze=True takes one-step windows (window=1), got window={window}")
        layouts = spec.__dict__.get("_batch_layouts")  # kept on the spec: a spec is not hashable
        if layouts is None or len(layouts) > _MAX_LAYOUTS:
            layouts = spec.__dict__["_batch_layouts"] = {}
        plan = layouts.get((batch_size, window, squeeze))
        if plan is None:
            plan = layouts[(batch_size, window, squeeze)] = _layout(spec, batch_size, window, squeeze)
        total, align, views, column_offsets, index = plan
        size = total + align
        # a large batch: a kept buffer that nothing refers to any more (batch_memory), its pages mapped already
        raw = np.empty(size, np.uint8) if size < POOLED_BYTES else byte_buffer(size)
        base = _address(raw)  # (``raw.ctypes.data`` builds a ctypes object: about 1 us, 0.2 this way)
        off = (-base) % align
        # one ndarray constructor per buffer (a slice, a view and a reshape cost about 3x as much); the columns'
        # at their first read (_LazyColumns): the kernels fill them through their addresses
        n = len(index)
        meta = [np.ndarray(shape, dtype, raw, off + at) for at, nbytes, dtype, shape in views[n:]]
        batch = cls.__new__(cls)  # (about 1 us less a batch than through __init__'s arguments)
        _host_fields(batch, _LazyColumns(raw, off, views, index), meta[0], tuple(meta[1:]), squeeze,
                     len(spec.names), column_offsets + (base + off))  # (the addresses: contiguous and sized)
        return batch

    def __getstate__(self) -> dict:
        """What a copy or a pickle of the batch keeps (``copy.copy``, ``copy.deepcopy``, ``pickle``: all go through
        it): a host batch's numpy buffers, without what is derived from where they lie -- its tensors, column
        addresses, byte views and remembered fit, made again from the copy's own buffers. A deep copy or an
        unpickled batch that kept the original's addresses would have a later ``sample(out=copy)`` write into the
        original batch's memory (or memory freed since). A device batch keeps its tensors. O(1) (the copy of
        the buffers is the copier's).

        Returns:
            The state (:meth:`__setstate__` puts it back).
        """
        state = dict(self.__dict__)
        if state.get("_np") is not None:
            state["_np"] = dict(state["_np"])  # (a new batch's columns, made now if not yet read)
            for name in ("data",) + _META_NAMES:
                state.pop(name, None)
            state.update(_made=None, _addresses=None, _bytes=None, _fits=None)
        elif state.get("data") is not None:  # (a read-only view does not pickle: its dict does)
            state["data"] = dict(state["data"])
        return state

    def __setstate__(self, state: dict) -> None:
        """The inverse of :meth:`__getstate__` (a device batch's ``data`` read-only again). O(1)."""
        if isinstance(state.get("data"), dict):
            state = {**state, "data": MappingProxyType(state["data"])}
        self.__dict__.update(state)

    def __setattr__(self, name: str, value) -> None:
        """The batch's tensors, buffers and shape are read-only (a private attribute is set as usual): a tensor put
        in a column's place would not be refilled by a later ``sample(out=batch)`` (which writes where the batch's
        own buffers lie), and the batch would hand out stale rows. O(1).

        Raises:
            AttributeError: ``data``, ``mask``, ``keys``, ``probabilities``, ``weights``, ``lengths`` or ``squeezed``.
        """
        if name in _READ_ONLY:
            raise AttributeError(f"batch.{name} is read-only: a later sample(out=batch) refills the batch's own "
                                 f"buffers, not a value put in their place; keep yours in a variable of its own")
        object.__setattr__(self, name, value)

    def column_addresses(self) -> np.ndarray:
        """The address of each stored column's buffer (int64, in column order; derived columns are not included), for kernels that take addresses
        (``gather.out_addresses``); valid while the batch lives. Computed once, then O(1).

        Raises:
            RuntimeError: a device batch.
            ValueError: a column buffer that is not C-contiguous (a batch built over foreign arrays).
        """
        if self._addresses is None:
            views = self.byte_views()
            for name, a in zip(self._np, views):
                if not self._np[name].flags.c_contiguous:
                    raise ValueError(f"batch column {name!r} is not C-contiguous")
            self._addresses = np.array([a.ctypes.data for a in views], np.int64)
        return self._addresses

    def byte_views(self) -> tuple[np.ndarray, ...]:
        """Each stored column's buffer as a flat uint8 array, for the gather kernels. Built once, then O(1).

        Returns:
            One view per stored column, in column order (same memory as the tensors); a spec's derived
            columns (:mod:`gear_mpi.frames`) are in :meth:`derived_views`.
        Raises:
            RuntimeError: a device batch.
        """
        if self._bytes is None:
            views = tuple(a.reshape(-1).view(np.uint8) for a in self.numpy().values())
            n = len(views) if self._stored is None else self._stored
            self._bytes = views[:n], views[n:]
        return self._bytes[0]

    def derived_views(self) -> tuple[np.ndarray, ...]:
        """Each derived column's buffer (after the stored ones) as a flat uint8 array, for the frame
        rebuild kernel (:mod:`gear_mpi.kernels.frames`). O(1) after :meth:`byte_views`' first call.

        Raises:
            RuntimeError: a device batch.
        """
        self.byte_views()
        return self._bytes[1]

    def owns_keys(self, keys) -> bool:
        """Whether ``keys`` is this host batch's own keys array or its keys tensor (without making the tensor):
        an update of exactly the keys a sample returned. O(1).

        Args:
            keys: anything (as ``update_priorities`` takes it).
        """
        return self._np is not None and (keys is self._meta_np[0] or keys is self.__dict__.get("keys"))

    def meta_numpy(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The per-item metadata as numpy arrays (same memory as the tensors). O(1).

        Returns:
            ``(keys, probabilities, weights, lengths)``.
        Raises:
            RuntimeError: a device batch.
        """
        if self._meta_np is None:
            raise RuntimeError("this batch lives on a device; use its tensors")
        return self._meta_np

    def mask_numpy(self) -> np.ndarray:
        """The mask as a numpy array (same memory as the ``mask`` tensor, which it does not make). O(1).

        With :meth:`numpy` and :meth:`meta_numpy` it lets a process read a whole batch without torch.
        Returns:
            ``[B, W]`` bool, True on real steps (``[B, 1]`` for a squeezed batch).
        Raises:
            RuntimeError: a device batch.
        """
        if self._mask_np is None:
            raise RuntimeError("this batch lives on a device; use its tensors (batch.mask)")
        return self._mask_np

    def numpy(self) -> Mapping[str, np.ndarray]:
        """The column buffers as numpy arrays (same memory as the tensors). O(1).

        Returns:
            Column name -> ``[B, W, *shape]`` array, a read-only mapping (``dict(batch.numpy())`` for one of your
            own): the arrays are the batch's, which a later ``sample(out=batch)`` refills, so an array put in
            their place would not be (the sample writes where the batch's own buffers lie).
        Raises:
            RuntimeError: a device batch.
        """
        if self._np is None:
            raise RuntimeError("this batch lives on a device; use its tensors (batch[name], batch.mask)")
        return MappingProxyType(self._np)

    @property
    def device(self) -> torch.device:
        """The torch device the tensors live on. O(1)."""
        return self.mask.device

    @property
    def columns(self) -> tuple[str, ...]:
        """The column names, in spec order. O(columns)."""
        return tuple(self._names())

    def _names(self) -> Mapping:
        """The columns by name, in spec order, without making tensors: a host batch's buffers, a device batch's
        tensors. O(1)."""
        return self._np if self._np is not None else self.data

    @property
    def batch_size(self) -> int:
        """Windows in the batch (``B``). O(1)."""
        return int((self._mask_np if self._np is not None else self.mask).shape[0])

    @property
    def window(self) -> int:
        """Steps per window (``W``). O(1)."""
        return int((self._mask_np if self._np is not None else self.mask).shape[1])

    def __getitem__(self, name: str) -> torch.Tensor:
        """Column ``name``'s ``[B, W, *shape]`` tensor (``[B, *shape]`` squeezed); a host batch makes it at the
        first read (about 0.5 us, and torch's import in a process that had none), then O(1).

        Raises:
            KeyError: no such column.
        """
        try:
            data = self.__dict__.get("data")
            return data[name] if data is not None else _column_tensor(self, name)
        except (KeyError, TypeError):
            raise KeyError(f"no column {name!r} in this batch; it has {list(self._names())}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return self.batch_size

    @property
    def nbytes(self) -> int:
        """Bytes of all returned tensors (columns, mask, keys, probabilities, weights, lengths). O(columns)."""
        columns = ([a.nbytes for a in self._np.values()] if self._np is not None
                   else [t.numel() * t.element_size() for t in self.data.values()])
        return (sum(columns) + self.window * self.batch_size
                + 8 * 3 * self.batch_size + 4 * self.batch_size)

    def references(self) -> tuple[int, ...] | None:
        """Reference counts of the batch and of every buffer, tensor and tensor storage it holds, as they would
        read had nobody made any tensor (a tensor the batch made at a read and holds alone counts as none).

        Two calls from the same kind of place (the same references held by the caller) give equal
        tuples exactly when nothing else took or dropped a reference in between: a kept tensor, a
        torch or numpy view of a buffer, a tensor's ``numpy()``, an autograd graph that saved a
        tensor, a kept ``numpy()`` dict or ``meta_numpy()`` tuple all count; a tensor made in between (at its
        first read) and held by the batch alone does not. Used to refill a batch only when nobody outside
        holds any of it (``batches(recycle="auto")``). A raw pointer or a weak reference is not seen. Makes no
        tensor and imports nothing. O(columns).

        Returns:
            The counts, or None for a device batch or a torch without storage use counts.
        """
        if self._np is None:
            return None
        d = self.__dict__
        made = d.get("_made") or {}
        tensors = [*(made.get(name) for name in self._np), *(d.get(name) for name in _META_NAMES)]
        arrays = [*self._np.values(), self._mask_np, *self._meta_np]
        use_count = _use_count() if any(t is not None for t in tensors) else None
        if use_count is False:  # pragma: no cover - every supported torch has it
            return None
        counts = [sys.getrefcount(self), sys.getrefcount(self._np), sys.getrefcount(self._meta_np)]
        for i in range(len(arrays)):  # (by index: a loop variable or zip's kept tuple would count too)
            if tensors[i] is None:
                counts += (0, 0, sys.getrefcount(arrays[i]))
            else:  # the batch's dict, the list and getrefcount's argument hold it; it holds its array
                counts += (sys.getrefcount(tensors[i]) - 3, use_count(tensors[i]), sys.getrefcount(arrays[i]) - 1)
        # a numpy view of an aligned buffer refers to the memory's owner (aligned_empty's byte buffer), not to it
        counts.extend(sys.getrefcount(a.base) for a in arrays if a.base is not None)
        return tuple(counts)

    def matches(self, spec: TrajectorySpec, batch_size: int, window: int, squeeze: bool = False) -> bool:
        """Whether this batch's buffers can take the windows of a sample, as ``out=``. O(columns), then O(1).

        The last spec it fitted is remembered, so a reused ``out=`` batch is checked once.
        Args:
            spec: the columns.
            batch_size: windows wanted.
            window: steps per window.
            squeeze: whether the sample wants squeezed columns (:meth:`empty`).
        Returns:
            True when it is a host batch of ``batch_size`` windows of ``window`` steps of ``spec``'s columns,
            squeezed exactly when ``squeeze`` is.
        """
        if self._fits is not None and self._fits[0] is spec and self._fits[1:] == (batch_size, window, squeeze):
            return True
        lead = 1 if self.squeezed else 2
        ok = (self._np is not None and self.squeezed == bool(squeeze) and tuple(self._np) == spec.batch_names
              and self.batch_size == batch_size and self.window == window
              and all(self._np[c.name].dtype == c.dtype and self._np[c.name].shape[lead:] == c.shape
                      for c in spec.batch_columns))
        if ok and self._stored is None:  # a batch made from arrays: the stored columns come first
            self._stored = len(spec.names)
        if ok:
            self._fits = (spec, batch_size, window, bool(squeeze))
        return ok

    def squeeze(self) -> "Batch":
        """This batch with one-step columns as ``[B, *shape]`` (a batch over the same memory; itself when
        already squeezed). Host or device. O(columns), no copy.

        Returns:
            The squeezed batch (mask, keys, probabilities, weights and lengths are the same tensors).
        Raises:
            ValueError: a window other than 1.
        """
        if self.squeezed:
            return self
        if self.window != 1:
            raise ValueError(f"squeeze() takes a batch of one-step windows (W=1), this one has W={self.window}")
        if self._np is None:
            out = Batch.from_tensors({k: v[:, 0] for k, v in self.data.items()}, self.mask, self.keys,
                                     self.probabilities, self.weights, self.lengths)
            out.__dict__["squeezed"] = True
            return out
        out = Batch({k: v[:, 0] for k, v in self._np.items()}, self._mask_np, *self._meta_np, squeezed=True)
        out._stored = self._stored
        return out

    def to_tensordict(self, batch_dims: int = 2, separator: str | None = None):
        """The batch as a ``tensordict.TensorDict`` over the same tensors (tensordict is imported here).

        Every column goes in under its name (split into a nested key at each ``separator`` when one is given:
        ``"next.obs"`` with ``"."`` becomes ``("next", "obs")``), beside the metadata ``"mask"`` ([B, W]) and
        ``"keys"``, ``"probabilities"``, ``"weights"``, ``"lengths"`` (one per window).

        Args:
            batch_dims: 2 (default): ``batch_size=[B, W]``, the per-window metadata expanded along ``W`` (a
                stride-0 view); 1: ``batch_size=[B]``, the metadata ``[B]``, columns and mask ``[B, W, ...]``.
            separator: a string that splits column names into nested keys (None: keys are the names).
        Returns:
            The TensorDict, on the batch's device.
        Raises:
            ValueError: ``batch_dims`` not 1 or 2, or a column whose key is one of the metadata names
                (or a prefix of one, or has one as its prefix).
            ModuleNotFoundError: tensordict is not installed (``pip install gear-mpi[torchrl]``).
        Cost: O(columns); no copy.
        """
        from tensordict import TensorDict

        if batch_dims not in (1, 2):
            raise ValueError(f"batch_dims must be 1 ([B]) or 2 ([B, W]), got {batch_dims!r}")
        b, w = self.batch_size, self.window
        meta = {"keys": self.keys, "probabilities": self.probabilities, "weights": self.weights,
                "lengths": self.lengths}
        if batch_dims == 2:
            meta = {k: v[:, None].expand(b, w) for k, v in meta.items()}
        out = {"mask": self.mask, **meta}
        for name, tensor in self.data.items():
            key = tuple(name.split(separator)) if separator else (name,)
            if key[0] in out or any(not part for part in key):
                raise ValueError(f"to_tensordict: column {name!r} would be the key {key}, which is empty or clashes "
                                 f"with the batch's metadata {sorted(out)}; rename the column")
            out[key if len(key) > 1 else key[0]] = tensor
        td = TensorDict(batch_size=[b, w][:batch_dims], device=self.device)
        for key, tensor in out.items():  # nested keys: the sub-TensorDicts are made on the way
            td.set(key, tensor)
        return td

    def __repr__(self) -> str:
        cols = ", ".join(f"{k}: {tuple(v.shape)} {str(v.dtype).removeprefix('torch.')}"
                         for k, v in self._names().items())  # a host batch's buffers: no tensor made
        return f"Batch(B={self.batch_size}, W={self.window}, {cols}{', squeezed' if self.squeezed else ''})"


#: Batch.empty keeps this many layouts per spec (by batch size, window, squeeze), then starts afresh
_MAX_LAYOUTS = 64


def _layout(spec: TrajectorySpec, batch_size: int, window: int, squeeze: bool) -> tuple[int, int, list, np.ndarray,
                                                                                   dict[str, int]]:
    """Where each buffer of a batch lies in one allocation: ``(bytes, base alignment, [(offset, nbytes, dtype,
    shape)], column offsets, column index)``, the columns in spec order, then mask, keys, probabilities, weights,
    lengths (the column offsets: int64, the columns' alone; the index: column name -> its place). A buffer of a page
    or more starts on a page boundary, a smaller one on a cache line (as :func:`aligned_empty`). O(columns)."""
    lead = (batch_size,) if squeeze else (batch_size, window)
    shapes = [(lead + c.shape, c.dtype) for c in spec.batch_columns]
    shapes += [((batch_size, window), np.dtype(np.bool_)), ((batch_size,), np.dtype(np.int64)),
               ((batch_size,), np.dtype(np.float64)), ((batch_size,), np.dtype(np.float32)),
               ((batch_size,), np.dtype(np.int64))]
    views, at, base = [], 0, LINE_ALIGN
    for shape, dtype in shapes:
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        align = PAGE_ALIGN if nbytes >= PAGE_ALIGN else LINE_ALIGN
        base = max(base, align)
        at += (-at) % align
        views.append((at, nbytes, dtype, shape))
        at += nbytes
    offsets = np.array([v[0] for v in views[:len(spec.columns)]], np.int64)
    return at, base, views, offsets, {name: i for i, name in enumerate(spec.batch_names)}


ALIGNS = {"random": 0, "head": 1, "tail": 2}


def check_window(spec: TrajectorySpec, window: int | None, align: str) -> tuple[int, int]:
    """Validate a sample's ``window`` and ``align``. O(1).

    Args:
        spec: the replay's spec (its ``max_length`` is the default window).
        window: steps per window, a positive integer, or None for ``spec.max_length``.
        align: a key of :data:`ALIGNS` (``"random"``, ``"head"`` or ``"tail"``).

    Returns:
        ``(window, align code)`` as ints.

    Raises:
        ValueError: ``window`` is not a positive integer or None, or ``align`` is not in :data:`ALIGNS`.
    """
    if window is None:
        window = spec.max_length
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window must be a positive integer or None, got {window!r}")
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {sorted(ALIGNS)}, got {align!r}")
    return int(window), ALIGNS[align]


def check_batch_size(batch_size: int) -> int:
    """Validate a batch size. O(1).

    Args:
        batch_size: a non-negative integer (not a bool).

    Returns:
        It, as an int.

    Raises:
        ValueError: anything else.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 0:
        raise ValueError(f"batch_size must be a non-negative integer, got {batch_size!r}")
    return int(batch_size)


#: bytes a sampled window costs besides its steps: its key, probability, weight and length, and the owner's
#: 48-byte choice record (the mask's byte per step is counted with the steps)
WINDOW_OVERHEAD = 8 + 8 + 4 + 8 + 48


@functools.cache
def machine_bytes() -> int:
    """This machine's physical memory in bytes (0 where the OS does not say), read once per process. O(1)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def check_out(spec: TrajectorySpec, device: bool, out, batch_size: int, window: int) -> None:
    """A replay's checks of a sample's ``out=`` (None: nothing to check) and of its batch's size. O(columns),
    then O(1) for a batch that fitted before (:meth:`Batch.matches`).

    Args:
        spec: the replay's columns; device: whether the replay samples onto a GPU (it returns new batches).
        out: the ``out=`` argument; batch_size, window: the call's (checked).
    Raises:
        TypeError: ``out`` is not a Batch. ValueError: it does not fit, or the batch would not fit in memory.
    """
    check_batch_bytes(spec, batch_size, window)  # with out=, as the arguments are checked before agreeing
    if out is not None and not isinstance(out, Batch):
        raise TypeError(f"out= must be a Batch (one an earlier sample returned), got {type(out).__name__}")
    if out is not None and (device or not out.matches(spec, batch_size, window)):
        raise ValueError(f"out= must be a host batch of batch_size={batch_size} windows of window={window} "
                         f"steps of this replay's spec (device replays return new batches), got {out!r}")


def check_batch_bytes(spec: TrajectorySpec, batch_size: int, window: int) -> None:
    """Refuse a sample whose batch could never be allocated: more bytes than this machine's memory. O(1)
    (``spec.batch_step_bytes`` and the machine's memory are read once).

    Checked with the other arguments, before a replay's ranks agree on them, so that such a batch size fails
    on every rank at once instead of as a MemoryError deep in the call on some ranks.
    Args:
        spec: the columns; batch_size: windows asked (checked); window: steps per window (checked).
    Raises:
        ValueError: ``batch_size`` windows of ``window`` steps of ``spec`` take more than the machine's memory.
    """
    need = batch_size * (window * spec.batch_step_bytes + WINDOW_OVERHEAD)
    have = machine_bytes()
    if have and need > have:
        raise ValueError(f"batch_size={batch_size} windows of {window} steps would take {need / 2**30:.1f} GiB, "
                         f"more than this machine's memory ({have / 2**30:.1f} GiB)")
