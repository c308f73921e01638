"""TrajectorySpec, trajectory validation, priority validation and key packing."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import gear_mpi as gm
from gear_mpi import keys as keyspace
from gear_mpi.spec import validate_priorities


# ---- construction --------------------------------------------------------------------

def test_columns_shapes_dtypes_and_step_bytes(spec):
    assert spec.names == ("t", "obs", "act", "done", "img")
    assert spec["obs"].shape == (3, 2) and spec["obs"].dtype == np.float32
    assert spec["t"].shape == () and spec["done"].dtype == np.bool_
    assert spec["obs"].step_bytes == 24 and spec["act"].step_bytes == 4 and spec["img"].step_bytes == 5
    assert spec.step_bytes == 8 + 24 + 4 + 1 + 5
    assert spec.max_length == 16
    with pytest.raises(KeyError):
        spec["nope"]


def test_int_shape_is_a_one_dim_shape():
    s = gm.TrajectorySpec({"x": (4, "float64")}, max_length=3)
    assert s["x"].shape == (4,)
    assert s.step_bytes == 32


def test_dict_round_trip_and_equality(spec, make_spec):
    again = gm.TrajectorySpec.from_dict(spec.to_dict())
    assert again == spec
    assert again.names == spec.names
    assert make_spec(17) != spec
    other = gm.TrajectorySpec({"t": ((), "int32")}, max_length=16)
    assert other != spec
    assert "obs" in repr(spec) and "max_length=16" in repr(spec)


@pytest.mark.parametrize("columns, max_length, words", [
    ({}, 5, "non-empty"),
    ({"x": ((), "float32")}, 0, "max_length"),
    ({"x": ((), "float32")}, -3, "max_length"),
    ({"x": ((), "float32")}, 2.5, "max_length"),
    ({"x": ((), "float32")}, True, "max_length"),
    ({"": ((), "float32")}, 5, "column names"),
    ({"x": ((0, 3), "float32")}, 5, "positive"),
    ({"x": "float32"}, 5, "expected (shape, dtype)"),
    ({"x": ((), "not_a_dtype")}, 5, "unknown dtype"),
    ({"x": ((), object)}, 5, "not a numeric dtype"),
    ({"x": ((), "U4")}, 5, "not a numeric dtype"),
])
def test_bad_specs_are_refused(columns, max_length, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        gm.TrajectorySpec(columns, max_length=max_length)


# ---- trajectory validation ----------------------------------------------------------------

def test_validate_returns_arrays_of_the_spec_dtypes(spec, make_traj):
    tr = make_traj(5)
    tr["obs"] = tr["obs"].astype(np.float64)            # float64 into float32: allowed
    tr["act"] = tr["act"].astype(np.int8)               # int8 into int16: safe cast
    cols, length = spec.validate(tr)
    assert length == 5
    for c in spec.columns:
        assert cols[c.name].dtype == c.dtype
        assert cols[c.name].shape == (5,) + c.shape
        assert cols[c.name].flags.c_contiguous
    np.testing.assert_array_equal(cols["obs"], tr["obs"].astype(np.float32))
    np.testing.assert_array_equal(cols["act"], tr["act"])


def test_validate_does_not_copy_matching_arrays(spec, make_traj):
    tr = make_traj(4)
    cols, _ = spec.validate(tr)
    assert all(np.shares_memory(cols[k], tr[k]) for k in spec.names)


def test_validate_accepts_torch_tensors(spec, make_traj):
    tr = make_traj(3)
    tr["obs"] = torch.from_numpy(tr["obs"])
    cols, length = spec.validate(tr)
    assert length == 3
    np.testing.assert_array_equal(cols["obs"], tr["obs"].numpy())


def test_integers_into_a_float_column_are_allowed():
    s = gm.TrajectorySpec({"x": ((), "float32")}, max_length=4)
    cols, n = s.validate({"x": np.array([1, 2, 3], np.int64)})
    assert n == 3 and cols["x"].dtype == np.float32
    np.testing.assert_array_equal(cols["x"], [1.0, 2.0, 3.0])


def _changed(make_traj, change):
    tr = make_traj(4)
    change(tr)
    return tr


@pytest.mark.parametrize("change, words", [
    (lambda tr: tr.pop("obs"), "missing column"),
    (lambda tr: tr.update(extra=np.zeros(4)), "unknown column"),
    (lambda tr: tr.update(t=tr["t"].astype(np.float64)), "'t' has dtype float64, which cannot be cast safely to int64"),
    (lambda tr: tr.update(act=tr["act"].astype(np.float32)), "'act' has dtype float32"),
    (lambda tr: tr.update(act=tr["act"].astype(np.int32)), "'act' has dtype int32"),
    (lambda tr: tr.update(done=tr["done"].astype(np.float32)), "'done' has dtype float32"),
    (lambda tr: tr.update(obs=tr["obs"].astype(np.complex64)), "'obs' has dtype complex64"),
    (lambda tr: tr.update(obs=tr["obs"].reshape(4, 2, 3)), r"'obs' has shape \(4, 2, 3\)"),
    (lambda tr: tr.update(obs=tr["obs"][0]), r"'obs' has shape \(3, 2\)"),
    (lambda tr: tr.update(img=np.array(["a"] * 4)), "'img' has non-numeric dtype"),
    (lambda tr: tr.update(img=tr["img"][:3]), "'img' has 3 steps but column 't' has 4"),
])
def test_bad_trajectories_name_the_problem(spec, make_traj, change, words):
    with pytest.raises(gm.InvalidTrajectoryError, match=words):
        spec.validate(_changed(make_traj, change))


def test_length_zero_and_too_long_are_refused(spec, make_traj):
    empty = {k: v[:0] for k, v in make_traj(3).items()}
    with pytest.raises(gm.InvalidTrajectoryError, match="length 0"):
        spec.validate(empty)
    with pytest.raises(gm.InvalidTrajectoryError, match="length 17, longer than max_length=16"):
        spec.validate(make_traj(17))
    spec.validate(make_traj(16))  # the longest allowed passes


def test_a_non_mapping_is_refused(spec):
    with pytest.raises(gm.InvalidTrajectoryError, match="expected a mapping"):
        spec.validate([1, 2, 3])


def test_error_types_are_value_errors():
    assert issubclass(gm.InvalidTrajectoryError, ValueError)
    assert issubclass(gm.InvalidPriorityError, ValueError)
    assert issubclass(gm.InvalidKeyError, ValueError)
    assert issubclass(gm.StaleKeyError, KeyError)
    assert all(issubclass(e, gm.GearError) for e in
               (gm.InvalidTrajectoryError, gm.InvalidPriorityError, gm.InvalidKeyError, gm.StaleKeyError,
                gm.EmptyReplayError))


# ---- priorities ---------------------------------------------------------------------------

def test_validate_priorities_accepts_numbers_arrays_and_tensors():
    np.testing.assert_array_equal(validate_priorities([1, 2.5, 0], 3), [1.0, 2.5, 0.0])
    out = validate_priorities(torch.tensor([0.5, 4.0]), 2)
    assert out.dtype == np.float64
    np.testing.assert_array_equal(out, [0.5, 4.0])
    np.testing.assert_array_equal(validate_priorities(3.0, 1), [3.0])


@pytest.mark.parametrize("values, count, words", [
    ([1.0, np.nan], 2, r"priorities\[1\] is nan: priorities must be finite"),
    ([np.inf], 1, "must be finite"),
    ([-np.inf, 1.0], 2, "must be finite"),
    ([1.0, -0.5], 2, r"priorities\[1\] is -0.5: priorities must be non-negative"),
    ([1.0, 2.0], 3, "got 2 values for 3 items"),
    (["a"], 1, "must be numbers"),
    ("1", 1, "must be numbers"),  # text that float64's parser would read as a number: refused all the same
    (["1", "2"], 2, "must be numbers"),
    (np.array([b"1"]), 1, "must be numbers"),
    (np.array(["1", 2.0], object), 2, "must be numbers"),
    (np.array(["2026-12-05"], "datetime64[D]"), 1, "must be numbers"),
    ([[1.0], [1.0, 2.0]], 2, "must be numbers"),  # ragged: was numpy's "inhomogeneous shape" ValueError
    ([1 + 0j], 1, "must be real numbers, got complex ones"),
])
def test_bad_priorities_name_the_problem(values, count, words):
    with pytest.raises(gm.InvalidPriorityError, match=words):
        validate_priorities(values, count)


# ---- keys ---------------------------------------------------------------------------------

def test_keys_pack_and_unpack():
    rng = np.random.default_rng(0)
    slots = rng.integers(0, keyspace.MAX_SLOTS, 1000)
    gens = rng.integers(0, 1 << 20, 1000)  # generations wrap modulo 2**14
    for tag, rank in [(0, 0), (255, keyspace.MAX_RANKS - 1), (17, 3)]:
        k = keyspace.encode(tag, rank, slots, gens)
        assert k.dtype == np.int64 and (k >= 0).all()
        t, r, g, s = keyspace.decode(k)
        assert (t == tag).all() and (r == rank).all()
        np.testing.assert_array_equal(s, slots)
        np.testing.assert_array_equal(g, gens & keyspace.GEN_MASK)
    assert keyspace.SLOT_BITS + keyspace.GEN_BITS + keyspace.RANK_BITS + keyspace.TAG_BITS == 63


def test_as_key_array():
    np.testing.assert_array_equal(keyspace.as_key_array(5), [5])
    np.testing.assert_array_equal(keyspace.as_key_array(torch.tensor([[1, 2], [3, 4]])), [1, 2, 3, 4])
    assert keyspace.as_key_array([]).dtype == np.int64
    with pytest.raises(TypeError, match="keys must be integers"):
        keyspace.as_key_array([1.5])
