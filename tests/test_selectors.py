"""Selectors on a Shard: empirical distributions against the exact ones (chi-square),
importance weights, the ordered selectors' exact picks, max_times_sampled, and the
distribution of window starts.

Every statistical test uses a fixed seed and requires a chi-square p-value above
SIGNIFICANCE (1e-3): a correct sampler fails one such test with probability 1e-3 for
a random seed, and with these fixed seeds the outcome is deterministic.
"""
from __future__ import annotations

import collections

import math

import numpy as np
import pytest
from scipy import stats

import gear_mpi as gm

SIGNIFICANCE = 1e-3


def chi_square_p(counts: np.ndarray, probabilities: np.ndarray) -> float:
    counts = np.asarray(counts, np.float64)
    probabilities = np.asarray(probabilities, np.float64)
    assert abs(probabilities.sum() - 1) < 1e-9
    expected = probabilities * counts.sum()
    assert expected.min() >= 5, "too few draws per bin for a chi-square test"
    return float(stats.chisquare(counts, expected).pvalue)


def draw_counts(shard: gm.Shard, keys: list[int], draws: int, batch: int = 20_000) -> np.ndarray:
    """How often each key is drawn in ``draws`` single-step samples; no key outside ``keys`` may appear."""
    where = {k: i for i, k in enumerate(keys)}
    counts = np.zeros(len(keys), np.int64)
    done = 0
    while done < draws:
        b = shard.sample(min(batch, draws - done), window=1)
        got = collections.Counter(b.keys.tolist())
        assert set(got) <= set(where), f"sampled keys that are not live: {set(got) - set(where)}"
        for k, c in got.items():
            counts[where[k]] += c
        done += b.batch_size
    return counts


def fill(shard, make_traj, priorities, rng):
    return [shard.insert(make_traj(int(rng.integers(1, 17))), priority=float(p)) for p in priorities]


def live_keys(shard, keys):
    return [k for k in keys if shard.locate(k)[0][0] >= 0]


# ---- proportional selectors ---------------------------------------------------------------

def test_uniform_distribution(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 1000, gm.Uniform(), seed=11)
    rng = np.random.default_rng(0)
    keys = fill(shard, make_traj, rng.uniform(0, 10, 30), rng)  # priorities are ignored
    counts = draw_counts(shard, keys, 60_000)
    assert chi_square_p(counts, np.full(30, 1 / 30)) > SIGNIFICANCE
    b = shard.sample(100, window=3)
    np.testing.assert_allclose(b.probabilities.numpy(), 1 / 30, rtol=1e-12)
    np.testing.assert_array_equal(b.weights.numpy(), 1.0)


def test_uniform_distribution_after_evictions(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 120, gm.Uniform(), seed=12)
    rng = np.random.default_rng(1)
    keys = fill(shard, make_traj, np.ones(40), rng)
    live = live_keys(shard, keys)
    assert 5 < len(live) < 40 and shard.stats()["evicted"] == 40 - len(live)
    counts = draw_counts(shard, live, 30_000)
    assert chi_square_p(counts, np.full(len(live), 1 / len(live))) > SIGNIFICANCE


def held(p, alpha):
    """The index weights of priorities ``p``, as the index holds them (``p ** alpha`` rounded to float32)."""
    from gear_mpi.kernels import power_weights
    from gear_mpi.kernels import leaf_values
    return leaf_values(power_weights(np.asarray(p, np.float64), alpha))


def prioritized_expectation(shard, keys, alpha, beta):
    p = shard.priorities(keys)
    assert not np.isnan(p).any()
    w = held(p, alpha)
    probs = w / w.sum()
    min_w = w[w > 0].min()
    with np.errstate(divide="ignore"):
        iw = (min_w / w) ** beta
    return probs, iw


def check_prioritized(shard, keys, alpha, beta, draws):
    probs, iw = prioritized_expectation(shard, keys, alpha, beta)
    counts = draw_counts(shard, keys, draws)
    zero = probs == 0
    assert (counts[zero] == 0).all(), "an item of priority 0 was sampled"
    assert chi_square_p(counts[~zero], probs[~zero] / probs[~zero].sum()) > SIGNIFICANCE
    b = shard.sample(500, window=2)
    where = {k: i for i, k in enumerate(keys)}
    idx = np.array([where[k] for k in b.keys.tolist()])
    np.testing.assert_allclose(b.probabilities.numpy(), probs[idx], rtol=1e-12)
    np.testing.assert_allclose(b.weights.numpy(), iw[idx].astype(np.float32), rtol=1e-6)
    assert (b.weights.numpy() <= 1.0).all()


@pytest.mark.parametrize("alpha, beta", [(0.6, 0.4), (1.0, 1.0), (0.3, 0.9)])
def test_prioritized_distribution_and_importance_weights(shard_factory, spec, make_traj, alpha, beta):
    shard = shard_factory(spec, 2000, gm.Prioritized(alpha, beta), seed=21)
    rng = np.random.default_rng(2)
    pr = rng.uniform(0.05, 5.0, 25)
    pr[[3, 17]] = 0.0  # never sampled
    pr[8] = 40.0       # one heavy item
    keys = fill(shard, make_traj, pr, rng)
    check_prioritized(shard, keys, alpha, beta, 60_000)


def test_prioritized_after_update_priorities(shard_factory, spec, make_traj):
    alpha, beta = 0.6, 0.4
    shard = shard_factory(spec, 2000, gm.Prioritized(alpha, beta), seed=22)
    rng = np.random.default_rng(3)
    keys = fill(shard, make_traj, rng.uniform(0.1, 2.0, 20), rng)
    changed = keys[::2]
    new = rng.uniform(0.0, 8.0, len(changed))
    new[0] = 0.0
    assert shard.update_priorities(changed, new) == len(changed)
    # read back from the index (p ** alpha rounded to float32): within float32 precision
    # (gear_mpi.storage.table.DerivedPriority)
    np.testing.assert_allclose(shard.priorities(changed), new, rtol=2.0 ** -22 / alpha, atol=0)
    check_prioritized(shard, keys, alpha, beta, 60_000)
    # priorities sampled by a batch can be fed straight back (torch tensors)
    b = shard.sample(64, window=1)
    assert shard.update_priorities(b.keys, b.weights.double() + 0.5) == 64
    check_prioritized(shard, keys, alpha, beta, 40_000)


def test_prioritized_after_evictions(shard_factory, spec, make_traj):
    alpha, beta = 0.7, 0.5
    shard = shard_factory(spec, 150, gm.Prioritized(alpha, beta), seed=23)
    rng = np.random.default_rng(4)
    first = shard.insert(make_traj(10), priority=1e-6)  # the smallest weight, soon evicted
    keys = [first] + fill(shard, make_traj, rng.uniform(0.2, 6.0, 40), rng)
    live = live_keys(shard, keys)
    assert first not in live and 5 < len(live) < 41
    assert shard.min_weight == held(shard.priorities(live), alpha).min()
    assert shard.total_weight == pytest.approx(held(shard.priorities(live), alpha).sum(), rel=1e-12)
    check_prioritized(shard, live, alpha, beta, 40_000)


def test_prioritized_rejects_bad_parameters():
    for bad in (dict(alpha=-0.1), dict(beta=-1.0), dict(alpha=float("nan")), dict(beta=float("inf")),
                dict(beta="x"), dict(alpha=None), dict(alpha=True), dict(alpha=1j)):  # (a string was numpy's TypeError)
        name = next(iter(bad))
        with pytest.raises(ValueError, match=f"^{name} must be a finite number >= 0, got "):
            gm.Prioritized(**bad)
    assert gm.Prioritized(np.float32(0.5), np.int64(1)) == gm.Prioritized(0.5, 1.0)
    assert gm.Prioritized(0.6, 0.4) == gm.Prioritized(0.6, 0.4) != gm.Prioritized(0.6, 0.5)
    assert gm.Uniform() == gm.Uniform() != gm.Fifo()
    assert "alpha=0.6" in repr(gm.Prioritized(0.6, 0.4))


# ---- ordered selectors: exact picks ---------------------------------------------------------

@pytest.fixture
def ten(shard_factory, spec, make_traj):
    """Builds a shard of ``sampler`` holding 10 trajectories with known priorities (with ties)."""
    pr = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]

    def build(sampler, **kwargs):
        shard = shard_factory(spec, 1000, sampler, **kwargs)
        keys = [shard.insert(make_traj(i + 1), priority=p) for i, p in enumerate(pr)]
        return shard, keys, pr
    return build


def test_fifo_exact_and_cycling(ten):
    shard, keys, _ = ten(gm.Fifo())
    for _ in range(2):  # sampling does not consume without max_times_sampled
        assert shard.sample(4, window=2).keys.tolist() == keys[:4]
    assert shard.sample(13, window=2).keys.tolist() == keys + keys[:3]
    assert shard.sample(25, window=2).keys.tolist() == keys + keys + keys[:5]
    b = shard.sample(3, window=2)
    np.testing.assert_array_equal(b.probabilities.numpy(), 1.0)
    np.testing.assert_array_equal(b.weights.numpy(), 1.0)


def test_lifo_exact_and_cycling(ten):
    shard, keys, _ = ten(gm.Lifo())
    newest = keys[::-1]
    assert shard.sample(4, window=2).keys.tolist() == newest[:4]
    assert shard.sample(12, window=2).keys.tolist() == newest + newest[:2]


def test_fifo_and_lifo_after_evictions(shard_factory, spec, make_traj):
    for sampler in (gm.Fifo(), gm.Lifo()):
        shard = shard_factory(spec, 30, sampler)
        keys = [shard.insert(make_traj(n)) for n in (10, 10, 10, 5, 7)]  # the first two are evicted
        live = keys[2:]
        assert live_keys(shard, keys) == live
        want = live if isinstance(sampler, gm.Fifo) else live[::-1]
        assert shard.sample(5, window=1).keys.tolist() == want + want[:2]


def by_priority(keys, pr, largest):
    order = sorted(range(len(keys)), key=lambda i: ((-pr[i] if largest else pr[i]), i))  # ties: oldest first
    return [keys[i] for i in order]


@pytest.mark.parametrize("largest", [True, False])
def test_max_and_min_priority_exact_with_ties_and_cycling(ten, largest):
    shard, keys, pr = ten(gm.MaxPriority() if largest else gm.MinPriority())
    want = by_priority(keys, pr, largest)
    for k in (1, 2, 3, 4, 5, 7, 10):
        assert shard.sample(k, window=2).keys.tolist() == want[:k], k
    assert shard.sample(14, window=2).keys.tolist() == want + want[:4]
    # after an update the order follows the new priorities
    pr2 = list(pr)
    pr2[1], pr2[5] = 100.0, 0.0
    shard.update_priorities([keys[1], keys[5]], [100.0, 0.0])
    want2 = by_priority(keys, pr2, largest)
    assert want2 != want
    assert shard.sample(6, window=2).keys.tolist() == want2[:6]


def test_top_k_after_evictions(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 30, gm.MaxPriority())
    keys = [shard.insert(make_traj(10), priority=p) for p in (50.0, 1.0, 2.0, 3.0, 0.5)]
    # capacity 30: only the last three trajectories are live; the evicted 50.0 must not come back
    assert shard.sample(2, window=1).keys.tolist() == [keys[3], keys[2]]
    assert shard.sample(4, window=1).keys.tolist() == [keys[3], keys[2], keys[4], keys[3]]


# ---- max_times_sampled --------------------------------------------------------------------------

def test_max_times_sampled_removes_items(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 1000, gm.Uniform(), max_times_sampled=3, seed=31)
    keys = [shard.insert(make_traj(n)) for n in range(1, 11)]
    uses = collections.Counter()
    while True:
        try:
            k = shard.sample(1, window=2).keys.tolist()[0]
        except gm.EmptyReplayError:
            break
        assert uses[k] < 3, "a removed item was sampled again"
        uses[k] += 1
        if uses[k] == 3:
            with pytest.raises(gm.StaleKeyError):
                shard.get(k)
            stale = shard.stats()["stale_updates"]
            assert shard.update_priorities([k], [1.0]) == 0
            assert shard.stats()["stale_updates"] == stale + 1
    assert uses == {k: 3 for k in keys}
    st = shard.stats()
    assert st["removed"] == 10 and st["items"] == 0 and st["live_steps"] == 0
    assert st["steps_used"] == 0, "removed trajectories must give their ring steps back"
    assert shard.total_weight == 0.0
    # the shard works as new afterwards
    tr = make_traj(16)
    k = shard.insert(tr)
    assert shard.get(k)["t"].tolist() == tr["t"].tolist()


def test_max_times_sampled_with_fifo(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 1000, gm.Fifo(), max_times_sampled=1)
    keys = [shard.insert(make_traj(4)) for _ in range(7)]
    assert shard.sample(3, window=1).keys.tolist() == keys[:3]
    assert shard.sample(3, window=1).keys.tolist() == keys[3:6]
    assert shard.sample(3, window=1).keys.tolist() == [keys[6]] * 3  # cycling over the one left
    with pytest.raises(gm.EmptyReplayError):
        shard.sample(1, window=1)
    for k in keys:
        with pytest.raises(gm.StaleKeyError):
            shard.get(k)
    assert shard.stats()["removed"] == 7 and shard.stats()["steps_used"] == 0


def test_max_times_sampled_prioritized_never_samples_removed_items(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 1000, gm.Prioritized(1.0, 0.5), max_times_sampled=2, seed=32)
    rng = np.random.default_rng(6)
    keys = fill(shard, make_traj, rng.uniform(0.5, 3.0, 30), rng)
    uses = collections.Counter()
    removed = set()
    for _ in range(10):
        b = shard.sample(4, window=1).keys.tolist()
        assert not removed & set(b), "a removed item was sampled again"
        uses.update(b)
        removed |= {k for k, c in uses.items() if c >= 2}
        assert len(shard) == 30 - len(removed)
        assert shard.total_weight == pytest.approx(shard.priorities(live_keys(shard, keys)).sum(), rel=1e-12)
    assert len(removed) > 5
    assert all(np.isnan(shard.priorities([k])[0]) for k in removed)


def test_removed_items_in_the_middle_keep_their_steps_until_they_reach_the_end(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 40, gm.MaxPriority(), max_times_sampled=1)
    a, b, c = (make_traj(10) for _ in range(3))
    ka, kb, kc = shard.insert(a, 1.0), shard.insert(b, 5.0), shard.insert(c, 2.0)
    assert shard.sample(1, window=1).keys.tolist() == [kb]  # removes b, in the middle of the ring
    st = shard.stats()
    assert st["items"] == 2 and st["live_steps"] == 20 and st["steps_used"] == 30
    assert shard.sample(1, window=1).keys.tolist() == [kc]  # removes c, the newest: c and b are trimmed
    st = shard.stats()
    assert st["items"] == 1 and st["steps_used"] == 10
    d = make_traj(16)
    kd = shard.insert(d, 0.5)
    assert shard.locate(kd)[0][0] == 10  # right after a: the trimmed steps were reused
    for key, tr in ((ka, a), (kd, d)):
        assert shard.get(key)["obs"].tobytes() == tr["obs"].tobytes()


# ---- window starts ----------------------------------------------------------------------------

@pytest.mark.parametrize("length, window, wrap", [(20, 5, False), (16, 16, False), (13, 4, True), (9, 1, False)])
def test_random_window_start_is_uniform(shard_factory, make_spec, make_traj, length, window, wrap):
    shard = shard_factory(make_spec(20), 20, seed=41)
    if wrap:
        shard.insert(make_traj(12))  # the next trajectory starts at step 12 and wraps
    tr = make_traj(length)
    key = shard.insert(tr)
    if wrap:
        start, n = shard.locate(key)
        assert start[0] + n[0] > shard.capacity_steps
    positions = length - window + 1
    draws = 20_000 if positions > 1 else 100
    b = shard.sample(draws, window=window, align="random")
    assert b.keys.tolist() == [key] * draws
    offsets = b["t"].numpy()[:, 0] - tr["t"][0]
    counts = np.bincount(offsets, minlength=positions)
    assert len(counts) == positions, "a window started past the last valid position"
    np.testing.assert_array_equal(b["t"].numpy(), offsets[:, None] + tr["t"][0] + np.arange(window))
    if positions > 1:
        assert chi_square_p(counts, np.full(positions, 1 / positions)) > SIGNIFICANCE
    else:
        assert counts.tolist() == [draws]


def libm_power(values: np.ndarray, alpha: float) -> np.ndarray:
    """The reference: the C library's pow element by element (math.pow), with numpy's shortcuts."""
    if alpha in (0.0, 0.5, 1.0, 2.0):
        return {0.0: np.ones_like(values), 0.5: np.sqrt(values), 1.0: values.copy(), 2.0: values * values}[alpha]
    out = np.empty_like(values)
    for i, v in enumerate(values.tolist()):
        try:
            out[i] = math.pow(v, alpha)
        except OverflowError:
            out[i] = math.inf
    return out


@pytest.mark.parametrize("alpha", [0.0, 0.5, 1.0, 2.0, 0.6, 0.7, 0.25, 1 / 0.6, 3.0])
def test_power_weights_are_the_c_librarys_pow_bit_for_bit(alpha):
    """kernels.weights.power_weights (Prioritized.weights, serial and shared among threads) gives the C
    library's pow bit for bit, numpy's special-cased exponents included, and equals np.power to an ulp
    (numpy's SIMD pow on AVX-512 CPUs may differ from the C library's in the last bit)."""
    from gear_mpi.kernels import PARALLEL_MIN, power_weights
    rng = np.random.default_rng(7)
    p = np.concatenate([rng.uniform(0.0, 10.0, PARALLEL_MIN + 5), [0.0, 1.0, 1e-300, 5e-324, 1e-12, 123456.789]])
    for values in (p, p[:100]):
        want = libm_power(values, alpha)
        assert np.array_equal(power_weights(values, alpha), want)
        assert np.array_equal(gm.Prioritized(alpha, 0.4).weights(values), want)
        out = np.empty_like(values)
        assert power_weights(values, alpha, out) is out and np.array_equal(out, want)
        with np.errstate(over="ignore", under="ignore"):
            np.testing.assert_array_max_ulp(power_weights(values, alpha), np.power(values, alpha), maxulp=1)
