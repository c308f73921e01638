"""TrajectorySpec: the columns of a replay and the checks every trajectory must pass."""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Mapping, Sequence

import numpy as np
from numba import njit

from .errors import InvalidPriorityError, InvalidTrajectoryError
from .frames import DERIVED_TYPES, DerivedColumn, derived_from_dict, derived_to_dict, resolve_derived
from .keys import tensor_numpy

ShapeLike = Sequence[int] | int


#: the codecs a :class:`Compressed` column may use (blosc2's names, lower case)
CODECS = ("zstd", "lz4", "lz4hc", "blosclz", "zlib")


#: raw bytes a compressed column's chunk holds by default (``Compressed(chunk=None)``): 84x84 frames sampled
#: as 4-frame stacks decode fewest bytes per transition at 4 frames a chunk (docs/BENCHMARKS.md)
CHUNK_BYTES = 32 << 10


@dataclass(frozen=True)
class Compressed:
    """Declares a column stored compressed: the third element of a column entry,
    ``TrajectorySpec({"pixels": ((84, 84), "uint8", Compressed(level=1))}, max_length=...)``.

    The column's steps are kept in chunks of ``chunk`` consecutive ring steps, each compressed with
    python-blosc2 (byte shuffle, then ``codec``) and checked by a CRC-32 on every read; see
    :mod:`gear_mpi.storage.compressed` and docs/guide/storage.md. This is a declaration only: the codec
    library is imported when a store is built (``pip install gear-mpi[compress]``). O(1).

    Args:
        level: the codec's level, 0 (stored, no compression) to 9.
        codec: one of :data:`CODECS`. The default, ``"lz4"``, is the one that keeps one-step sampling of
            Atari frame stacks at >= 50% of a raw replay's rate (0.65-0.75x on Pong, 326x less memory than
            stacked raw); ``"zstd"`` holds about 1.6x less again (537x) and samples at about 0.4x.
        chunk: steps per chunk (None: about 32 KiB of raw steps, a power of two between 1 and 64 steps:
            4 for 84x84 uint8 frames, the fastest to sample in docs/BENCHMARKS.md).
    Raises:
        ValueError: a level, codec or chunk out of range.
    """

    level: int = 1
    codec: str = "lz4"
    chunk: int | None = None

    def __post_init__(self):
        if isinstance(self.level, bool) or not isinstance(self.level, (int, np.integer)) or not 0 <= self.level <= 9:
            raise ValueError(f"Compressed: level must be an integer in [0, 9], got {self.level!r}")
        if self.codec not in CODECS:
            raise ValueError(f"Compressed: codec must be one of {list(CODECS)}, got {self.codec!r}")
        if self.chunk is not None and (isinstance(self.chunk, bool) or not isinstance(self.chunk, (int, np.integer))
                                       or self.chunk < 1):
            raise ValueError(f"Compressed: chunk must be a positive integer (steps) or None, got {self.chunk!r}")
        object.__setattr__(self, "level", int(self.level))
        object.__setattr__(self, "chunk", None if self.chunk is None else int(self.chunk))

    def steps_per_chunk(self, step_bytes: int, capacity: int) -> int:
        """Steps per chunk for a column of ``step_bytes`` bytes a step in a ring of ``capacity`` steps. O(1)."""
        if self.chunk is not None:
            return max(1, min(self.chunk, capacity))
        k = max(1, min(64, CHUNK_BYTES // max(1, step_bytes)))
        return max(1, min(1 << (k.bit_length() - 1), capacity))  # a power of two

    def to_dict(self) -> dict:
        """``{"level", "codec", "chunk"}``: JSON-able (checkpoints, signatures). O(1)."""
        return {"level": self.level, "codec": self.codec, "chunk": self.chunk}


@dataclass(frozen=True)
class Column:
    """One column of a trajectory spec.

    Args:
        name: the column's name.
        shape: the shape of one step.
        dtype: the numpy dtype of its values.
        compression: a :class:`Compressed` declaration, or None (stored raw).
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    compression: Compressed | None = None

    @cached_property
    def step_bytes(self) -> int:
        """Bytes of one step of this column (computed once: it is on every sample's path). O(1)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


#: what an insert's ``casting`` may be: "safe" (the default: safe casts, plus any integer or float into a float
#: column), "same_kind" (numpy's, plus that), "unsafe" (any numeric into any numeric column, as numpy's
#: assignment casts: what Stable-Baselines3's buffers do)
CASTINGS = ("safe", "same_kind", "unsafe")


def whole_number(value: Any, least: int = 1) -> bool:
    """Whether ``value`` is an integer (Python or numpy, not a bool: ``True`` is no count) of at least ``least``:
    the test behind every size, count and rank argument (``int()`` would take 12.5 as 12). O(1)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer)) and value >= least


#: the largest size or count an argument may give unless its own bound is lower: far inside int64
MAX_COUNT = 2 ** 62


def check_count(value: Any, name: str, least: int = 1, optional: bool = False, most: int = MAX_COUNT) -> int | None:
    """``value`` as an ``int`` when :func:`whole_number` takes it (of at least ``least`` and at most ``most``,
    by default far inside int64); None for None where ``optional``. The check behind size and count arguments
    that once went through ``int()``, which took ``8.5`` and ``'8'`` as 8 and raised its own OverflowError for
    ``inf``. O(1).

    Raises:
        ValueError: anything else, naming ``name`` and the value.
    """
    if value is None and optional:
        return None
    if not (whole_number(value, least) and value <= most):
        raise ValueError(f"{name} must be an integer in [{least}, {most}]{' or None' if optional else ''}, "
                         f"got {value!r}")
    return int(value)


#: values a column's step may hold (2**40: a TiB of bytes at most); its byte counts stay far inside int64
_MAX_STEP_ITEMS = 1 << 40


def _product(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n


def _castable(src: np.dtype, dst: np.dtype, casting: str = "safe") -> bool:
    """Safe casts (or ``casting``'s), plus any integer or float into a float column (RL data is often float64)."""
    if np.can_cast(src, dst, casting=casting):
        return True
    return src.kind in "biuf" and dst.kind == "f"


def check_casting(casting: str) -> str:
    """Returns ``casting`` if it is one of :data:`CASTINGS`. O(1).

    Raises:
        ValueError: anything else.
    """
    if casting not in CASTINGS:
        raise ValueError(f"casting must be one of {list(CASTINGS)}, got {casting!r}")
    return casting


class TrajectorySpec:
    """The columns of a trajectory and the longest trajectory allowed.

    A trajectory of length ``L`` holds, for every column, an array of shape ``(L, *per_step_shape)``.
    A column may instead be *derived* (:mod:`gear_mpi.frames`): ``name -> FrameStack(source, frames, pad)``
    or ``name -> NextStep(of)``; it takes no storage and batches hold it, rebuilt from the stored frames
    (:attr:`derived`; a spec with a NextStep stores each trajectory's final observation as one more step,
    :attr:`tail_steps`).
    Construction: O(columns).
    Args:
        columns: column name -> ``(per_step_shape, dtype)`` (a shape may be an int; numeric dtypes only),
            ``(per_step_shape, dtype, Compressed(...))`` for a column stored compressed, or a
            :class:`~gear_mpi.frames.FrameStack` / :class:`~gear_mpi.frames.NextStep`.
        max_length: the most steps a trajectory may have (a positive integer; with a NextStep column, the
            stored steps: transitions + 1).
    Raises:
        ValueError: an empty mapping, a bad name, shape, dtype or ``max_length``; a derived column over no
            stored column, or a NextStep spec of ``max_length`` 1.
    """

    def __init__(self, columns: Mapping[str, tuple[ShapeLike, Any]], max_length: int):
        if not isinstance(columns, Mapping) or not columns:
            raise ValueError("TrajectorySpec needs a non-empty mapping of column name -> (shape, dtype)")
        if not whole_number(max_length) or max_length > MAX_COUNT:
            raise ValueError(f"max_length must be a positive integer (at most 2**62), got {max_length!r}")
        cols, declared = [], {}
        for name, entry in columns.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"column names must be non-empty strings, got {name!r}")
            if isinstance(entry, DERIVED_TYPES):
                declared[name] = entry
                continue
            try:
                shape, dtype, *rest = entry
            except (TypeError, ValueError):
                raise ValueError(f"column {name!r}: expected (shape, dtype), got {entry!r}") from None
            if len(rest) > 1 or (rest and rest[0] is not None and not isinstance(rest[0], Compressed)):
                raise ValueError(f"column {name!r}: expected (shape, dtype) or (shape, dtype, Compressed(...)), "
                                 f"got {entry!r}")
            compression = rest[0] if rest else None
            dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
            try:
                dims = tuple(dims)
            except TypeError:
                raise ValueError(f"column {name!r}: a shape is an integer or a sequence of them, got {shape!r}") \
                    from None
            if not all(whole_number(d) for d in dims) or _product(dims) >= _MAX_STEP_ITEMS:
                raise ValueError(f"column {name!r}: every dimension must be a positive integer, and a step under "
                                 f"{_MAX_STEP_ITEMS} values, got shape {shape!r}")
            shape = tuple(int(d) for d in dims)
            try:
                dt = np.dtype(dtype)
            except TypeError:
                raise ValueError(f"column {name!r}: unknown dtype {dtype!r}") from None
            if dt.hasobject or dt.kind not in "biufc":
                raise ValueError(f"column {name!r}: dtype {dt} is not a numeric dtype")
            cols.append(Column(name, shape, dt, compression))
        self.columns: tuple[Column, ...] = tuple(cols)
        self.max_length = int(max_length)
        self.names: tuple[str, ...] = tuple(c.name for c in cols)
        self.step_bytes_array = np.array([c.step_bytes for c in cols], np.int64)  # for the gather kernel
        self.step_bytes_array.flags.writeable = False
        if not cols:
            raise ValueError("TrajectorySpec needs at least one stored column (derived columns are made of them)")
        #: the derived columns (:mod:`gear_mpi.frames`), in declaration order; not stored
        self.derived: tuple[DerivedColumn, ...] = resolve_derived(
            declared, {c.name: (c.shape, c.dtype) for c in cols})
        #: steps a trajectory stores after its last transition (1 with a NextStep column, else 0)
        self.tail_steps = max((d.tail for d in self.derived), default=0)
        if self.tail_steps >= self.max_length:
            raise ValueError(f"a spec with a NextStep column stores its final observation as one more step: "
                             f"max_length must be at least 2, got {self.max_length}")
        #: steps before a window's first step that the derived columns read (frame stacks: frames - 1)
        self.context_before = max((d.before for d in self.derived), default=0)
        #: the columns of a batch: the stored ones, then the derived ones
        self.batch_columns: tuple[Column | DerivedColumn, ...] = self.columns + self.derived
        self.batch_names: tuple[str, ...] = tuple(c.name for c in self.batch_columns)
        #: bytes of one step of a batch: every batch column's, plus the mask's byte
        self.batch_step_bytes = sum(c.step_bytes for c in self.batch_columns) + 1

    @property
    def step_bytes(self) -> int:
        """Bytes of one step over all columns. O(columns)."""
        return sum(c.step_bytes for c in self.columns)

    @property
    def min_length(self) -> int:
        """The fewest steps a trajectory may have: 1, or 2 with a NextStep column (a transition and the final
        observation). O(1)."""
        return 1 + self.tail_steps

    def __getitem__(self, name: str) -> Column:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(name)

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TrajectorySpec) and self.columns == other.columns
                and self.max_length == other.max_length and self.derived == other.derived)

    @property
    def compressed(self) -> tuple[str, ...]:
        """The names of the columns stored compressed (:class:`Compressed`). O(columns)."""
        return tuple(c.name for c in self.columns if c.compression is not None)

    def __repr__(self) -> str:
        cols = ", ".join([f"{c.name!r}: ({c.shape}, {c.dtype.name!r}"
                          + (f", {c.compression!r})" if c.compression is not None else ")") for c in self.columns]
                         + [f"{d.name!r}: {d.declaration()!r}" for d in self.derived])
        return f"TrajectorySpec({{{cols}}}, max_length={self.max_length})"

    def to_dict(self) -> dict:
        """A JSON-able description (used by checkpoints and shared-memory attach). O(columns).

        Returns:
            ``{"columns": {name: [shape, dtype string]}, "max_length": int}`` (a compressed column's entry has a
            third element, its :meth:`Compressed.to_dict`), and ``"derived": {name: {"kind": ..., ...}}`` when
            the spec has derived columns.
        """
        d = {"columns": {c.name: [list(c.shape), c.dtype.str]
                         + ([c.compression.to_dict()] if c.compression is not None else []) for c in self.columns},
             "max_length": self.max_length}
        if self.derived:
            d["derived"] = {c.name: derived_to_dict(c) for c in self.derived}
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> "TrajectorySpec":
        """The spec a :meth:`to_dict` describes. O(columns).

        Args:
            d: as :meth:`to_dict` returns it.
        Returns:
            A new TrajectorySpec.
        Raises:
            KeyError, ValueError: a field missing, or a description no spec accepts.
        """
        columns = {k: (tuple(v[0]), v[1]) + ((Compressed(**v[2]),) if len(v) > 2 and v[2] else ())
                   for k, v in d["columns"].items()}
        columns.update({k: derived_from_dict(v) for k, v in d.get("derived", {}).items()})
        return cls(columns, d["max_length"])

    def column_arrays(self, columns: Mapping[str, Any], where: str, rows: str = "length",
                      casting: str = "safe") -> tuple[dict[str, np.ndarray], int]:
        """Each column of ``columns`` as an array checked against the spec, not cast or copied (the checks of
        :meth:`validate` and of packed inserts). O(columns).

        Args:
            columns: column name -> ``[rows, *shape]`` array-like (numpy, torch, lists).
            where: how error messages name the input.
            rows: how error messages name the leading axis.
            casting: which dtypes a column takes (:data:`CASTINGS`; already checked by the caller).
        Returns:
            ``(column name -> array, rows)``.
        Raises:
            InvalidTrajectoryError: not a mapping, a column missing or unknown, a non-numeric or uncastable dtype,
                a wrong shape, or columns with different row counts.
        """
        if not isinstance(columns, Mapping):
            raise InvalidTrajectoryError(f"{where}: expected a mapping of column -> array, got {type(columns).__name__}")
        missing = [c.name for c in self.columns if c.name not in columns]
        if missing:
            raise InvalidTrajectoryError(f"{where}: missing column(s) {missing}; the spec has {list(self.names)}")
        extra = [k for k in columns if k not in self.names]
        if extra:
            derived = [k for k in extra if k in self.batch_names]
            note = f" ({derived} are derived: samples rebuild them from the stored columns)" if derived else ""
            raise InvalidTrajectoryError(f"{where}: unknown column(s) {extra}; the spec stores {list(self.names)}{note}")
        out: dict[str, np.ndarray] = {}
        count = None
        for c in self.columns:
            value = columns[c.name]
            if hasattr(value, "detach") and hasattr(value, "cpu"):
                value = value.detach().cpu().numpy()
            try:
                arr = np.asarray(value)
            except (TypeError, ValueError) as e:  # ragged nested lists; objects numpy cannot read
                raise InvalidTrajectoryError(f"{where}: column {c.name!r} is not an array numpy can read: {e}") \
                    from None
            if arr.dtype.hasobject or arr.dtype.kind not in "biufc":
                raise InvalidTrajectoryError(f"{where}: column {c.name!r} has non-numeric dtype {arr.dtype}")
            if not _castable(arr.dtype, c.dtype, casting):
                raise InvalidTrajectoryError(
                    f"{where}: column {c.name!r} has dtype {arr.dtype}, which cannot be cast safely to {c.dtype}"
                    + (" (casting='unsafe' allows lossy casts)" if casting == "safe" else f" (casting={casting!r})"))
            if arr.ndim != 1 + len(c.shape) or tuple(arr.shape[1:]) != c.shape:
                raise InvalidTrajectoryError(
                    f"{where}: column {c.name!r} has shape {tuple(arr.shape)}; expected ({rows}, *{c.shape})")
            if count is None:
                count = arr.shape[0]
            elif arr.shape[0] != count:
                raise InvalidTrajectoryError(
                    f"{where}: column {c.name!r} has {arr.shape[0]} steps but column {self.columns[0].name!r} has {count}")
            out[c.name] = arr
        return out, int(count)

    def validate(self, trajectory: Mapping[str, Any], where: str = "trajectory",
                 casting: str = "safe") -> tuple[dict[str, np.ndarray], int]:
        """Check one trajectory and convert its columns to the spec's dtypes.

        Cost: O(L) for a dtype cast, O(1) otherwise (no copy when dtypes already match).
        Args:
            trajectory: column name -> ``[L, *shape]`` array (numpy, torch, or anything ``np.asarray`` takes).
            where: how error messages name the trajectory.
            casting: which dtypes a column takes (:data:`CASTINGS`).
        Returns:
            ``(columns, length)``: column name -> C-contiguous array of the column's dtype, and ``L``.
        Raises:
            InvalidTrajectoryError: naming the column and the problem: not a mapping, a column missing or
                unknown, a non-numeric or uncastable dtype, a wrong shape, lengths that differ, or a
                length of 0 or over ``max_length``.
        """
        arrays, length = self.column_arrays(trajectory, where, casting=check_casting(casting))
        out = {name: np.ascontiguousarray(arr, dtype=self[name].dtype) for name, arr in arrays.items()}
        if length == 0:
            raise InvalidTrajectoryError(f"{where}: trajectory has length 0")
        if length < self.min_length:
            raise InvalidTrajectoryError(
                f"{where}: trajectory has length {length}; a spec with a NextStep column stores at least one "
                f"transition and the final observation ({self.min_length} steps)")
        if length > self.max_length:
            raise InvalidTrajectoryError(f"{where}: trajectory has length {length}, longer than max_length={self.max_length}")
        return out, int(length)


FINITE_CHUNK = 1 << 20  # elements check_finite_columns looks at a time (bounds its boolean temporary)


def check_finite_columns(columns: Mapping[str, np.ndarray], where: str, lengths: np.ndarray | None = None) -> None:
    """Refuse NaN and infinite step values: what ``check_finite=True`` of the insert paths and writers does.

    Only float and complex columns are read (other dtypes are always finite); the values are checked
    as given (an insert_packed column cast to a narrower float later is checked before the cast).
    Cost: O(steps * step size), in chunks of :data:`FINITE_CHUNK` elements. Local.
    Args:
        columns: column name -> ``[rows, *shape]`` array.
        where: how the message names what was checked (``"insert"``, ``"trajectory 2"``).
        lengths: the steps of each trajectory when the rows are several trajectories end to end
            (packed); the message then names the trajectory and its step.
    Raises:
        InvalidTrajectoryError: a ValueError naming the column, the first step holding NaN or inf
            (the earliest over all columns) and the value.
    """
    first, name = -1, None
    for col, arr in columns.items():
        row = _first_nonfinite_row(np.asarray(arr), first)
        if row >= 0 and (first < 0 or row < first):
            first, name = row, col
    if first < 0:
        return
    step = np.asarray(columns[name][first]).reshape(-1)
    value = step[~np.isfinite(step)][0]
    at = f"step {first}"
    if lengths is not None:
        ends = np.cumsum(lengths)
        i = int(np.searchsorted(ends, first, side="right"))
        at = f"step {first - int(ends[i] - lengths[i])} of trajectory {i}"
    raise InvalidTrajectoryError(f"{where}: column {name!r} holds {value} at {at} (check_finite=True refuses NaN and "
                                 f"infinite values; nothing was stored)")


def _first_nonfinite_row(arr: np.ndarray, before: int) -> int:
    """The first row of ``arr`` holding a NaN or inf, looking only at rows before ``before`` (-1: all); -1: none."""
    if arr.dtype.kind not in "fc" or arr.size == 0:
        return -1
    rows = arr.shape[0] if before < 0 else min(arr.shape[0], before)
    per_row = max(1, arr.size // max(1, arr.shape[0]))
    step = max(1, FINITE_CHUNK // per_row)
    for a in range(0, rows, step):
        ok = np.isfinite(arr[a:min(rows, a + step)])
        if not ok.all():
            return a + int(np.argmin(ok.reshape(len(ok), -1).all(axis=1)))
    return -1


def validate_priorities(priorities: Any, count: int, what: str = "priorities") -> np.ndarray:
    """Priorities as a float64 array of ``count`` finite, non-negative values. Cost: O(count).

    Args:
        priorities: numbers in any form ``np.asarray`` takes, or a tensor.
        count: how many there must be.
        what: how error messages name them.
    Returns:
        A new float64 array (``-0.0`` read as ``+0.0``).
    Raises:
        InvalidPriorityError: not (real) numbers, not ``count`` of them, or one NaN, infinite or negative.
    """
    if hasattr(priorities, "detach") and hasattr(priorities, "cpu"):
        priorities = tensor_numpy(priorities)
    try:
        arr = np.asarray(priorities)  # (ragged lists: numpy's ValueError, refused below)
        # complex: float64 would drop the imaginary parts, with a ComplexWarning only
        if arr.dtype.kind == "c":
            raise InvalidPriorityError(f"{what} must be real numbers, got complex ones: {priorities!r:.80}")
        # text ("1", b"2") and dates would be converted by float64's parser: refused as the non-numbers they are
        if arr.dtype.kind not in "biuf" and (arr.dtype.kind != "O" or any(
                isinstance(v, (str, bytes, np.str_, np.bytes_)) for v in arr.reshape(-1).tolist())):
            raise TypeError
        arr = arr.astype(np.float64, copy=False).reshape(-1)
    except InvalidPriorityError:  # (complex numbers: their own message)
        raise
    except (TypeError, ValueError):
        raise InvalidPriorityError(f"{what} must be numbers, got {priorities!r:.80}") from None
    if arr.shape[0] != count:
        raise InvalidPriorityError(f"{what}: got {arr.shape[0]} values for {count} items")
    out = np.empty(count, np.float64)
    i = _copy_checked(arr, out)
    if i >= 0:
        if not np.isfinite(arr[i]):
            raise InvalidPriorityError(f"{what}[{i}] is {arr[i]}: priorities must be finite")
        raise InvalidPriorityError(f"{what}[{i}] is {arr[i]}: priorities must be non-negative")
    return out


@njit(cache=True, nogil=True)
def _copy_checked(src, out):
    """``out[:] = src + 0.0`` (-0.0 made +0.0) while checking each value is finite and >= 0;
    returns the index of the first that is not (nothing is promised about ``out`` then), or -1."""
    for i in range(src.shape[0]):
        v = src[i]
        if not (v >= 0.0 and v < np.inf):  # false for NaN too
            return i
        out[i] = v + 0.0
    return -1
