"""Rate limiters: when a sample may run and how far inserts may run ahead, over the whole replay.

The rule is Reverb's (``reverb.rate_limiters``), counted in items: with ``inserted``
items ever inserted, ``sampled`` windows ever sampled and ``size`` items live,

- a sample of ``n`` windows may run when ``size >= min_size_to_sample`` and
  ``inserted * samples_per_insert - sampled - n >= min_diff``;
- ``n`` more items may be inserted when ``size + n <= min_size_to_sample`` or
  ``(inserted + n) * samples_per_insert - sampled <= max_diff``.

Where gear_mpi differs from Reverb, and why:

- **Global, not per table and server.** The counts are sums over every rank's shard;
  they ride in the header that ``Replay.sample`` already allgathers, so the limit holds
  for the replay as a whole at no extra collective on the fast path. A Reverb limiter
  sees one table on one server; sharding a Reverb replay over servers multiplies the
  band by the number of servers.
- **A call is counted whole.** Reverb admits samples one at a time; a gear_mpi sample
  of ``n`` windows (the sum of every rank's batch size) is admitted at once, so the
  band ``max_diff - min_diff`` must hold a whole call: a call larger than the band can
  never run, and is refused with a ValueError on every rank instead of waiting forever.
- **Inserts wait in the writers.** The owner moves staged episodes into its shard only
  within the insert budget (split over the ranks by their backlog), and caps what its
  writers may stage at its share of that budget plus a small slack, so a writer's
  ``end_episode`` waits (the *hold*, :mod:`gear_mpi.feeds.replay_feeds`) instead of a
  server call, and the data waiting in staging -- and its age -- stay bounded. A rank's
  own ``insert``/``insert_many`` calls are counted but never held back.

This module is pure logic over counts (local, O(1) per call); :mod:`gear_mpi.feeds.replay_feeds` applies it.
"""
from __future__ import annotations

import math
import numbers

from ..spec import check_count

__all__ = ["RateLimiter", "MinSize", "SampleToInsertRatio"]


def _real(value, name: str) -> float:
    """``value`` as a float: a Python or numpy real number, not a bool or text (``float()`` would parse "2" and
    take True as 1). O(1). Raises: ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _min_size(value) -> int:
    """``min_size_to_sample`` checked: an integer >= 1 (not 5.0, inf, nan, True or None). O(1)."""
    return check_count(value, "min_size_to_sample")


class RateLimiter:
    """The general limiter (Reverb's ``RateLimiter``): see the module docstring for the rule.

    Args:
        samples_per_insert: windows sampled per item inserted, at the band's centre (> 0).
        min_size_to_sample: live items (over the replay) before any sample runs (>= 1).
        min_diff, max_diff: the band of ``inserted * samples_per_insert - sampled`` (``min_diff <= max_diff``;
            infinities allowed).
    Raises:
        ValueError: an argument out of range.
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, min_diff: float, max_diff: float):
        spi = _real(samples_per_insert, "samples_per_insert")
        if not (spi > 0 and math.isfinite(spi)):
            raise ValueError(f"samples_per_insert must be a positive finite number, got {samples_per_insert!r}")
        min_size = _min_size(min_size_to_sample)  # (inf, nan and None raised int()'s own errors)
        lo, hi = _real(min_diff, "min_diff"), _real(max_diff, "max_diff")
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            raise ValueError(f"need min_diff <= max_diff, got min_diff={min_diff!r}, max_diff={max_diff!r}")
        self.samples_per_insert = spi
        self.min_size_to_sample = min_size
        self.min_diff, self.max_diff = lo, hi

    def can_sample(self, inserted: int, sampled: int, size: int, n: int) -> bool:
        """Whether a call of ``n`` windows may run now. O(1).

        Args:
            inserted, sampled, size: the replay's items inserted, windows sampled, items live.
            n: windows the call asks for (over every rank).
        """
        if size < self.min_size_to_sample:
            return False
        return inserted * self.samples_per_insert - sampled - n >= self.min_diff

    def insert_budget(self, inserted: int, sampled: int, size: int) -> float:
        """How many more items may be inserted now (``inf`` when unbounded). O(1).

        Args:
            inserted, sampled, size: the replay's items inserted, windows sampled, items live.
        Returns:
            A count >= 0 (float, for ``inf``).
        """
        free = max(self.min_size_to_sample - size, 0)
        if math.isinf(self.max_diff):
            return math.inf
        room = math.floor((self.max_diff + sampled) / self.samples_per_insert + 1e-9) - inserted
        return float(max(free, room, 0))

    def check_call(self, n: int) -> None:
        """Refuse a call that no state of the band could ever admit. O(1).

        Args:
            n: windows the call asks for (over every rank).
        Raises:
            ValueError: ``n`` exceeds the band ``max_diff - min_diff``.
        """
        if n > self.max_diff - self.min_diff:
            raise ValueError(f"rate limiter: a sample of {n} windows (all ranks together) can never run in a band "
                             f"of max_diff - min_diff = {self.max_diff - self.min_diff:g}: widen error_buffer to at "
                             f"least half the global batch, or sample fewer windows per call")

    def ratio(self, inserted: int, sampled: int) -> float:
        """Windows sampled per item inserted so far (nan before any insert). O(1)."""
        return sampled / inserted if inserted else math.nan

    def __repr__(self) -> str:
        return (f"RateLimiter(samples_per_insert={self.samples_per_insert!r}, min_size_to_sample="
                f"{self.min_size_to_sample!r}, min_diff={self.min_diff!r}, max_diff={self.max_diff!r})")


class MinSize(RateLimiter):
    """Samples wait until the replay holds ``min_size_to_sample`` items; nothing else is limited.

    Args:
        min_size_to_sample: live items over the whole replay (>= 1).
    Raises:
        ValueError: not an integer >= 1.
    """

    def __init__(self, min_size_to_sample: int):
        super().__init__(1.0, min_size_to_sample, -math.inf, math.inf)

    def __repr__(self) -> str:
        return f"MinSize({self.min_size_to_sample!r})"


class SampleToInsertRatio(RateLimiter):
    """Keep windows sampled per item inserted near ``samples_per_insert`` (Reverb's rule, globally).

    Args:
        samples_per_insert: the target ratio (> 0).
        min_size_to_sample: live items before any sample runs (>= 1).
        error_buffer: a number ``b``: the band is ``[c - b, c + b]`` around
            ``c = min_size_to_sample * samples_per_insert``; or a pair ``(min_diff, max_diff)``.
    Raises:
        ValueError: an argument out of range (a negative buffer, a pair out of order, a band narrower than
            ``2 * max(1, samples_per_insert)``, Reverb's rule: e.g. ``error_buffer=0``, which would refuse every
            sample, or ``SampleToInsertRatio(8, 1, 3)``, whose band of 6 is narrower than one item's 8 windows,
            so that a sample can be refused while its writers are held back: neither would ever move again).
    """

    def __init__(self, samples_per_insert: float, min_size_to_sample: int, error_buffer):
        if isinstance(error_buffer, (tuple, list)):
            if len(error_buffer) != 2:
                raise ValueError(f"error_buffer as a pair must be (min_diff, max_diff), got {error_buffer!r}")
            lo, hi = error_buffer
        else:
            b = _real(error_buffer, "error_buffer")
            if not b >= 0:
                raise ValueError(f"error_buffer must be >= 0, got {error_buffer!r}")
            centre = _min_size(min_size_to_sample) * _real(samples_per_insert, "samples_per_insert")
            lo, hi = centre - b, centre + b
        super().__init__(samples_per_insert, min_size_to_sample, lo, hi)
        least = 2 * max(1.0, self.samples_per_insert)
        if not self.max_diff - self.min_diff >= least:
            # an item moves the diff by samples_per_insert: in a narrower band the writers can be held (the next
            # item would pass max_diff) while a sample waits (one window would pass min_diff), for ever
            raise ValueError(f"error_buffer={error_buffer!r} leaves a band of width {self.max_diff - self.min_diff:g} "
                             f"(max_diff - min_diff), narrower than 2 * max(1, samples_per_insert) = {least:g}: "
                             f"samples and the writers' inserts could both be held for ever (Reverb refuses it too); "
                             f"the band must also hold the global batch (all ranks' windows of one sample), e.g. "
                             f"error_buffer >= max(samples_per_insert, half of it)")
        self.error_buffer = error_buffer

    def __repr__(self) -> str:
        return (f"SampleToInsertRatio(samples_per_insert={self.samples_per_insert!r}, min_size_to_sample="
                f"{self.min_size_to_sample!r}, error_buffer={self.error_buffer!r})")
