"""The priority indexes that proportional selectors draw from: one weight per slot.

- :class:`PriorityIndex` -- host memory, CPU kernels (:mod:`~gear_mpi.kernels.priority_tree`
  for updates, :mod:`~gear_mpi.kernels.priority_draw` for draws).
- :class:`DevicePriorityIndex` -- the same structure in GPU memory, numba-cuda kernels
  (:mod:`~gear_mpi.kernels.cuda_priority`), the same results bit for bit.

Both hold the structure as one :class:`~gear_mpi.kernels.priority_tree.Tree` (built
once, passed whole to every kernel call) and offer the same methods: ``set``,
``draw``, ``rebuild``, ``weights_of``, ``host_leaves``, ``total``, ``min_positive``,
and, for checkpoints, ``KIND``, ``sections`` and ``restore``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..kernels.cuda_support import as_device, cuda_module, is_device_array, simulator_enabled
from ..kernels import priority_draw, thread_share
from ..kernels.hints import staggered_rows
from ..kernels import priority_tree as tree_kernels
from ..kernels.priority_tree import LEAF_DTYPE, TREE_FIELDS, Tree, leaf_values

SET_SCRATCH_KEEP = 1 << 20  # set: batches up to this many slots keep their scratch (24 bytes a slot)
_NO_INTS, _NO_FLOATS = np.empty((2, 0), np.int64), np.empty(0, np.float64)
LEVEL_FIELDS = TREE_FIELDS[1:]  # everything but the leaves: what a checkpoint may carry to skip a rebuild
_SMALL_TOP = 24  # min_positive: a top level up to this long is read as a list (up to 98,304 slots; 0.2-0.6 us, not 1)


def _aligned_zeros(n: int, fill: float = 0.0, dtype=np.float64) -> np.ndarray:
    """An array of ``n`` entries of ``dtype`` (float64 or float32) starting on a 64-byte (cache-line) boundary."""
    size = np.dtype(dtype).itemsize
    raw = np.empty(n + 64 // size, dtype)
    skip = (-raw.ctypes.data % 64) // size
    out = raw[skip:skip + n]
    out.fill(fill)
    return out


def _set_rows(nb: int) -> tuple[np.ndarray, np.ndarray]:
    """:meth:`PriorityIndex.set`'s scratch: ``[2, nb]`` int64 and ``nb`` float64, staggered in one allocation
    (the kernel walks the three rows side by side; see ``hints.staggered_rows``). O(1)."""
    rows = staggered_rows(3, nb)
    return rows[:2], rows[2].view(np.float64)


def _leaves_section(sections: Mapping[str, np.ndarray], count: int) -> np.ndarray:
    """The saved leaves: float32 (what a host index saves) or float64 (a device index's, and every
    checkpoint written before the leaves were float32)."""
    leaves = sections.get("leaves")
    if leaves is None:
        raise ValueError("section 'leaves' is missing")
    leaves = np.asarray(leaves)
    if leaves.shape != (count,) or leaves.dtype not in (np.float32, np.float64):
        raise ValueError(f"section 'leaves' has {leaves.shape} x {leaves.dtype}, expected ({count},) x float32 "
                         f"or float64")
    return leaves


def _leaves_as_held(leaves: np.ndarray) -> bool:
    """Whether saved leaves are exactly what an index holds (each its own ``leaf_value``), so that saved
    level arrays computed from them may be taken as they are. O(count)."""
    return leaves.dtype == np.float32 or bool(np.array_equal(leaf_values(leaves), leaves))


def _levels_fit(sections: Mapping[str, np.ndarray], tree: Tree) -> bool:
    """Whether ``sections`` holds every level array, each of this structure's length and dtype."""
    for name in LEVEL_FIELDS:
        got = sections.get(name)
        if got is None or np.asarray(got).dtype != np.float64 or len(got) != getattr(tree, name).shape[0]:
            return False
    return True


class PriorityIndex:
    """Per-slot weights in the blocked sum/min structure of :mod:`gear_mpi.kernels.priority_tree`.

    Memory: about 5.3 bytes per slot (float32 leaves, float64 levels above them: a weight is held
    rounded to float32, see :func:`~gear_mpi.kernels.priority_tree.leaf_value`). ``set``: O(B + n / 4096)
    (each update recounts one line of leaves and one of line sums). ``draw``: O(B (log(n / 4096) + 80)),
    two cache misses per draw, parallel.

    Args:
        n: the number of slots (weights start at 0).
    """

    KIND = "blocked"  # checkpoints store the level arrays of this structure too

    def __init__(self, n: int):
        n1, n2 = tree_kernels.level_sizes(n)
        self.tree = Tree(leaves=_aligned_zeros(n, dtype=LEAF_DTYPE), l0_sum=_aligned_zeros(tree_kernels.line_count(n)),
                         l1_sum=_aligned_zeros(n1), l1_min=np.full(n1, np.inf), l2_sum=np.zeros(n2, np.float64),
                         l2_min=np.full(n2, np.inf), prefix=np.zeros(n2 + 1, np.float64))
        self._arrays = tuple(self.tree)  # what the kernels get: a plain tuple dispatches faster (see Tree)
        self.__dict__.update(self.tree._asdict())  # index.leaves, ...: the same arrays, never rebound
        self._flags1 = np.zeros(n1, np.uint8)
        self._flags2 = np.zeros(n2, np.uint8)
        self._bounds = np.empty(n2 + 1, np.int64)  # set's scratch (see _set_scratch)
        self._scratch_i, self._scratch_f = _NO_INTS, _NO_FLOATS

    @property
    def total(self) -> float:
        """Sum of all weights. O(1)."""
        return float(self.tree.prefix[-1])

    @property
    def min_positive(self) -> float:
        """Smallest positive weight (inf if none). O(n / 4096)."""
        top = self.tree.l2_min
        if top.shape[0] <= _SMALL_TOP:  # a few entries: Python's min over a list (numpy's reduction: about 2 us)
            return float(min(top.tolist()))
        return float(top.min())

    def __len__(self) -> int:
        return self.tree.leaves.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the structure's arrays (about 5.3 a slot). O(1)."""
        return sum(int(a.nbytes) for a in self.tree) + int(getattr(self, "_flags1", np.zeros(0)).nbytes) \
            + int(getattr(self, "_flags2", np.zeros(0)).nbytes)

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        """Set ``weight[slots[i]] = values[i]`` (the last of duplicate slots wins), each rounded to float32
        (:func:`~gear_mpi.kernels.priority_tree.leaf_value`).

        Args:
            slots: int slots in ``[0, n)`` (not checked: the kernel trusts them).
            values: the new weights, non-negative and not NaN.

        Cost: O(B + n / 4096), one kernel call (on the threads from ``thread_share.THREADS_MIN_ITEMS`` slots).
        """
        nb = len(slots)
        if nb:
            ints, floats = self._set_scratch(nb)
            alone = thread_share.caller_alone(nb, tree_kernels.SET_SERIAL_MAX + 1)
            try:
                tree_kernels.set_leaves_into(self._arrays, self._flags1, self._flags2,
                                             np.ascontiguousarray(slots, np.int64),
                                             np.ascontiguousarray(values, np.float64), self._bounds, ints[0], floats,
                                             ints[1])
            finally:
                thread_share.give_back(alone)

    def _set_scratch(self, nb: int) -> tuple[np.ndarray, np.ndarray]:
        """Scratch rows for :meth:`set` of ``nb`` slots (``[2, nb]`` int64, ``nb`` float64), kept up to
        ``SET_SCRATCH_KEEP`` slots so that repeated large updates fault in no fresh pages. O(1) when kept."""
        if nb <= tree_kernels.SET_SERIAL_MAX:
            return _NO_INTS, _NO_FLOATS
        if nb > SET_SCRATCH_KEEP:
            return _set_rows(nb)
        if nb > self._scratch_f.shape[0]:
            self._scratch_i, self._scratch_f = _set_rows(nb)
        return self._scratch_i[:, :nb], self._scratch_f[:nb]

    def draw(self, uniforms: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """Draw one slot per uniform, with replacement: P(slot) = weight / total.

        Args:
            uniforms: float64 numbers in [0, 1).
            out: an int64 array of ``len(uniforms)`` to fill, or None for a new one.

        Returns:
            The drawn slots (``out`` when given). The caller guarantees a positive total.

        Cost: O(B (log(n / 4096) + 80)), one kernel call.
        """
        out = np.empty(len(uniforms), np.int64) if out is None else out
        alone = thread_share.caller_alone(len(uniforms), priority_draw.DRAW_THREADS_MIN)
        try:
            priority_draw.draw(self._arrays, uniforms, out)
        finally:
            thread_share.give_back(alone)
        return out

    def rebuild(self) -> None:
        """Recompute every level from the leaves. O(n), parallel."""
        tree_kernels.rebuild(self._arrays)

    def weights_of(self, slots: np.ndarray) -> np.ndarray:
        """The weights of ``slots``. O(B).

        Args:
            slots: int slots in ``[0, n)``.

        Returns:
            A new host float64 array, one weight per slot (as held: rounded to float32).

        Raises:
            IndexError: a slot out of range.
        """
        return self.tree.leaves[slots].astype(np.float64)

    def host_leaves(self, count: int) -> np.ndarray:
        """The first ``count`` weights as a host array. O(1).

        Args:
            count: how many (at most ``n``).

        Returns:
            A view of the leaves (no copy; float32).
        """
        return self.tree.leaves[:count]

    # ---- checkpoint state -----------------------------------------------------------------
    def sections(self, count: int) -> list[tuple[str, np.ndarray]]:
        """The arrays a checkpoint stores, as (name, view) pairs, in the checkpoint's order. O(1).

        Args:
            count: the slots in use (the store's high-water mark): only ``leaves[:count]`` is given.

        Returns:
            ``("leaves", leaves[:count])`` (float32) then every level array whole (``LEVEL_FIELDS``).
            Views, no copy: write them out before the index changes.
        """
        return [("leaves", self.tree.leaves[:count])] + [(name, getattr(self.tree, name)) for name in LEVEL_FIELDS]

    def restore(self, sections: Mapping[str, np.ndarray], count: int) -> None:
        """Load the state :meth:`sections` described, into this new (all-zero) index.

        Uses the level arrays when every one is given with this index's length and
        dtype and the leaves are as an index holds them (float32 values: a copy, O(n / 8));
        otherwise sets the ``count`` leaves, which recomputes the levels (O(count)): float64
        leaves of checkpoints written before the leaves were float32 are rounded then.
        Leaves past ``count`` are left as they are (zero in a new index).

        Args:
            sections: ``"leaves"`` (float32 or float64, ``count`` entries) and optionally the level arrays.
            count: the slots in use.

        Raises:
            ValueError: ``"leaves"`` is missing or not ``count`` float values (nothing changed).
        """
        leaves = _leaves_section(sections, count)
        if _levels_fit(sections, self.tree) and _leaves_as_held(leaves):
            self.tree.leaves[:count] = leaves
            for name in LEVEL_FIELDS:
                getattr(self.tree, name)[:] = sections[name]
        else:
            self.set(np.arange(count, dtype=np.int64), leaves)

    def __repr__(self) -> str:
        return f"PriorityIndex(n={len(self)}, total={self.total})"


_CP: list = []


def _cuda_kernels():
    """The CUDA priority kernels (numba-cuda imported on first use)."""
    if not _CP:
        from ..kernels import cuda_priority
        _CP.append(cuda_priority)
    return _CP[0]


class DevicePriorityIndex:
    """:class:`PriorityIndex` on the GPU: same layout, same results.

    ``set``/``draw`` take host arrays (copied to the device) or device arrays /
    CUDA tensors (used in place); ``draw`` returns a device int64 array (call
    ``copy_to_host()``). Memory: about 9.3 bytes per slot of device memory (float64 leaves
    holding the host index's float32-rounded values), and :meth:`draw_to_host`'s buffer (16 bytes a draw of the
    largest batch drawn). ``set``: six launches, O(B * 64 + n / 4096).
    ``draw``: one thread per draw, O(log(n / 4096) + 128) reads each.

    Args:
        n: the number of slots (weights start at 0).
        threads: the CUDA block size, in [1, 1024].

    Raises:
        ValueError: ``n < 1`` or ``threads`` out of range.
        ImportError: numba-cuda is not installed.
    """

    KIND = "generic"  # checkpoints store its leaves only; a load rebuilds the levels from them

    def __init__(self, n: int, threads: int = 256, *, _fill: bool = True):
        cp = _cuda_kernels()
        n = int(n)
        if n < 1:
            raise ValueError(f"a priority index needs at least one slot, got {n}")
        if not 1 <= threads <= cp.MAX_THREADS:
            raise ValueError(f"threads must be in [1, {cp.MAX_THREADS}], got {threads}")
        cuda = cuda_module()
        self.n = n
        self.threads = int(threads)
        n1, n2 = tree_kernels.level_sizes(n)
        sizes = dict(leaves=n, l0_sum=tree_kernels.line_count(n), l1_sum=n1, l1_min=n1, l2_sum=n2, l2_min=n2,
                     prefix=n2 + 1)
        self.tree = Tree(**{name: cuda.device_array(sizes[name], np.float64) for name in TREE_FIELDS})
        self.__dict__.update(self.tree._asdict())  # index.leaves, ...: the same arrays, never rebound
        self._scalar = cuda.device_array(2, np.float64)  # the smallest positive weight, the total
        self._figures = {}  # total and smallest positive weight, read from the device once after each change
        self._drawn = None  # (slots, their weights) of the last draw_to_host, until the next change
        self._draw_buffer = cuda.device_array(0, np.uint8)  # draw_to_host's slots and weights, one allocation
        if _fill:  # an empty index: weights 0, minima inf
            for name, array in zip(TREE_FIELDS, self.tree):
                cp.fill(array, math.inf if name.endswith("_min") else 0.0, self.threads)

    @classmethod
    def from_host(cls, index: Any, threads: int = 256) -> "DevicePriorityIndex":
        """A device copy of a CPU :class:`PriorityIndex` (or anything with its seven arrays).

        Args:
            index: an object with the arrays named in ``TREE_FIELDS``.
            threads: the CUDA block size.

        Returns:
            A new device index holding the same structure. O(n) over the bus.
        """
        self = cls(len(index.leaves), threads, _fill=False)
        for name in TREE_FIELDS:
            getattr(self.tree, name).copy_to_device(np.ascontiguousarray(getattr(index, name), np.float64))
        return self

    def to_host(self) -> dict[str, np.ndarray]:
        """The seven arrays, copied to host numpy arrays (for checks). O(n) over the bus."""
        return {name: array.copy_to_host() for name, array in zip(TREE_FIELDS, self.tree)}

    def __len__(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        """Bytes of the structure's device arrays (about 9.3 a slot). O(1)."""
        return sum(int(a.nbytes) for a in self.tree)

    @property
    def total(self) -> float:
        """Sum of all weights. Read with :attr:`min_positive` at the first read of either after a change
        (:meth:`set`, :meth:`rebuild`, :meth:`restore`) and kept until the next (a sample reads both, the total
        several times): see :meth:`_read_figures`."""
        if not self._figures:
            self._read_figures()
        return self._figures["total"]

    @property
    def min_positive(self) -> float:
        """Smallest positive weight (inf if none); read and kept with :attr:`total`."""
        if not self._figures:
            self._read_figures()
        return self._figures["min"]

    def _read_figures(self) -> None:
        """The smallest positive weight and the total, into ``_figures``: one single-block reduction over
        ``n / 4096`` entries, the total copied beside its result on the device, then one 16-byte copy to the
        host."""
        last = self.tree.prefix.shape[0] - 1
        _cuda_kernels().smallest(self.tree.l2_min, self._scalar[0:1], self.threads)
        self._scalar[1:2].copy_to_device(self.tree.prefix[last:last + 1])
        smallest, total = self._scalar.copy_to_host()
        self._figures = {"min": float(smallest), "total": float(total)}

    def set(self, slots: Any, values: Any) -> None:
        """Set ``weight[slots[i]] = values[i]`` (the last of duplicate slots wins).

        Args:
            slots: int64 slots in ``[0, n)``, host (checked) or device (not checked).
            values: float64 weights, non-negative and not NaN, host or device.

        Raises:
            ValueError: ``slots`` and ``values`` differ in length.
            IndexError: a host slot is outside ``[0, n)``.

        Cost: six launches, O(B * 64 + n / 4096).
        """
        if len(slots) != len(values):
            raise ValueError(f"{len(slots)} slots but {len(values)} values")
        if len(slots) == 0:
            return
        if not is_device_array(slots):
            s = np.asarray(slots, np.int64)
            if s.min() < 0 or s.max() >= self.n:
                raise IndexError(f"slots must be in [0, {self.n}), got [{s.min()}, {s.max()}]")
        self._changed()
        _cuda_kernels().set_leaves(self.tree, as_device(slots, np.int64), as_device(values, np.float64), self.threads)

    def draw(self, uniforms: Any, out: Any = None):
        """Draw one slot per uniform, with replacement: P(slot) = weight / total.

        Args:
            uniforms: float64 numbers in [0, 1), host or device.
            out: a device int64 array of ``len(uniforms)``, or None for a new one.

        Returns:
            A device int64 array of the drawn slots (``out`` when given). The caller
            guarantees a positive total.

        Cost: one launch, one thread per draw, O(log(n / 4096) + 128) reads each.
        """
        u = as_device(uniforms, np.float64)
        out = cuda_module().device_array(u.shape[0], np.int64) if out is None else out
        _cuda_kernels().draw(self.tree, u, out, self.threads)
        return out

    def draw_to_host(self, uniforms: np.ndarray) -> np.ndarray:
        """:meth:`draw` with the slots copied to the host, their weights drawn in the same launch and copied
        with them (one copy), and kept for :meth:`weights_of` until the next change: a sample's draw and the
        weights of what it drew cost one upload, one launch and one download.

        Args:
            uniforms: float64 numbers in [0, 1) (host; uploaded).

        Returns:
            A new host int64 array of the drawn slots. The caller guarantees a positive total.

        Cost: one launch, one thread per draw; ``8 B`` bytes up, ``16 B`` down.
        """
        b = len(uniforms)
        if b == 0:
            return np.zeros(0, np.int64)
        if self._draw_buffer.shape[0] < 16 * b:
            self._draw_buffer = cuda_module().device_array(16 * max(b, 256), np.uint8)
        slots_d = self._draw_buffer[:8 * b].view(np.int64)
        weights_d = self._draw_buffer[8 * b:16 * b].view(np.float64)
        _cuda_kernels().draw(self.tree, as_device(uniforms, np.float64), slots_d, self.threads, weights=weights_d)
        host = self._draw_buffer[:16 * b].copy_to_host()
        slots, weights = host[:8 * b].view(np.int64), host[8 * b:].view(np.float64)
        self._drawn = (slots.copy(), weights)  # (a copy: the caller may change its slots)
        return slots

    def _changed(self) -> None:
        """The weights are about to change: what was read of them (total, smallest, the last draw's weights) is
        let go, to be read again when asked for."""
        self._figures.clear()
        self._drawn = None

    def rebuild(self) -> None:
        """Recompute every level from the leaves, on the device. O(n)."""
        self._changed()
        _cuda_kernels().rebuild(self.tree, self.threads)

    def weights_of(self, slots: Any) -> np.ndarray:
        """The weights of ``slots``, gathered on the device and copied to the host. O(B). When ``slots`` are the
        slots :meth:`draw_to_host` returned last and nothing changed since, the weights it copied with them
        (no device work).

        Args:
            slots: int64 slots in ``[0, n)``, host or device (not checked).

        Returns:
            A host float64 array, one weight per slot.
        """
        b = len(slots)
        if b == 0:
            return np.zeros(0, np.float64)
        drawn = self._drawn
        if drawn is not None and isinstance(slots, np.ndarray) and np.array_equal(slots, drawn[0]):
            return drawn[1].copy()  # the last draw's, and nothing changed since
        out = cuda_module().device_array(b, np.float64)
        _cuda_kernels().take(self.tree.leaves, as_device(slots, np.int64), out, self.threads)
        return out.copy_to_host()

    def host_leaves(self, count: int) -> np.ndarray:
        """The first ``count`` weights copied to the host. O(count) over the bus.

        Args:
            count: how many (at most ``n``).

        Returns:
            A new host float64 array.
        """
        return self.tree.leaves[:count].copy_to_host() if count else np.zeros(0, np.float64)

    # ---- checkpoint state -----------------------------------------------------------------
    def sections(self, count: int) -> list[tuple[str, np.ndarray]]:
        """The arrays a checkpoint stores: ``[("leaves", the first count weights)]``, copied to the host.

        Args:
            count: the slots in use (the store's high-water mark).

        Returns:
            One (name, host float64 array) pair. O(count) over the bus.
        """
        return [("leaves", np.ascontiguousarray(self.host_leaves(count), np.float64))]

    def restore(self, sections: Mapping[str, np.ndarray], count: int) -> None:
        """Load a checkpoint's index state into this new (all-zero) index.

        Copies the level arrays to the device when every one is given with this
        index's lengths and the leaves are as an index holds them (O(n / 8) over the bus),
        else sets the ``count`` leaves (O(count)).

        Args:
            sections: ``"leaves"`` (float32 or float64, ``count`` entries) and optionally the level arrays.
            count: the slots in use.

        Raises:
            ValueError: ``"leaves"`` is missing or not ``count`` float values (nothing changed).
        """
        leaves = _leaves_section(sections, count)
        self._changed()
        if _levels_fit(sections, self.tree) and count and _leaves_as_held(leaves):
            self.tree.leaves[:count].copy_to_device(np.ascontiguousarray(leaves, np.float64))
            for name in LEVEL_FIELDS:
                getattr(self.tree, name).copy_to_device(np.ascontiguousarray(sections[name], np.float64))
        else:
            self.set(np.arange(count, dtype=np.int64), leaves)

    def __repr__(self) -> str:
        return f"DevicePriorityIndex(n={self.n}, simulator={simulator_enabled()})"

