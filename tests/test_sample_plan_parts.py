"""Pieces of a decentralized Replay.sample made cheaper in issue 34 (item 6): the count matrix drawn one
requester at a time, and the importance weights written by the requester's gather kernel. Both must give
exactly what they replaced."""
import numpy as np
import pytest

from gear_mpi.distributed import plans
from gear_mpi.kernels import gather


@pytest.mark.parametrize("ranks", [1, 2, 3, plans.ROW_BY_ROW_RANKS, plans.ROW_BY_ROW_RANKS + 1, 8])
def test_multinomial_rows_is_numpys_multinomial_on_the_same_stream(ranks):
    spec_rng = np.random.default_rng(ranks)
    for seed in range(12):
        sizes = spec_rng.integers(0, 300, ranks)
        sizes[spec_rng.integers(0, ranks)] = 0  # a rank asking for nothing
        mass = spec_rng.random(ranks) * 1e3
        if ranks > 1:
            mass[spec_rng.integers(0, ranks)] = 0.0  # an empty shard
        pvals = mass / mass.sum()
        ours, numpys = np.random.default_rng(seed), np.random.default_rng(seed)
        for _ in range(4):
            got, want = plans.multinomial_rows(ours, sizes, pvals), numpys.multinomial(sizes, pvals)
            assert got.dtype == want.dtype and got.shape == (ranks, ranks)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got.sum(1), sizes)
        assert ours.random() == numpys.random()  # the shared stream is left where numpy leaves it


def test_two_owner_rows_are_numpys_multinomial_on_the_same_stream():
    spec_rng = np.random.default_rng(5)
    for seed in range(20):
        sizes = [float(n) for n in spec_rng.integers(0, 300, 2)]  # the head table's floats, as a repeat passes them
        masses = [float(x) for x in spec_rng.random(2) * 1e3]
        if seed % 5 == 0:
            masses[seed % 2] = 0.0  # an empty shard
        mass = sum(masses)
        ours, numpys = np.random.default_rng(seed), np.random.default_rng(seed)
        for _ in range(4):
            got = plans.two_owner_rows(ours, sizes, masses[0], mass)
            want = numpys.multinomial(np.array(sizes, np.int64), np.array(masses) / mass)
            assert [list(r) for r in got] == want.tolist()
        assert ours.random() == numpys.random()


def test_gather_rows_from_owners_writes_the_weights_numpy_would():
    rng = np.random.default_rng(3)
    capacity, window, nb = 64, 8, 37
    ring = rng.integers(0, 256, capacity * 4).astype(np.uint8)
    addrs = np.array([[ring.ctypes.data]], np.int64)
    choices = np.zeros((nb, gather.CHOICE_WIDTH), np.int64)
    choices[:, gather.KEY] = rng.integers(0, 1 << 40, nb)
    choices[:, gather.START] = rng.integers(0, capacity, nb)
    choices[:, gather.VALID] = rng.integers(0, window + 1, nb)
    choices[:, gather.PROBABILITY] = rng.random(nb).view(np.int64)
    # float32 weights as the owner makes them, and float64 values that float32 must round
    w64 = np.concatenate([rng.random(nb // 2).astype(np.float32).astype(np.float64), rng.random(nb - nb // 2)])
    choices[:, gather.WEIGHT] = w64.view(np.int64)
    out = np.zeros(nb * window * 4, np.uint8)
    mask = np.zeros((nb, window), np.bool_)
    keys, lengths, probs = np.empty(nb, np.int64), np.empty(nb, np.int64), np.empty(nb)
    weights = np.full(nb, -1.0, np.float32)
    gather.gather_rows_from_owners(addrs, np.array([4], np.int64), capacity, np.array([True]),
                                   np.array([0, nb], np.int64), choices, np.array([out.ctypes.data], np.int64),
                                   window, mask, keys, lengths, probs, weights)
    want = np.empty(nb, np.float32)
    want[:] = choices[:, gather.WEIGHT].view(np.float64)  # what Replay.sample did before
    np.testing.assert_array_equal(weights, want)
    np.testing.assert_array_equal(keys, choices[:, gather.KEY])
    np.testing.assert_array_equal(probs, choices[:, gather.PROBABILITY].view(np.float64))
