"""A kernel's compiled entry point (gear_mpi.kernels.compiled): the dispatcher's result, found only for the types
it was compiled for, and numba's type fingerprint telling array types apart."""
import numba
import numpy as np
from numba import njit

from gear_mpi.kernels import compiled


def _py_scaled_sum(values, scale, out):
    total = 0.0
    for i in range(values.shape[0]):
        out[i] = values[i] * scale
        total += out[i]
    return total


_scaled_sum = njit(cache=False)(_py_scaled_sum)


def test_entry_point_gives_the_dispatchers_result():
    values, out = np.arange(5.0), np.empty(5)
    fresh = njit(cache=False)(_py_scaled_sum)
    assert compiled.entry_point(fresh, (values, 2.0, out)) is None  # nothing compiled for these types yet
    want = fresh(values, 2.0, out)
    run = compiled.entry_point(fresh, (values, 2.0, out))
    assert run is not None
    again = np.empty(5)
    assert run(values + 1, 3.0, again) == fresh(values + 1, 3.0, np.empty(5)) == 45.0
    np.testing.assert_array_equal(again, (values + 1) * 3)
    assert want == 20.0


def test_no_entry_for_other_types_or_plain_functions():
    values, out = np.arange(5.0), np.empty(5)
    _scaled_sum(values, 2.0, out)
    assert compiled.entry_point(_scaled_sum, (values.astype(np.float32), 2.0, out)) is None  # never compiled
    assert compiled.entry_point(_scaled_sum, (values[::2], 2.0, out)) is None  # another layout
    assert compiled.entry_point(lambda *a: 0, (values, 2.0, out)) is None  # not a dispatcher
    assert compiled.entry_point(_scaled_sum, (values, object(), out)) is None  # nothing numba can type


def test_fingerprints_tell_array_types_apart():
    a = np.ones(8)
    frozen = np.ones(8)
    frozen.flags.writeable = False
    prints = [compiled.type_fingerprint(x) for x in (a, np.ones(8), a[::2], a.astype(np.float32), frozen,
                                                     np.ones((2, 4)))]
    assert prints[0] == prints[1] and prints[0] is not None
    assert len(set(prints[1:])) == 5  # layout, dtype, writability and dimensions each change it


def test_kernel_calls_settle_on_the_entry_point():
    values, out = np.arange(4.0), np.empty(4)
    fresh = njit(cache=False)(_py_scaled_sum)
    calls = compiled.KernelCalls(fresh, _py_scaled_sum)
    assert calls.runs == [fresh, _py_scaled_sum] and calls.found == [False, False]
    for i in (0, 1):
        args = (values, 2.0, out)
        assert calls.runs[i](*args) == 12.0
        calls.settle(i, args)
    assert calls.found == [True, True]
    assert calls.runs[0] is not fresh and not hasattr(calls.runs[0], "overloads")  # the compiled entry point
    assert calls.runs[1] is _py_scaled_sum  # a plain function has none: kept
    assert calls.runs[0](values + 1, 1.0, out) == 10.0
    calls.settle(0, (values.astype(np.float32), 1.0, out))  # settled once: never looked up again
    assert calls.runs[0](values, 1.0, out) == 6.0


def test_an_entry_found_once_is_found_again_without_numbas_typing(monkeypatch):
    """A record made again (another thread, a call with other arguments between) finds its entry point by the
    arguments' type fingerprints, not by numba's typing in Python (about 0.6 ms for a sampling kernel's)."""
    fresh = njit(cache=False)(_py_scaled_sum)
    values, out = np.arange(3.0), np.empty(3)
    fresh(values, 1.0, out)
    run = compiled.entry_point(fresh, (values, 1.0, out))

    typed = []
    monkeypatch.setattr(fresh, "typeof_pyval", lambda value: typed.append(value) or numba.typeof(value))
    assert compiled.entry_point(fresh, (np.ones(7), 2.0, np.empty(7))) is run  # other arrays, the same types
    assert typed == []
    assert compiled.entry_point(fresh, (np.ones(7, np.float32), 2.0, np.empty(7))) is None  # never compiled
    assert len(typed) == 3  # another type: typed (and not found)
