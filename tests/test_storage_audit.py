"""Storage and checkpoint edge states found by the storage audit: the single-shard archive's meta, checked as the
file's fault (``CheckpointError``), not raised as a bare ``KeyError`` or ``ValueError``."""
from __future__ import annotations

import json

import numpy as np
import pytest

import gear_mpi as gm

SPEC = gm.TrajectorySpec({"obs": ((5,), "float32")}, max_length=9)


def _arrays_with(meta_change) -> dict:
    shard = gm.Shard(SPEC, 64, gm.Prioritized())
    for _ in range(5):
        shard.insert({"obs": np.ones((3, 5), np.float32)}, priority=1.0)
    arrays = gm.shard_arrays(shard)
    shard.close()
    meta = json.loads(bytes(arrays["meta"]))
    meta_change(meta)
    arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    return arrays


@pytest.mark.parametrize("field", ["spec", "state", "sampler", "capacity_steps", "max_items"])
def test_a_saved_shard_whose_meta_lacks_a_field_is_not_a_saved_shard(field):
    arrays = _arrays_with(lambda meta: meta.pop(field))
    with pytest.raises(gm.CheckpointError, match=f"not a saved gear_mpi shard: its meta lacks '{field}'"):
        gm.shard_from_arrays(arrays)  # was: KeyError


@pytest.mark.parametrize("field, value", [("capacity_steps", -5), ("capacity_steps", None), ("max_items", "12"),
                                          ("max_times_sampled", 2.5)])
def test_a_saved_shard_with_a_bad_size_in_its_meta_is_refused_naming_it(field, value):
    arrays = _arrays_with(lambda meta: meta.__setitem__(field, value))
    with pytest.raises(gm.CheckpointError, match=f"its meta is invalid: {field}={value!r} is not a valid size"):
        gm.shard_from_arrays(arrays)  # was: ValueError or TypeError from the Shard's constructor


def test_a_sound_archive_still_loads():
    arrays = _arrays_with(lambda meta: None)
    with gm.shard_from_arrays(arrays) as shard:
        assert len(shard) == 5
