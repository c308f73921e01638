"""Progress of long local work (checkpoint writes and reads): a tqdm bar on one rank, and the package logger.

``logging.getLogger("gear_mpi")`` (:data:`log`) records what a save or load did
(bytes, seconds) and why a deadline passed; configure it as any logger.

A progress bar counts the bytes this rank writes or reads. Whether one is shown
(:func:`wanted`): the ``progress`` argument when given (False: never; True: shown
even when stderr is not a terminal); else the environment variable
``GEAR_MPI_PROGRESS`` (``0``: never; ``1``: as True); else only when stderr is a
terminal. Only rank 0 shows one. Without tqdm installed (``pip install
gear-mpi[progress]``) there is no bar and no error.

The work reports bytes through :func:`advance`, which feeds the :class:`Meter`
opened around it (one at a time per process); listeners on the meter (the
checkpoint's heartbeats) hear every advance. With no meter open, :func:`advance`
costs one global lookup.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Callable

log = logging.getLogger("gear_mpi")

ENV = "GEAR_MPI_PROGRESS"
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"

_active: "Meter | None" = None


def wanted(progress: bool | None, rank: int) -> bool:
    """Whether this rank shows a progress bar. Local, O(1).

    Args:
        progress: the caller's choice (None: decided by ``GEAR_MPI_PROGRESS`` or by stderr being a terminal).
        rank: this rank (only rank 0 shows a bar).
    Returns:
        True when a bar is to be shown (tqdm may still be missing: then none is).
    Raises:
        TypeError: ``progress`` is not None or a bool.
    """
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None, True or False, got {progress!r}")
    if rank != 0 or progress is False:
        return False
    if progress is True:
        return True
    env = os.environ.get(ENV, "").strip().lower()
    if env in ("0", "false", "no", "off"):
        return False
    if env in ("1", "true", "yes", "on"):
        return True
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Meter:
    """Counts the bytes of one piece of work; shows them as a tqdm bar when asked; a context manager.

    Opening it (``with Meter(...)``) makes it the one :func:`advance` feeds.
    Args:
        total: bytes the work is expected to move (the bar's 100 %).
        desc: the bar's label, e.g. ``"gear_mpi save"``.
        show: whether to draw a bar (see :func:`wanted`).
    """

    def __init__(self, total: int, desc: str, show: bool = False):
        self.total = int(total)
        self.done = 0
        self.desc = desc
        self.listeners: list[Callable[[int], None]] = []
        self.bar = None
        if show:
            try:
                from tqdm import tqdm
            except ImportError:  # tqdm is optional: no bar, no error
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=self.total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                                file=sys.stderr, dynamic_ncols=True, bar_format=BAR_FORMAT)

    def add_total(self, more: int) -> None:
        """Grow the expected total by ``more`` bytes (work found on the way). Local, O(1).

        Args:
            more: bytes to add.
        """
        self.total += int(more)
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes done; tell the listeners (with the running total). Local, O(listeners).

        Args:
            n: bytes just written or read.
        """
        self.done += int(n)
        if self.bar is not None:
            self.bar.update(int(n))
        for listener in self.listeners:
            listener(self.done)

    def __enter__(self) -> "Meter":
        global _active
        self._outer = _active
        _active = self
        return self

    def __exit__(self, *exc) -> None:
        global _active
        _active = self._outer
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def advance(n: int) -> None:
    """Count ``n`` bytes of the work in progress (the innermost open :class:`Meter`; none: nothing). Local, O(1).

    Args:
        n: bytes just written or read.
    """
    if _active is not None:
        _active.advance(n)


def current() -> "Meter | None":
    """Returns the innermost open :class:`Meter` (None when no work is metered). Local, O(1)."""
    return _active


def human(nbytes: float) -> str:
    """``nbytes`` for people: ``"56.0 MB"``, ``"1.10 GB"`` (decimal units). O(1).

    Args:
        nbytes: a byte count.
    Returns:
        The text.
    """
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"
