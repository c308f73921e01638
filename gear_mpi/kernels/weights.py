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

A priority index keeps each weight rounded to float32 (``priority_tree.leaf_value``), so a batch of index
weights needs ``pow`` only where the rounding is in doubt: :func:`leaf_powers_into` computes ``x ** alpha`` in
a loop the compiler vectorises (a polynomial logarithm and exponential, relative error below ``2 ** -43``),
keeps the float32 value where every number within ``2 ** -38`` of it rounds the same way, and asks ``pow``
for the rest (about 1 in 10,000). The leaves are those of ``leaf_value(_power(x, alpha))``, bit for bit.
:func:`leaf_weights` does it for a whole array (the weights of an insert or a general priority update into a
host index), on the threads from ``PARALLEL_MIN`` values.

The importance-sampling weights of a prioritized sample, ``float32(r ** beta)`` for the float32 ratio ``r =
min_weight / w``, are made the same way (:func:`importance_powers_into`, :func:`importance_weights`): the
float64 power rounded once to float32, in the one-call sample's kernel as in the selector.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from .priority_tree import LEAF_MAX, leaf_value

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


def _chunks(n: int) -> int:
    """How many chunks the threads share ``n`` values in (``n >= PARALLEL_MIN``): at least ``PARALLEL_MIN / 2``
    values each, between 2 and 64 chunks. O(1)."""
    return max(2, min(64, n // (PARALLEL_MIN // 2)))


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
        _power_into(values, float(alpha), out, _chunks(n))
    else:
        _power_serial(values, float(alpha), out)
    return out


@intrinsic
def _bits(typingctx, x):
    """The IEEE-754 bits of a float64 as an int64 (a bit cast: no conversion)."""
    return types.int64(types.float64), lambda context, builder, sig, args: builder.bitcast(args[0], ir.IntType(64))


@intrinsic
def _from_bits(typingctx, b):
    """The float64 whose IEEE-754 bits are the int64 ``b`` (a bit cast)."""
    return types.float64(types.int64), lambda context, builder, sig, args: builder.bitcast(args[0], ir.DoubleType())


_LN2_HI = 6.93147180369123816490e-01  # ln 2 split in two (Cody and Waite): _LN2_HI * k is exact for |k| < 2 ** 11
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.4426950408889634
_SQRT2 = 1.4142135623730951
#: the quick power's margin: its value is kept where both ends of [y (1 - margin), y (1 + margin)] round to the
#: same float32. Its own relative error is below 2 ** -43 on the range it takes (measured over 2.4e7 values, x
#: from 1e-30 to 1e30, alpha from -7.99 to 7.99: 6.6e-14 = 2 ** -43.8 at worst, 2 ** -46 and less for |alpha|
#: <= 1), and ``pow``'s below 2 ** -52, so ``pow``'s result lies inside too; about 1 value in 10,000 is left
#: to ``pow`` (2 * margin * 2 ** 24)
_MARGIN = 2.0 ** -38
_F32_NORMAL_MIN = float(np.finfo(np.float32).tiny)
_QUICK_X_MIN, _QUICK_X_MAX = 1e-30, 1e30  # the quick power's range of x (and |alpha| < _QUICK_ALPHA_MAX)
_QUICK_ALPHA_MAX = 8.0
_LN_SERIES = tuple(1.0 / k for k in range(17, 1, -2))  # 1/17, 1/15, ..., 1/3: artanh's series in s^2, after s
_EXP_SERIES = tuple(1.0 / math.factorial(k) for k in range(11, -1, -1))  # 1/11!, ..., 1/1!, 1/0!


@njit(cache=True, inline="always")
def _horner(x, coefficients):
    """The polynomial with ``coefficients`` (highest power first) at ``x``, by Horner's rule (a constant trip
    count: unrolled, so a loop over it still vectorises)."""
    acc = coefficients[0]
    for c in coefficients[1:]:
        acc = acc * x + c
    return acc


@njit(cache=True, inline="always")
def _quick_power(x, alpha):
    """``x ** alpha`` from a polynomial ``ln`` and ``exp`` (no branch: a loop over it vectorises), relative error
    below ``2 ** -43`` for ``x`` in ``[1e-30, 1e30]`` and ``|alpha| < 8`` (elsewhere meaningless: the callers
    decline those values)."""
    b = _bits(x)
    m = _from_bits((b & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000)  # x = m 2 ** e, m in [1, 2) ...
    big = m > _SQRT2
    e = np.float64(((b >> 52) & 0x7FF) - 1023 + (1 if big else 0))
    m = m * 0.5 if big else m  # ... then m in (sqrt(1/2), sqrt(2)]
    s = (m - 1.0) / (m + 1.0)  # ln m = 2 artanh s = 2 (s + s^3 / 3 + ... + s^17 / 17), s^2 <= 0.0295
    z = s * s
    p = _horner(z, _LN_SERIES)
    t = alpha * (e * _LN2_HI + ((2.0 * s + 2.0 * s * z * p) + e * _LN2_LO))  # alpha ln x
    t = t if t > -700.0 else -700.0  # (outside float32's range anyway: refused below)
    t = t if t < 700.0 else 700.0
    kf = np.floor(t * _INV_LN2 + 0.5)  # exp t = 2 ** k exp r, |r| <= ln(2) / 2
    r = (t - kf * _LN2_HI) - kf * _LN2_LO
    q = _horner(r, _EXP_SERIES)  # Taylor to r^11 / 11!
    return q * _from_bits((np.int64(kf) + 1023) << 52)


@njit(cache=True, inline="always")
def _quick_leaf_power(x, alpha):
    """``leaf_value(x ** alpha)`` from :func:`_quick_power`, or -1.0 where ``pow`` must decide: the float32
    rounding in doubt, ``x`` outside ``[1e-30, 1e30]``, or a result outside float32's normal range
    (``leaf_value``'s clamps). ``|alpha| < 8`` (the caller's check)."""
    y = _quick_power(x, alpha)
    lo = np.float64(np.float32(y * (1.0 - _MARGIN)))
    hi = np.float64(np.float32(y * (1.0 + _MARGIN)))
    ok = (lo == hi) & (lo >= _F32_NORMAL_MIN) & (hi <= LEAF_MAX) & (x >= _QUICK_X_MIN) & (x <= _QUICK_X_MAX)
    return lo if ok else -1.0


# error_model numpy: a division that cannot raise, so the loop vectorises; fastmath "contract" only: each
# multiply-add of the series one fused instruction (the loop 5.4 -> 3.8 ns a value; the same worst error, 2 ** -43.8,
# over 2.4e7 values), nothing reordered. Not for the draws: their sums must stay bit for bit those of draw_one
@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
def leaf_powers_into(values, alpha, out, lo, hi):
    """``out[i] = leaf_value(_power(values[i], alpha))`` for ``i`` in ``lo:hi``: the index weight a priority
    index stores for raw priority ``values[i]``, bit for bit, for a fraction of ``pow``'s cost (see the module:
    a vectorised quick power, then ``pow`` where the float32 rounding is in doubt). ``values`` non-negative; a
    -0.0 is read as +0.0 (as the table stores a priority: ``p + 0.0``), so its leaf is +0.0 whatever ``alpha``.

    Args:
        values: float64 raw priorities; alpha: the exponent (a float); out: float64, at least ``hi`` long.
        lo, hi: the range of entries to compute.
    Cost: O(hi - lo), about 4 ns an entry against 10 for ``pow`` on the reference VM (two passes: the quick
    power, then ``pow`` for the entries it left, about 1 in 10,000); exact throughout for alpha 0, 0.5, 1 and 2
    (``_power``'s shortcuts) and for ``|alpha| >= 8``. Serial, one thread.
    """
    x = values[lo:hi]  # (views counted from 0: a loop from lo vectorises less well, 6.2 against 5.1 ns an entry)
    y = out[lo:hi]
    if alpha == 0.5 or alpha == 2.0 or alpha == 1.0 or alpha == 0.0 or not (abs(alpha) < _QUICK_ALPHA_MAX):
        for i in range(x.shape[0]):
            y[i] = leaf_value(_power(x[i] + 0.0, alpha))
        return
    for i in range(x.shape[0]):
        y[i] = _quick_leaf_power(x[i], alpha)  # (declines +-0.0, x < 1e-30: the pass below reads p + 0.0)
    for i in range(x.shape[0]):
        if y[i] < 0.0:
            y[i] = leaf_value(_power(x[i] + 0.0, alpha))


@njit(cache=True, parallel=True, nogil=True)
def _powers_parallel(values, exponent, out, chunks, leaves):
    """:func:`leaf_powers_into` (``leaves``) or :func:`importance_powers_into` of ``values`` into ``out``, in
    ``chunks`` contiguous chunks shared among the threads."""
    n = values.shape[0]
    for t in prange(chunks):
        lo, hi = t * n // chunks, (t + 1) * n // chunks
        if leaves:
            leaf_powers_into(values, exponent, out, lo, hi)
        else:
            importance_powers_into(values, exponent, out, lo, hi)


def leaf_weights(priorities: np.ndarray, alpha: float, out: np.ndarray | None = None) -> np.ndarray:
    """The index weights a priority index stores for raw priorities: ``leaf_values(power_weights(priorities + 0.0,
    alpha))`` bit for bit (a -0.0 read as +0.0), by :func:`leaf_powers_into` (a vectorised power, ``pow`` only
    where the float32 rounding is in doubt): ``power_weights`` took 15.6 ms of a 77 ms insert of 2**20 prioritized
    items at one thread, this about 4.5 ms.

    Args:
        priorities: float64 values (1-D, contiguous; non-negative).
        alpha: the exponent (a Python float).
        out: a float64 array of the same length to fill, or None for a new one.
    Returns:
        The weights rounded as leaves (``out`` when given). Cost: O(n), one kernel call; parallel (chunks of at
        least ``PARALLEL_MIN / 2``) from ``PARALLEL_MIN`` values.
    """
    values = np.ascontiguousarray(priorities, np.float64)
    n = values.shape[0]
    out = np.empty(n, np.float64) if out is None else out
    if n >= PARALLEL_MIN:
        _powers_parallel(values, float(alpha), out, _chunks(n), True)
    else:
        leaf_powers_into(values, float(alpha), out, 0, n)
    return out


@njit(cache=True, inline="always")
def _quick_float32_power(x, beta):
    """``float32(x ** beta)`` (as a float64) from :func:`_quick_power`, or -1.0 where ``pow`` must decide: the
    float32 rounding in doubt or ``x`` outside ``[1e-30, 1e30]``. ``|beta| < 8`` (the caller's check)."""
    y = _quick_power(x, beta)
    lo = np.float32(y * (1.0 - _MARGIN))
    hi = np.float32(y * (1.0 + _MARGIN))
    ok = (lo == hi) & (x >= _QUICK_X_MIN) & (x <= _QUICK_X_MAX)
    return np.float64(lo) if ok else -1.0


@njit(cache=True, nogil=True, error_model="numpy", fastmath={"contract"})
def importance_powers_into(ratios, beta, out, lo, hi):
    """``out[i] = float32(_power(float64(ratios[i]), beta))`` (stored as float64) for ``i`` in ``lo:hi``: the
    importance weights of :meth:`~gear_mpi.selection.Prioritized.importance_weights` from their ratios
    ``min_weight / w`` (float32 values, in a float32 or float64 array), the float64 power rounded once to float32,
    bit for bit, by :func:`leaf_powers_into`'s method (the quick power, ``pow`` where the rounding is in doubt).

    Args:
        ratios: the ratios (float32 or float64 array of float32 values; non-negative).
        beta: the exponent (a float); out: float64, at least ``hi`` long (may not be ``ratios``).
        lo, hi: the range of entries to compute.
    Cost: O(hi - lo), about 5 ns an entry on the reference VM (numpy's float32 power: about 1, but 1 ulp off for
    12-21 % of ratios there). Serial, one thread.
    """
    x = ratios[lo:hi]
    y = out[lo:hi]
    if beta == 0.5 or beta == 2.0 or beta == 1.0 or beta == 0.0 or not (abs(beta) < _QUICK_ALPHA_MAX):
        for i in range(x.shape[0]):
            y[i] = np.float64(np.float32(_power(np.float64(x[i]), beta)))
        return
    for i in range(x.shape[0]):
        y[i] = _quick_float32_power(np.float64(x[i]), beta)  # (declines 0 and x < 1e-30: pow below)
    for i in range(x.shape[0]):
        if y[i] < 0.0:
            y[i] = np.float64(np.float32(_power(np.float64(x[i]), beta)))


def importance_weights(ratios: np.ndarray, beta: float, out: np.ndarray | None = None) -> np.ndarray:
    """Importance-sampling weights from their ratios: ``float32(r ** beta)`` for each float32 ratio ``r``
    (``min_weight / w``), the power taken in float64 (the C library's ``pow``, with numpy's shortcuts for
    beta 0, 0.5, 1 and 2, as :func:`power_weights`) and rounded once, so every sampling path (the one-call
    sample's kernel, a decentralized owner's, the selector's) gives the same weight, bit for bit, on every
    machine whose ``pow`` is correctly rounded (numpy's own float32 power differs between CPUs, and on the
    reference VM's AVX-512 is 1 ulp off for 12-21 % of ratios).

    Args:
        ratios: the ratios, float32 (1-D, contiguous; non-negative).
        beta: the importance-sampling exponent (a Python float).
        out: a float32 array of the same length to fill (may be ``ratios``), or None for a new one.
    Returns:
        The float32 weights (``out`` when given). Cost: O(n) with one float64 temporary, about 5 ns a value on
        the reference VM; one kernel call, parallel (chunks of at least ``PARALLEL_MIN / 2``) from
        ``PARALLEL_MIN`` values.
    """
    values = np.ascontiguousarray(ratios, np.float32)
    n = values.shape[0]
    powers = np.empty(n, np.float64)
    if n >= PARALLEL_MIN:
        _powers_parallel(values, float(beta), powers, _chunks(n), False)
    else:
        importance_powers_into(values, float(beta), powers, 0, n)
    out = np.empty(n, np.float32) if out is None else out
    out[:] = powers  # (float32 values: exact)
    return out

