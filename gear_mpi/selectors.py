"""Selection policies and the priority index they draw from.

Proportional selectors (:class:`Uniform`, :class:`Prioritized`) keep one weight
per slot in a :class:`PriorityIndex` and draw with replacement; P(item) =
weight / total. Ordered selectors (:class:`Fifo`, :class:`Lifo`,
:class:`MaxPriority`, :class:`MinPriority`) return the first ``B`` live items in
their order (cycling when fewer than ``B`` are live); their probability is 1.
"""
from __future__ import annotations

import numpy as np

from .kernels import priority_tree as tree


def _aligned_zeros(n: int, fill: float = 0.0) -> np.ndarray:
    """A float64 array of ``n`` entries starting on a 64-byte (cache-line) boundary."""
    raw = np.empty(n + 8, np.float64)
    skip = (-raw.ctypes.data % 64) // 8
    out = raw[skip:skip + n]
    out.fill(fill)
    return out


class PriorityIndex:
    """Per-slot weights in the blocked sum/min structure of :mod:`gear_mpi.kernels.priority_tree`.

    Memory: about 9.3 bytes per slot. ``set``: O(B + n / 4096) (each update recounts
    one cache line of leaves and one of line sums). ``draw``: O(B (log(n / 4096) + 80)),
    two cache misses per draw, parallel.
    """

    def __init__(self, n: int):
        n1, n2 = tree.level_sizes(n)
        self.leaves = _aligned_zeros(n)
        self.l0_sum = _aligned_zeros(tree.line_count(n))
        self.l1_sum = _aligned_zeros(n1)
        self.l1_min = np.full(n1, np.inf)
        self.l2_sum = np.zeros(n2, np.float64)
        self.l2_min = np.full(n2, np.inf)
        self.prefix = np.zeros(n2 + 1, np.float64)
        self._flags1 = np.zeros(n1, np.uint8)
        self._flags2 = np.zeros(n2, np.uint8)

    @property
    def total(self) -> float:
        """Sum of all weights. O(1)."""
        return float(self.prefix[-1])

    @property
    def min_positive(self) -> float:
        """Smallest positive weight (inf if none). O(n / 4096)."""
        return float(self.l2_min.min())

    def set(self, slots: np.ndarray, values: np.ndarray) -> None:
        if len(slots):
            tree.set_leaves(self.leaves, self.l0_sum, self.l1_sum, self.l1_min, self.l2_sum, self.l2_min, self.prefix,
                            self._flags1, self._flags2, np.ascontiguousarray(slots, np.int64),
                            np.ascontiguousarray(values, np.float64))

    def draw(self, uniforms: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty(len(uniforms), np.int64) if out is None else out
        tree.draw(self.leaves, self.l0_sum, self.l1_sum, self.l2_sum, self.prefix, uniforms, out)
        return out

    def rebuild(self) -> None:
        tree.rebuild(self.leaves, self.l0_sum, self.l1_sum, self.l1_min, self.l2_sum, self.l2_min, self.prefix)

    def weights_of(self, slots: np.ndarray) -> np.ndarray:
        """The weights of ``slots`` (host float64 array). O(B)."""
        return self.leaves[slots]

    def host_leaves(self, count: int) -> np.ndarray:
        """The first ``count`` weights as a host array (a view here). O(1)."""
        return self.leaves[:count]


class Selector:
    """Base of all selectors. ``proportional`` selectors draw from a PriorityIndex."""

    proportional = False
    uses_importance_weights = False

    def weights(self, priorities: np.ndarray) -> np.ndarray:
        """Index weights for raw priorities (proportional selectors only)."""
        raise NotImplementedError

    def importance_weights(self, weights: np.ndarray, min_weight: float) -> np.ndarray:
        """Importance-sampling weights for selected items; 1 unless prioritized."""
        return np.ones(len(weights), np.float32)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)


class Uniform(Selector):
    """Every live item equally likely, with replacement: P = 1 / N."""

    proportional = True

    def weights(self, priorities: np.ndarray) -> np.ndarray:
        return np.ones(len(priorities), np.float64)


class Prioritized(Selector):
    """Proportional prioritized replay (Schaul et al., 2016).

    P(i) = p_i**alpha / sum_j p_j**alpha; importance weight
    w_i = (N P(i))**-beta / max_j (N P(j))**-beta = (min_j p_j**alpha / p_i**alpha)**beta,
    the max taken over all live items with positive priority.
    """

    proportional = True
    uses_importance_weights = True

    def __init__(self, alpha: float = 0.6, beta: float = 0.4):
        if not (np.isfinite(alpha) and alpha >= 0):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        if not (np.isfinite(beta) and beta >= 0):
            raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
        self.alpha = float(alpha)
        self.beta = float(beta)

    def weights(self, priorities: np.ndarray) -> np.ndarray:
        return np.power(priorities, self.alpha) if self.alpha != 1.0 else priorities.astype(np.float64)

    def importance_weights(self, weights: np.ndarray, min_weight: float) -> np.ndarray:
        # the ratio in float64, the power in float32 (the weights' type; numpy vectorises it: ~6x faster)
        return np.power((min_weight / weights).astype(np.float32), np.float32(self.beta))


class _Ordered(Selector):
    newest_first = False
    by_priority = 0  # +1 largest first, -1 smallest first, 0 insertion order


class Fifo(_Ordered):
    """The oldest live items first (in insertion order)."""


class Lifo(_Ordered):
    """The newest live items first."""

    newest_first = True


class MaxPriority(_Ordered):
    """The items of highest priority first (ties: oldest first)."""

    by_priority = 1


class MinPriority(_Ordered):
    """The items of lowest priority first (ties: oldest first)."""

    by_priority = -1


def rank_by_priority(live: np.ndarray, priority: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """The ``k`` slots of ``live`` (in insertion order) with the largest/smallest priority.

    Ties go to the earlier (older) slot; returned best first. Cost: O(N + k log k).
    """
    k = min(k, len(live))
    p = priority[live]
    key = -p if largest else p
    if k < len(live):
        thr = np.partition(key, k - 1)[k - 1]
        better = np.flatnonzero(key < thr)
        ties = np.flatnonzero(key == thr)[: k - len(better)]
        pick = np.concatenate([better, ties])
    else:
        pick = np.arange(len(live))
    pick = pick[np.lexsort((pick, key[pick]))]
    return live[pick]
