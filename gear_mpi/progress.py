"""Progress of long collective work (checkpoint saves and loads, dataset loads) on rank 0, and the package logger.

``logging.getLogger("gear_mpi")`` (:data:`log`) records what a save or load did
(bytes, seconds) and why a deadline passed; configure it as any logger.

What is shown. Rank 0 reports the bytes moved by *every* rank of the call, out of
the total of all ranks (agreed before the work starts): a tqdm bar when stderr is a
terminal (and tqdm is installed: ``pip install gear-mpi[progress]``), else one plain
line every :data:`DEFAULT_INTERVAL` seconds (as under ``mpiexec``, whose ranks' stderr
is a pipe), ending with a line of the total and the time. Nothing at all is shown for
work that ends within :data:`DEFAULT_DELAY` seconds. The other ranks' bytes are those
they last reported in their heartbeats (:mod:`gear_mpi.checkpoint.arrival`: at most
every second while they work, and their exact count when they finish), so the figure
lags the truth by at most about a second per rank and ends exact at 100 %.

Whether anything is shown (:func:`wanted`): the ``progress`` argument when given
(False: never; True: yes); else the environment variable ``GEAR_MPI_PROGRESS``
(``0``/``false``/``off``: never); else yes. Only rank 0 shows anything.
``GEAR_MPI_PROGRESS_DELAY`` (seconds, default 2) and ``GEAR_MPI_PROGRESS_INTERVAL``
(seconds between plain lines, default 5) change the timing.

The work reports bytes through :func:`advance`, which feeds the :class:`Meter`
opened around it (one at a time per process); listeners on the meter (the
checkpoint's heartbeats) hear every advance. With no meter open, :func:`advance`
costs one global lookup.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import warnings
from typing import Callable

log = logging.getLogger("gear_mpi")

ENV = "GEAR_MPI_PROGRESS"
DELAY_ENV = "GEAR_MPI_PROGRESS_DELAY"
INTERVAL_ENV = "GEAR_MPI_PROGRESS_INTERVAL"
DEFAULT_DELAY = 2.0  # seconds of work before anything is shown: short work stays silent
DEFAULT_INTERVAL = 5.0  # seconds between two plain lines (stderr not a terminal)
BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"

_active: "Meter | None" = None


def wanted(progress: bool | None, rank: int) -> bool:
    """Whether this rank reports progress (after :data:`DEFAULT_DELAY` s of work). Local, O(1).

    Args:
        progress: the caller's choice (None: yes, unless ``GEAR_MPI_PROGRESS=0``).
        rank: this rank (only rank 0 reports).
    Returns:
        True when rank 0 is to report progress.
    Raises:
        TypeError: ``progress`` is not None or a bool.
    """
    if progress is not None and not isinstance(progress, bool):
        raise TypeError(f"progress must be None, True or False, got {progress!r}")
    if rank != 0 or progress is False:
        return False
    if progress is True:
        return True
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _seconds(name: str, default: float) -> float:
    """The number of seconds in environment variable ``name`` (``default`` when unset; warns when not >= 0)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0:
        warnings.warn(f"{name}={raw!r} is not a number of seconds >= 0; using {default:g}", stacklevel=3)
        return default
    return value


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):
        return False


class Meter:
    """Counts the bytes of one piece of work, this rank's and the other ranks' reports; shows them when asked.

    A context manager: opening it (``with Meter(...)``) makes it the one :func:`advance`
    feeds. With ``show``, the display starts once the work has lasted ``GEAR_MPI_PROGRESS_DELAY``
    seconds (a tqdm bar on a terminal, else plain lines; see the module docstring); a work
    that ends well makes the total what was moved (100 %).

    Args:
        total: bytes the work is expected to move, over all ranks (the 100 %).
        desc: the label, e.g. ``"gear_mpi save"``.
        show: whether to report on stderr (see :func:`wanted`).
        ranks: ranks taking part (named in the plain lines when more than one).
    Cost: without ``show``, O(listeners) per advance; with it, a clock read more (and a bar
    update or a line at most every ``GEAR_MPI_PROGRESS_INTERVAL`` s).
    """

    def __init__(self, total: int, desc: str, show: bool = False, ranks: int = 1):
        self.total = int(total)
        self.done = 0  # this rank's bytes
        self.peers = 0  # the other ranks' bytes, as last reported (Meter.report_peers)
        self.desc = desc
        self.ranks = int(ranks)
        self.listeners: list[Callable[[int], None]] = []
        self.show = bool(show)
        self.bar = None
        self.lines = 0  # plain lines written
        self.began = time.monotonic()
        self.showing = False  # the display has started (the delay passed)
        if self.show:
            self.delay = _seconds(DELAY_ENV, DEFAULT_DELAY)
            self.interval = _seconds(INTERVAL_ENV, DEFAULT_INTERVAL)
            self.terminal = _stderr_is_terminal()
            self._next = self.began + self.delay

    @property
    def moved(self) -> int:
        """Bytes moved by every rank as far as this rank knows (its own plus the peers' reports)."""
        return self.done + self.peers

    def add_total(self, more: int) -> None:
        """Grow the expected total by ``more`` bytes (work found on the way). Local, O(1).

        Args:
            more: bytes to add (over all ranks).
        """
        self.total += int(more)
        self._tick()

    def advance(self, n: int) -> None:
        """Count ``n`` more bytes done here; tell the listeners (with this rank's running count). Local, O(listeners).

        Args:
            n: bytes just written or read.
        """
        self.done += int(n)
        for listener in self.listeners:
            listener(self.done)
        if self.show:
            self._tick()

    def report_peers(self, moved: int) -> None:
        """Set the bytes the other ranks have reported moving (their sum). Local, O(1).

        Args:
            moved: their latest total.
        """
        self.peers = int(moved)
        if self.show:
            self._tick()

    # ---- the display ----------------------------------------------------------------------
    def _tick(self) -> None:
        if not self.show:
            return
        now = time.monotonic()
        if now < self._next:
            return
        if not self.showing:
            self.showing = True
            if self.terminal:
                self.bar = self._open_bar()
        if self.bar is not None:
            self.bar.total = max(self.total, self.moved)
            self.bar.update(self.moved - self.bar.n)  # tqdm limits its own redraws
            self._next = now
        else:
            self._write(self._line(now))
            self._next = now + self.interval

    def _open_bar(self):
        try:
            from tqdm import tqdm
        except ImportError:  # tqdm is optional: plain lines instead
            return None
        desc = self.desc if self.ranks == 1 else f"{self.desc} ({self.ranks} ranks)"
        return tqdm(total=max(self.total, self.moved), initial=self.moved, desc=desc, unit="B", unit_scale=True,
                    unit_divisor=1024, file=sys.stderr, dynamic_ncols=True, bar_format=BAR_FORMAT)

    def _scope(self) -> str:
        return f" over {self.ranks} ranks" if self.ranks > 1 else ""

    def _line(self, now: float) -> str:
        moved, total = self.moved, max(self.total, self.moved)
        pct = 100.0 * moved / total if total else 100.0
        elapsed = now - self.began
        return (f"{self.desc}: {pct:3.0f}% | {human(moved)} of {human(total)}{self._scope()} | {elapsed:.0f} s, "
                f"{human(moved / max(elapsed, 1e-9))}/s")

    def _write(self, text: str) -> None:
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        self.lines += 1

    def _end(self, ok: bool) -> None:
        if ok:
            self.total = self.moved  # what was moved is the total: the display ends at 100 %
        if not self.showing:
            return
        elapsed = time.monotonic() - self.began
        if self.bar is not None:
            if ok:
                self.bar.total = self.total
                self.bar.update(self.moved - self.bar.n)
            self.bar.close()
            self.bar = None
        elif ok:
            self._write(f"{self.desc}: 100% | {human(self.total)}{self._scope()} in {elapsed:.1f} s, "
                        f"{human(self.total / max(elapsed, 1e-9))}/s")
        else:
            self._write(f"{self.desc}: stopped by an error at {human(self.moved)} of {human(self.total)}"
                        f"{self._scope()} after {elapsed:.1f} s")

    def __enter__(self) -> "Meter":
        global _active
        self._outer = _active
        _active = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _active
        _active = self._outer
        self._end(exc_type is None)


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
