"""weights.leaf_powers_into: the float32 leaf of ``p ** alpha`` from a vectorised quick power, bit for bit the
leaf of the C library's ``pow`` (``leaf_value(_power(p, alpha))``), over the values priorities take, the edges
of float32's range, and values built so that the rounding is in doubt (which the quick power must leave to
``pow``). Fixed seeds."""
import numpy as np
import pytest
from numba import njit

from gear_mpi.kernels import priority_tree, weights

LEAF_MAX, LEAF_TINY = priority_tree.LEAF_MAX, priority_tree.LEAF_TINY


@njit(cache=False)
def _quick(values, alpha, out):
    for i in range(values.shape[0]):
        out[i] = weights._quick_leaf_power(values[i], alpha)


def _reference(values, alpha):
    """The leaves the index held before: pow (or its shortcuts) element by element, rounded by leaf_value, of each
    value as the table stores it (p + 0.0: -0.0 read as +0.0)."""
    return priority_tree.leaf_values(weights.power_weights(values + 0.0, alpha))


def _leaves(values, alpha):
    out = np.full(values.shape[0], np.nan)
    weights.leaf_powers_into(values, alpha, out, 0, values.shape[0])
    return out


ALPHAS = [0.6, 0.4, 0.7, 0.9, 0.123456789, 1.5, 3.0, 7.99, -0.5, 8.0, 12.0, 0.0, 0.5, 1.0, 2.0]


def _values(rng):
    return np.concatenate([
        rng.random(200_000) + 0.01,  # TD errors plus an epsilon, as replay sets them
        rng.random(50_000),  # down to 0
        np.exp(rng.uniform(-100, 100, 200_000)),  # 1e-43 .. 1e43: inside and outside the quick range
        np.arange(0, 50_000, dtype=np.float64),  # whole numbers, 0 included
        [0.0, -0.0, 5e-324, 1e-310, 1e-30, 1e30, np.nextafter(1e-30, 0), np.nextafter(1e30, np.inf), 1.0,
         2.0 ** -126, 2.0 ** 127, LEAF_MAX, LEAF_TINY, 1.7976931348623157e308],
    ])


@pytest.mark.parametrize("alpha", ALPHAS)
def test_bit_for_bit_pow_leaves(alpha):
    values = _values(np.random.default_rng(0))
    got = _leaves(values, alpha)
    want = _reference(values, alpha)
    bad = np.flatnonzero(got.view(np.int64) != want.view(np.int64))
    assert bad.size == 0, f"alpha {alpha}: {bad.size} leaves differ, first at p = {values[bad[0]]!r}"


@pytest.mark.parametrize("alpha", [0.6, 0.4, 0.123456789, 3.0, 7.99])
def test_rounding_in_doubt_goes_to_pow(alpha):
    """p = m ** (1 / alpha) for m halfway between two float32 values: p ** alpha lies within a few float64 ulps
    of m, so the float32 rounding is decided by pow's last bits. The quick power must decline nearly all of
    them, and the result must still be pow's leaf (a margin of 0 in _quick_leaf_power fails here)."""
    rng = np.random.default_rng(1)
    f = np.unique(rng.uniform(1e-3, 1e3, 20_000).astype(np.float32)).astype(np.float64)
    halfway = (f + np.nextafter(f.astype(np.float32), np.float32(np.inf)).astype(np.float64)) / 2  # exact in float64
    values = weights.power_weights(halfway, 1.0 / alpha)
    values = values[(values >= 1e-30) & (values <= 1e30)]
    quick = np.empty_like(values)
    _quick(values, alpha, quick)
    assert np.mean(quick < 0) > 0.99  # declined: left to pow
    np.testing.assert_array_equal(_leaves(values, alpha), _reference(values, alpha))


def test_quick_power_declines_rarely_on_typical_priorities():
    """The quick power's point: about 1 value in 10,000 is left to pow (2 * margin * 2 ** 24)."""
    values = np.random.default_rng(2).random(1_000_000) + 0.01
    quick = np.empty_like(values)
    _quick(values, 0.6, quick)
    declined = np.mean(quick < 0)
    assert declined < 1e-3
    kept = quick >= 0
    np.testing.assert_array_equal(quick[kept], _reference(values[kept], 0.6))


def test_only_the_range_is_written():
    values = np.random.default_rng(3).random(1000) + 0.5
    out = np.full(1000, -7.0)
    weights.leaf_powers_into(values, 0.6, out, 100, 900)
    assert np.all(out[:100] == -7.0) and np.all(out[900:] == -7.0)
    np.testing.assert_array_equal(out[100:900], _reference(values[100:900], 0.6))


@pytest.mark.parametrize("alpha", [0.6, 1.0, 0.5, 3.0, 12.0])
@pytest.mark.parametrize("n", [0, 1, 37, weights.PARALLEL_MIN - 1, weights.PARALLEL_MIN, 3 * weights.PARALLEL_MIN + 5])
def test_leaf_weights_serial_and_on_the_threads(alpha, n):
    """weights.leaf_weights (what inserts and general updates of a host index now call): pow's leaves bit for bit,
    on one thread below PARALLEL_MIN values and in chunks on the threads from it, into ``out`` or a new array."""
    values = _values(np.random.default_rng(4))[::-1][:n].copy()  # the edge values first, then a mix
    want = _reference(values, alpha)
    got = weights.leaf_weights(values, alpha)
    np.testing.assert_array_equal(got.view(np.int64), want.view(np.int64))
    out = np.full(n, np.nan)
    assert weights.leaf_weights(values, alpha, out) is out
    np.testing.assert_array_equal(out.view(np.int64), want.view(np.int64))


def test_selectors_leaf_weights_are_their_weights_as_leaves():
    """Selector.leaf_weights: Prioritized's by the quick power, Uniform's ones, a selector of one's own through
    the base class's rounding of its weights (one that subclasses Uniform or Prioritized too); each what a host index stores (leaf_values of weights)."""
    import gear_mpi as gm

    class Thirds(gm.Uniform):
        def weights(self, priorities):
            return np.asarray(priorities, np.float64) / 3.0

    class Roots(gm.Prioritized):
        def weights(self, priorities):
            return np.sqrt(np.asarray(priorities, np.float64)) + 0.1

    values = np.random.default_rng(5).random(70_000) * 100
    for sel in (gm.Prioritized(0.6, 0.4), gm.Prioritized(1.0, 0.4), gm.Uniform(), Thirds(), Roots(0.6, 0.4)):
        want = priority_tree.leaf_values(sel.weights(values))
        np.testing.assert_array_equal(sel.leaf_weights(values).view(np.int64), want.view(np.int64))


@pytest.mark.parametrize("alpha", [0.6, 0.5, 1.0, 2.0, 3.0, 0.0, 12.0])
def test_minus_zero_is_read_as_plus_zero(alpha):
    """A priority of -0.0 gives the leaf of +0.0 (as the table stores p + 0.0) in leaf_powers_into, leaf_weights
    (serial and on the threads) and an insert, whatever the exponent: pow(-0.0, 0.5) and -0.0 ** 1 or 3 are -0.0."""
    import gear_mpi as gm
    n = weights.PARALLEL_MIN + 3
    values = np.random.default_rng(6).random(n)
    values[::7] = -0.0
    want = _reference(values, alpha)
    assert not np.signbit(want).any()
    np.testing.assert_array_equal(_leaves(values, alpha).view(np.int64), want.view(np.int64))
    for m in (5, n):
        np.testing.assert_array_equal(weights.leaf_weights(values[:m], alpha).view(np.int64), want[:m].view(np.int64))
    shard = gm.Shard(gm.TrajectorySpec({"x": ((), "float32")}, max_length=1), n, gm.Prioritized(alpha, 0.4))
    shard.insert_packed({"x": np.zeros(n, np.float32)}, np.ones(n, np.int64), values)
    assert not np.signbit(shard.index.leaves).any()
