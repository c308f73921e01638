"""numpy's bit generators drawn from inside a kernel (gear_mpi.kernels.bitgen): the values ``Generator.random``
gives, in the same order, and the generator left where ``Generator.random`` leaves it."""
import numpy as np
import pytest
from numba import njit

from gear_mpi.kernels import bitgen


@njit(cache=False)
def _fill(words, out, lo, hi):
    bitgen.fill_doubles(words, out, lo, hi)


@pytest.mark.parametrize("kind", [np.random.PCG64, np.random.PCG64DXSM, np.random.Philox, np.random.SFC64,
                                  np.random.MT19937])
def test_same_values_and_state_as_generator_random(kind):
    drawn, reference = np.random.Generator(kind(5)), np.random.Generator(kind(5))
    for rng in (drawn, reference):  # a buffered 32-bit half and a float32 draw first: left as they are
        rng.integers(0, 10, 3, dtype=np.int32)
        rng.random(7, np.float32)
    out = np.full(1001, -1.0)
    _fill(bitgen.generator_words(drawn), out, 1, 1000)
    want = reference.random(999)
    np.testing.assert_array_equal(out[1:1000], want)
    assert out[0] == out[1000] == -1.0  # nothing outside [lo, hi)
    assert repr(drawn.bit_generator.state) == repr(reference.bit_generator.state)
    assert drawn.random() == reference.random()
    assert drawn.integers(0, 2**31, dtype=np.int32) == reference.integers(0, 2**31, dtype=np.int32)


def test_words_are_the_generators_own():
    rng = np.random.default_rng(1)
    words = bitgen.generator_words(rng)
    assert words.dtype == np.uint64 and words.shape == (bitgen.WORDS,)
    assert int(words[1]) == rng.bit_generator.ctypes.state_address
