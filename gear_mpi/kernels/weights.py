"""Index weights from raw priorities, ``p ** alpha`` (CPU kernel).

A prioritized shard stores ``p ** alpha`` in its priority index for every insert and every
priority update. :func:`power_weights` computes it with the C library's ``pow`` (numba lowers
``x ** alpha`` to it) and numpy's shortcuts for the exponents numpy special-cases (0, 0.5, 1
and 2), shared among the threads from ``PARALLEL_MIN`` values. On CPUs without AVX-512 numpy's
``np.power`` is that same ``pow``, element by element (about 14 ns an element on a 2-core EPYC
VM: 0.9 ms for a W3 update of 65536 priorities); on AVX-512 CPUs numpy >= 2 uses a SIMD ``pow``
that differs from the C library's in the last bit for about 5% of values. So every power of a
priority in gear_mpi goes through :func:`power_weights`, the raw priorities read back from the
index included (:class:`~gear_mpi.storage.table.DerivedPriority`): the same function both ways.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

# From this many values the power is shared among the threads (below, a parallel region costs more than it
# saves when another process holds a core: a scheduler tick).
PARALLEL_MIN = 1 << 14


@njit(cache=True, inline="always")
def _power(x, alpha):
    """``x ** alpha`` as ``np.power(x, alpha)`` with a scalar ``alpha`` computes it (its shortcuts included)."""
    if alpha == 0.5:
        return np.sqrt(x)
    if alpha == 2.0:
        return x * x
    if alpha == 1.0:
        return x
    if alpha == 0.0:
        return 1.0
    return x ** alpha


@njit(cache=True, parallel=True, nogil=True)
def _power_into(values, alpha, out, chunks):
    n = values.shape[0]
    for t in prange(chunks):
        for i in range(t * n // chunks, (t + 1) * n // chunks):
            out[i] = _power(values[i], alpha)


@njit(cache=True, nogil=True)
def _power_serial(values, alpha, out):
    for i in range(values.shape[0]):
        out[i] = _power(values[i], alpha)


def power_weights(priorities: np.ndarray, alpha: float, out: np.ndarray | None = None) -> np.ndarray:
    """``priorities ** alpha``: the C library's ``pow`` element by element, with numpy's shortcuts for alpha
    0, 0.5, 1 and 2 (bit for bit ``np.power`` wherever numpy uses the C library's ``pow``: see the module).

    Args:
        priorities: float64 values (1-D, contiguous; non-negative where a shard calls it).
        alpha: the exponent (a Python float).
        out: a float64 array of the same length to fill, or None for a new one.
    Returns:
        The weights (``out`` when given). Cost: O(n) ``pow`` calls, one kernel call; parallel (chunks of
        at least ``PARALLEL_MIN / 2``) from ``PARALLEL_MIN`` values.
    """
    values = np.ascontiguousarray(priorities, np.float64)
    out = np.empty(values.shape[0], np.float64) if out is None else out
    n = values.shape[0]
    if n >= PARALLEL_MIN:
        _power_into(values, float(alpha), out, max(2, min(64, n // (PARALLEL_MIN // 2))))
    else:
        _power_serial(values, float(alpha), out)
    return out
