"""Selection policies: which items a sample takes.

Proportional selectors (:class:`Uniform`, :class:`Prioritized`) give the shard
one weight per slot, which it keeps in a priority index
(:mod:`gear_mpi.selection.priority_index`) and draws from with replacement; P(item) =
weight / total. Ordered selectors (:class:`Fifo`, :class:`Lifo`,
:class:`MaxPriority`, :class:`MinPriority`) return the first ``B`` live items in
their order (cycling when fewer than ``B`` are live); their probability is 1.
"""
from __future__ import annotations

import numpy as np

from ..kernels.priority_tree import leaf_values
from ..kernels.weights import importance_weights, leaf_weights, power_weights


def __getattr__(name: str):
    # PriorityIndex moved to gear_mpi.selection.priority_index; the old import path keeps working, with a warning
    if name == "PriorityIndex":
        import warnings

        from .priority_index import PriorityIndex
        warnings.warn("gear_mpi.selection.selectors.PriorityIndex moved to gear_mpi.selection.priority_index.PriorityIndex",
                      DeprecationWarning, stacklevel=2)
        return PriorityIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class Selector:
    """Base of all selectors. ``proportional`` selectors draw from a PriorityIndex."""

    proportional = False
    uses_importance_weights = False

    def weights(self, priorities: np.ndarray) -> np.ndarray:
        """Index weights for raw priorities (proportional selectors only).

        Args:
            priorities: validated raw priorities (float64, >= 0).

        Returns:
            The float64 weights the priority index stores. O(n).

        Raises:
            NotImplementedError: an ordered selector (it keeps no index).
        """
        raise NotImplementedError

    def leaf_weights(self, priorities: np.ndarray) -> np.ndarray:
        """:meth:`weights` as a host priority index stores them: each rounded to float32
        (:func:`~gear_mpi.kernels.priority_tree.leaf_values`), a priority of -0.0 read as +0.0. O(n).

        Args:
            priorities: validated raw priorities (float64, >= 0).

        Returns:
            float64 weights, one per priority (a new array).

        Raises:
            NotImplementedError: an ordered selector (it keeps no index).
        """
        return leaf_values(self.weights(priorities + 0.0))

    def importance_weights(self, weights: np.ndarray, min_weight: float) -> np.ndarray:
        """Importance-sampling weights for selected items; 1 unless prioritized.

        Args:
            weights: the index weights of the selected items.
            min_weight: the smallest positive weight of everything the draw was made over.

        Returns:
            float32 weights, one per item. O(B).
        """
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
        """Weight 1 for every item. O(n).

        Args:
            priorities: validated raw priorities (ignored but for their count).

        Returns:
            float64 ones, one per priority.
        """
        return np.ones(len(priorities), np.float64)

    def leaf_weights(self, priorities: np.ndarray) -> np.ndarray:
        """:meth:`weights` as a host priority index stores them: ones (a leaf holds 1 exactly); a subclass's own
        weights rounded as the base class rounds them. O(n).

        Args:
            priorities: validated raw priorities (ignored but for their count).

        Returns:
            float64 weights, one per priority (a new array).
        """
        if type(self).weights is not Uniform.weights:
            return super().leaf_weights(priorities)
        return self.weights(priorities)


class Prioritized(Selector):
    """Proportional prioritized replay (Schaul et al., 2016).

    P(i) = p_i**alpha / sum_j p_j**alpha; importance weight
    w_i = (N P(i))**-beta / max_j (N P(j))**-beta = (min_j p_j**alpha / p_i**alpha)**beta,
    the max taken over all live items with positive priority.
    """

    proportional = True
    uses_importance_weights = True

    def __init__(self, alpha: float = 0.6, beta: float = 0.4):
        """
        Args:
            alpha: priority exponent (0: uniform).
            beta: importance-sampling exponent (0: no correction).

        Raises:
            ValueError: ``alpha`` or ``beta`` negative or not finite.
        """
        for name, value in (("alpha", alpha), ("beta", beta)):  # a string, None or complex is not a number either
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
                    or not (np.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        self.alpha = float(alpha)
        self.beta = float(beta)

    def weights(self, priorities: np.ndarray) -> np.ndarray:
        """Weights ``p ** alpha`` (the C library's ``pow``, see :mod:`gear_mpi.kernels.weights`). O(n), one kernel call, shared
        among the threads from ``kernels.weights.PARALLEL_MIN`` priorities (:func:`~gear_mpi.kernels.weights.power_weights`).

        Args:
            priorities: validated raw priorities (float64, >= 0).

        Returns:
            float64 weights, one per priority (a new array).
        """
        if self.alpha == 1.0:
            return priorities.astype(np.float64)
        return power_weights(priorities, self.alpha)

    def leaf_weights(self, priorities: np.ndarray) -> np.ndarray:
        """:meth:`weights` rounded as a host priority index stores them, bit for bit ``leaf_values(weights(p + 0.0))``,
        at about half the cost of ``pow`` (:func:`~gear_mpi.kernels.weights.leaf_weights`). O(n), one kernel
        call, shared among the threads from ``kernels.weights.PARALLEL_MIN`` priorities.

        Args:
            priorities: validated raw priorities (float64, >= 0).

        Returns:
            float64 weights, one per priority (a new array).
        """
        if type(self).weights is not Prioritized.weights:  # a subclass's own weights: rounded by the base class
            return super().leaf_weights(priorities)
        return leaf_weights(priorities, self.alpha)

    def importance_weights(self, weights: np.ndarray, min_weight: float) -> np.ndarray:
        """Importance-sampling weights ``(min_weight / w) ** beta`` (1 for the lightest item): the ratio rounded to
        float32, raised to ``beta`` in float64 and rounded once to float32
        (:func:`~gear_mpi.kernels.weights.importance_weights`), as every sampling path makes them. O(B).

        Args:
            weights: the index weights of the selected items (positive).
            min_weight: the smallest positive weight of everything the draw was made over.

        Returns:
            float32 weights, one per item.
        """
        ratios = (min_weight / weights).astype(np.float32)
        return importance_weights(ratios, self.beta, out=ratios)


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
    """The ``k`` slots of ``live`` with the largest/smallest priority.

    Args:
        live: live slots in insertion order.
        priority: the raw priority of every slot.
        k: how many (at most ``len(live)`` are returned).
        largest: largest first (else smallest first).

    Returns:
        The chosen slots, best first; ties go to the earlier (older) slot. Cost: O(N + k log k).
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
