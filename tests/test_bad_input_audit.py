"""Bad input to a Shard and a one-rank Replay: a clear error naming the problem, and nothing changed.

Cases an audit of the public API found (the rest are in tests/test_property_shard.py, tests/test_small_calls.py
and tests/mpi/test_errors.py): a bad constructor argument (now agreed: the same error on every rank, see
tests/mpi/test_errors.py).
"""
from __future__ import annotations

import pytest

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "a": ((), "int64")}, max_length=5)


@pytest.mark.parametrize("kw,cls,what", [({"mode": "bogus"}, ValueError, "mode must be one of"),
                                          ({"timeout": -1.0}, ValueError, "timeout must be a positive number"),
                                          ({"memory": "nope"}, ValueError, "memory must be"),
                                          ({"spec": {"obs": ((3,), "float32")}}, TypeError,
                                           "spec must be a TrajectorySpec, got dict")])
def test_a_bad_constructor_argument_is_named(kw, cls, what):
    args = {"spec": SPEC, "capacity_steps": 40, "timeout": 20.0, **kw}
    with pytest.raises(cls, match=f"^Replay construction \\(arguments\\): rank 0: {what}"):
        gm.Replay(**args)
