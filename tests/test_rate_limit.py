"""The rate limiters' rule (Reverb's, over counts) and the insert budget's split over ranks. Pure logic."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.feeds import replay_feeds


def test_sample_to_insert_ratio_band_follows_reverb():
    lim = gm.SampleToInsertRatio(samples_per_insert=4.0, min_size_to_sample=10, error_buffer=8.0)
    assert (lim.min_diff, lim.max_diff) == (32.0, 48.0)  # centre 10 * 4 = 40, +-8
    assert not lim.can_sample(inserted=9, sampled=0, size=9, n=1)  # below min size
    assert lim.can_sample(10, 0, 10, 8)  # 40 - 8 = 32 >= 32
    assert not lim.can_sample(10, 0, 10, 9)  # 40 - 9 = 31 < 32
    assert not lim.can_sample(20, 0, 9, 1)  # deletions count: 9 live < 10
    # inserts: free up to min size, then (inserted + n) * spi - sampled <= max_diff
    assert lim.insert_budget(0, 0, 0) == 12  # (48 + 0) / 4 - 0
    assert lim.insert_budget(12, 0, 12) == 0
    assert lim.insert_budget(12, 8, 12) == 2  # (48 + 8) / 4 - 12
    pair = gm.SampleToInsertRatio(2.0, 1, (-5.0, 7.0))
    assert (pair.min_diff, pair.max_diff) == (-5.0, 7.0)


def test_min_size_only_waits_for_items():
    lim = gm.MinSize(3)
    assert not lim.can_sample(2, 0, 2, 1)
    assert lim.can_sample(3, 10 ** 9, 3, 10 ** 6)
    assert math.isinf(lim.insert_budget(10, 0, 10))
    lim.check_call(10 ** 9)


def test_a_call_larger_than_the_band_is_refused():
    lim = gm.SampleToInsertRatio(1.0, 1, 2.0)
    lim.check_call(4)
    with pytest.raises(ValueError, match="can never run in a band of max_diff - min_diff = 4"):
        lim.check_call(5)


@pytest.mark.parametrize("args, text", [((0.0, 1, 1.0), "samples_per_insert"), ((1.0, 0, 1.0), "min_size_to_sample"),
                                        ((1.0, 1, -1.0), "error_buffer"), ((1.0, 1, (3.0, 1.0)), "min_diff <= max_diff"),
                                        ((1.0, 1.5, 1.0), "min_size_to_sample"),
                                        ((1.0, 1, 0), r"error_buffer=0 leaves a band of width 0"),
                                        ((1.0, 1, (2.0, 2.5)), r"band of width 0.5"),
                                        ((8.0, 1, 3.0), r"band of width 6 .*narrower than 2 \* max\(1, "
                                                        r"samples_per_insert\) = 16"),
                                        ((0.5, 1, (0.0, 1.0)), r"band of width 1 .* = 2")])
def test_bad_arguments_are_named(args, text):
    with pytest.raises(ValueError, match=text):
        gm.SampleToInsertRatio(*args)


MIN_SIZE_BAD = r"min_size_to_sample must be an integer in \[1, \d+\], got "  # spec.check_count's message


@pytest.mark.parametrize("args, text", [((None, 1, 10), "samples_per_insert must be a number, got None"),
                                        (("2", 1, 10), "samples_per_insert must be a number, got '2'"),
                                        ((True, 1, 10), "samples_per_insert must be a number, got True"),
                                        ((1.0, None, 10), MIN_SIZE_BAD + "None"),
                                        ((1.0, math.inf, 10), MIN_SIZE_BAD + "inf"),
                                        ((1.0, math.nan, 10), MIN_SIZE_BAD + "nan"),
                                        ((1.0, 5.0, 10), MIN_SIZE_BAD + r"5\.0"),
                                        ((1.0, 1, None), "error_buffer must be a number, got None"),
                                        ((1.0, 1, "5"), "error_buffer must be a number, got '5'"),
                                        ((1.0, 1, (0, "9")), "max_diff must be a number, got '9'")])
def test_arguments_that_are_not_numbers_are_named(args, text):
    """None, text, True, inf and nan gave float()'s or int()'s own TypeError, OverflowError or ValueError (or
    were parsed: "2" samples per insert); now a ValueError naming the argument."""
    with pytest.raises(ValueError, match=text):
        gm.SampleToInsertRatio(*args)
    if text.startswith("min_size_to_sample"):
        with pytest.raises(ValueError, match=text):
            gm.MinSize(args[1])
    assert gm.MinSize(np.int64(3)).min_size_to_sample == 3


def test_a_band_narrower_than_one_item_could_hold_samples_and_inserts_for_ever():
    """Reverb's rule, band >= 2 * max(1, spi): each item moves ``inserted * spi - sampled`` by ``spi``, so in
    ``SampleToInsertRatio(8, 1, 3)`` (band [5, 11]) one item let in, three windows sampled, the next item would
    pass max_diff (writers held) and the next window min_diff (the sample waits): nothing could move again."""
    lim = gm.RateLimiter(8.0, 1, 5.0, 11.0)  # the band that SampleToInsertRatio(8, 1, 3) made (the general one
    assert not lim.can_sample(1, 3, 1, 1) and lim.insert_budget(1, 3, 1) == 0  # takes what it is given)
    gm.SampleToInsertRatio(8.0, 1, 8.0)  # the narrowest band allowed: 16
    gm.SampleToInsertRatio(0.5, 1, (0.0, 2.0))


def test_split_budget_is_fair_then_follows_backlog():
    np.testing.assert_array_equal(replay_feeds.split_budget(10, np.array([0, 0])), [5, 5])
    np.testing.assert_array_equal(replay_feeds.split_budget(10, np.array([100, 0])), [10, 0])
    np.testing.assert_array_equal(replay_feeds.split_budget(10, np.array([3, 100, 1])), [3, 6, 1])
    np.testing.assert_array_equal(replay_feeds.split_budget(7, np.array([1, 1, 1])), [3, 2, 2])
    rng = np.random.default_rng(0)
    for _ in range(200):
        total, backlog = int(rng.integers(0, 50)), rng.integers(0, 20, int(rng.integers(1, 6)))
        shares = replay_feeds.split_budget(total, backlog)
        assert shares.sum() == total and (shares >= 0).all()
        assert (shares >= np.minimum(backlog, total // len(backlog))).all()
    assert np.isinf(replay_feeds.split_budget(math.inf, np.array([1, 2]))).all()

