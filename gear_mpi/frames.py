"""Derived columns: frame stacks and next steps rebuilt at sample time from frames stored once.

A :class:`~gear_mpi.spec.TrajectorySpec` column may be declared *derived* instead of stored:

- :class:`FrameStack` ``(source, frames, pad)``: step ``t`` is the stack of the stored column ``source``'s
  steps ``t - frames + 1 .. t`` (shape ``(frames, *source shape)``, oldest first);
- :class:`NextStep` ``(of)``: step ``t`` is step ``t + 1`` of ``of`` (a stored or a frame-stack column).

Derived columns take no storage: the ring holds each frame once, and a sample rebuilds the derived
columns of its windows from the frames of the same trajectory (:mod:`gear_mpi.kernels.frames`).
A spec with a :class:`NextStep` column stores one more step than it has transitions: a trajectory of
``T`` transitions is inserted as ``T + 1`` steps, the last holding the final observation (the one the
environment returned with ``terminated`` or ``truncated``: never a reset observation) and filler in the
other columns; windows cover the first ``T`` steps only (:attr:`DerivedColumn.tail`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

#: how a frame stack fills the frames before a trajectory's first step: "first" repeats the first frame
#: (gymnasium's FrameStackObservation ``padding_type="reset"``, Dopamine's, cpprb's), "zeros" writes zeros
PADS = ("first", "zeros")


@dataclass(frozen=True)
class FrameStack:
    """Declares a column as the stack of the last ``frames`` steps of the stored column ``source``.

    Args:
        source: a stored column of the same spec (e.g. ``"frame"``, ``((84, 84), "uint8")``).
        frames: the stack's depth (``obs[t] = frame[t - frames + 1 .. t]``, oldest first), a positive integer.
        pad: the frames before the trajectory's first step: ``"first"`` (repeat the first frame, the
            default) or ``"zeros"``.
    Raises:
        ValueError: (when the spec is built) an unknown source, a bad ``frames`` or ``pad``.
    """

    source: str
    frames: int = 4
    pad: str = "first"


@dataclass(frozen=True)
class NextStep:
    """Declares a column as the next step of another column: ``next_obs[t] = obs[t + 1]``.

    The spec then stores a trajectory of ``T`` transitions as ``T + 1`` steps, the last one the true
    final observation (see the module docstring); samples place windows on the first ``T`` steps.

    Args:
        of: a stored column or a :class:`FrameStack` column of the same spec.
    Raises:
        ValueError: (when the spec is built) ``of`` names no column, or another NextStep column.
    """

    of: str


@dataclass(frozen=True)
class DerivedColumn:
    """A derived column as the spec resolved it: what the rebuild kernel needs. O(1) to build.

    Args:
        name: the column's name.
        shape: one step's shape (``(frames, *source shape)`` for a stack).
        dtype: the source's dtype.
        source: the stored column whose steps it is made of.
        frames: steps stacked (1: the source's step itself, no stack axis).
        offset: 0 (a stack of steps up to ``t``) or 1 (a next step: up to ``t + 1``).
        pad: as :data:`PADS`.
        kind: ``"FrameStack"`` or ``"NextStep"``; ``of`` the column a NextStep follows.
    """

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    source: str
    frames: int
    offset: int
    pad: str
    kind: str
    of: str

    @property
    def step_bytes(self) -> int:
        """Bytes of one step of this column in a batch. O(1)."""
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def tail(self) -> int:
        """Steps a trajectory stores after its last transition for this column (1 for a next step). O(1)."""
        return self.offset

    @property
    def before(self) -> int:
        """Steps before a window's first step that this column reads (``frames - 1 - offset``, at least 0). O(1)."""
        return max(0, self.frames - 1 - self.offset)

    def declaration(self):
        """The :class:`FrameStack` or :class:`NextStep` this was resolved from. O(1)."""
        if self.kind == "NextStep":
            return NextStep(self.of)
        return FrameStack(self.source, self.frames, self.pad)


DERIVED_TYPES = (FrameStack, NextStep)


def resolve_derived(declared: Mapping[str, FrameStack | NextStep], stored: Mapping[str, tuple[tuple[int, ...], np.dtype]]
                    ) -> tuple[DerivedColumn, ...]:
    """The derived columns of a spec, checked against its stored columns. O(columns).

    Args:
        declared: column name -> its :class:`FrameStack` or :class:`NextStep`, in spec order.
        stored: stored column name -> ``(shape, dtype)``.
    Returns:
        One :class:`DerivedColumn` per declared column, in order.
    Raises:
        ValueError: naming the column: a source or ``of`` that is not a column of the spec, a NextStep of a
            NextStep, a ``frames`` that is not a positive integer, an unknown ``pad``.
    """
    out: dict[str, DerivedColumn] = {}
    for name, d in declared.items():
        if isinstance(d, FrameStack):
            if not isinstance(d.source, str) or d.source not in stored:
                raise ValueError(f"column {name!r}: FrameStack source {d.source!r} is not a stored column of the "
                                 f"spec (stored: {list(stored)})")
            if isinstance(d.frames, bool) or not isinstance(d.frames, (int, np.integer)) or d.frames < 1:
                raise ValueError(f"column {name!r}: FrameStack frames must be a positive integer, got {d.frames!r}")
            if d.pad not in PADS:
                raise ValueError(f"column {name!r}: FrameStack pad must be one of {list(PADS)}, got {d.pad!r}")
            shape, dtype = stored[d.source]
            out[name] = DerivedColumn(name, (int(d.frames),) + tuple(shape), np.dtype(dtype), d.source,
                                      int(d.frames), 0, d.pad, "FrameStack", "")
    for name, d in declared.items():
        if isinstance(d, NextStep):
            if isinstance(declared.get(d.of), NextStep):
                raise ValueError(f"column {name!r}: NextStep of {d.of!r}, another NextStep column; take the next "
                                 f"step of a stored or FrameStack column")
            if d.of in stored:
                shape, dtype = stored[d.of]
                out[name] = DerivedColumn(name, tuple(shape), np.dtype(dtype), d.of, 1, 1, "first", "NextStep", d.of)
            elif d.of in out:
                base = out[d.of]
                out[name] = DerivedColumn(name, base.shape, base.dtype, base.source, base.frames, 1, base.pad,
                                          "NextStep", d.of)
            else:
                raise ValueError(f"column {name!r}: NextStep of {d.of!r}, which is not a column of the spec")
    return tuple(out[name] for name in declared)


def derived_to_dict(d: DerivedColumn) -> dict:
    """A JSON-able description of a derived column's declaration (for ``TrajectorySpec.to_dict``). O(1)."""
    if d.kind == "NextStep":
        return {"kind": "NextStep", "of": d.of}
    return {"kind": "FrameStack", "source": d.source, "frames": d.frames, "pad": d.pad}


def derived_from_dict(d: Mapping) -> FrameStack | NextStep:
    """The declaration :func:`derived_to_dict` describes. O(1).

    Raises:
        KeyError, ValueError: a field missing or an unknown kind.
    """
    if d["kind"] == "NextStep":
        return NextStep(d["of"])
    if d["kind"] == "FrameStack":
        return FrameStack(d["source"], int(d["frames"]), d["pad"])
    raise ValueError(f"unknown derived column kind {d['kind']!r}")
