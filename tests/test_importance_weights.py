"""Importance-sampling weights: ``float32(r ** beta)`` for the float32 ratio ``r = min_weight / w``, the float64
power rounded once (``kernels.weights.importance_weights``), bit for bit the C library's ``pow`` rounded to float32,
whichever path makes them: the vectorised quick power with ``pow`` where the rounding is in doubt, serial and on
the threads, the selector's, and the one-call sample's kernel (small batches drawn by one thread, with the copy on
one or two threads; runs of sorted items; the bucket pass). Fixed seeds."""
import numba
import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.kernels import local_sample, priority_draw, weights
from gear_mpi.keys import SLOT_MASK

BETAS = [0.4, 0.6, 0.123456789, 1.7, 3.3, 7.99, 8.0, 11.0, 0.0, 0.5, 1.0, 2.0]


def _ratios(rng):
    return np.concatenate([
        rng.random(300_000),  # the ratios of a typical batch: (0, 1]
        10.0 ** rng.uniform(-45, 0, 100_000),  # down to float32's subnormals: inside and outside the quick range
        10.0 ** rng.uniform(0, 38, 10_000),  # above 1 (a ratio never is; the function is defined there too)
        [0.0, 1.0, 1e-30, 1e-31, 1e-45, 3e-39, np.nextafter(np.float32(1e-30), np.float32(0)), 1e30, np.inf],
    ]).astype(np.float32)


def _reference(ratios, beta):
    """pow (or its shortcuts) of each float32 ratio in float64, rounded to float32."""
    with np.errstate(over="ignore"):  # (ratios above 1 raised past float32's range: inf, as the weights)
        return weights.power_weights(ratios.astype(np.float64), beta).astype(np.float32)


def _differ(got, want):
    return np.flatnonzero(got.view(np.int32) != want.view(np.int32))


@pytest.mark.parametrize("beta", BETAS)
def test_bit_for_bit_pow_rounded_to_float32(beta):
    ratios = _ratios(np.random.default_rng(0))
    want = _reference(ratios, beta)
    got = weights.importance_weights(ratios, beta)
    bad = _differ(got, want)
    assert bad.size == 0, f"beta {beta}: {bad.size} weights differ, first at r = {ratios[bad[0]]!r}"
    # the kernel's form: float32 values in a float64 row, the result in another (a run's sorted scratch)
    out = np.full(ratios.shape[0] + 3, np.nan)
    weights.importance_powers_into(ratios.astype(np.float64), beta, out, 0, ratios.shape[0])
    assert _differ(out[:-3].astype(np.float32), want).size == 0
    assert np.isnan(out[-3:]).all()  # nothing past the range written


def test_quick_power_declines_rarely_and_never_rounds_wrong():
    """On typical ratios the quick power keeps all but about 1 in 10,000 (the margin), and every value it keeps is
    pow's rounding: a margin of 0 (or a wrong rounding check) in _quick_float32_power fails the test above."""
    rng = np.random.default_rng(2)
    ratios = rng.random(1_000_000).astype(np.float32) * 0.99 + 0.01
    quick = np.empty(ratios.shape[0])

    @numba.njit(cache=False)
    def run(x, beta, out):
        for i in range(x.shape[0]):
            out[i] = weights._quick_float32_power(np.float64(x[i]), beta)

    run(ratios, 0.4, quick)
    kept = quick >= 0
    assert kept.mean() > 0.999
    assert _differ(quick[kept].astype(np.float32), _reference(ratios[kept], 0.4)).size == 0


@pytest.mark.parametrize("n", [0, 1, 37, weights.PARALLEL_MIN - 1, weights.PARALLEL_MIN, 3 * weights.PARALLEL_MIN + 5])
def test_serial_on_the_threads_and_in_place(n):
    ratios = np.random.default_rng(n).random(n).astype(np.float32)
    want = _reference(ratios, 0.4)
    assert _differ(weights.importance_weights(ratios, 0.4), want).size == 0
    assert weights.importance_weights(ratios, 0.4).dtype == np.float32
    same = ratios.copy()
    assert weights.importance_weights(same, 0.4, out=same) is same
    assert _differ(same, want).size == 0


def test_the_selector_makes_them():
    rng = np.random.default_rng(3)
    w = rng.random(5000) + 0.05
    wmin = float(w.min())
    for beta in (0.4, 1.0, 0.0, 3.3):
        got = gm.Prioritized(0.6, beta).importance_weights(w, wmin)
        assert got.dtype == np.float32
        assert _differ(got, _reference((wmin / w).astype(np.float32), beta)).size == 0


@pytest.mark.parametrize("b", [1, priority_draw.DRAW_PIPE - 1, 64, 256, priority_draw.DRAW_THREADS_MIN - 1,
                               priority_draw.DRAW_THREADS_MIN, local_sample.SORT_PARALLEL_MIN + 3])
@pytest.mark.parametrize("row_bytes", [4, 4096])
def test_sampled_batches_carry_them(b, row_bytes, threads):
    """The one-call sample's weights, on every path of its kernel (one thread drawing, the copy shared or not; runs
    of sorted items; the bucket pass), are the formula's for the batch's own items: the leaves of its slots, the
    smallest positive leaf, the shard's beta; and each ``sample`` after ``beta`` changes (as SB3's annealing
    does) uses the new one."""
    n = 20_000
    spec = gm.TrajectorySpec({"x": ((row_bytes,), "uint8")}, max_length=1)
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=5)
    rng = np.random.default_rng(5)
    shard.insert_packed({"x": rng.integers(0, 255, (n, row_bytes), dtype=np.uint8)}, np.ones(n, np.int64),
                        rng.random(n) * 10 + 0.01)
    out = None
    for beta in (0.4, 0.9, 0.4):
        shard.selector.beta = beta
        batch = shard.sample(b, 1, out=out)
        out = batch
        keys, _, got, _ = batch.meta_numpy()
        w = shard.index.weights_of(keys & SLOT_MASK)
        want = _reference((shard.index.min_positive / w).astype(np.float32), beta)
        assert _differ(got, want).size == 0, f"B={b}, beta {beta}"
    shard.close()


def test_a_beta_of_any_number_type_keeps_one_kernel():
    """``selector.beta`` set to an int or a numpy float (as a user's annealing may) gives the float's weights
    through the kernel already compiled: no second specialization of the sample kernel (seconds of compiling)."""
    n = 4000
    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    shard = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=6)
    rng = np.random.default_rng(6)
    shard.insert_packed({"x": rng.random(n, dtype=np.float32)}, np.ones(n, np.int64), rng.random(n) + 0.01)
    shard.sample(64, 1)
    compiled = len(local_sample._sample_kernel.signatures)
    for beta in (1, np.float32(0.4), np.float64(0.7), 0.9):
        shard.selector.beta = beta
        keys, _, got, _ = shard.sample(64, 1).meta_numpy()
        w = shard.index.weights_of(keys & SLOT_MASK)
        want = _reference((shard.index.min_positive / w).astype(np.float32), float(beta))
        assert _differ(got, want).size == 0, f"beta {beta!r}"
    assert len(local_sample._sample_kernel.signatures) == compiled
    shard.close()
