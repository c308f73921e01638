"""The key checks of every update (the prefetch thread's included): routing.check_keys and keys.owner_of read
the key fields directly; they must refuse and accept exactly what the fields of keys.decode say."""
from __future__ import annotations

import numpy as np
import pytest

from gear_mpi import keys as keyspace
from gear_mpi.errors import InvalidKeyError
from gear_mpi.keys import owner_of
from gear_mpi.replay import FOLD_RANKS
from gear_mpi.distributed import routing


def test_check_keys_reads_the_fields_as_decode_does():
    rng = np.random.default_rng(0)
    tag, ranks, max_items = 77, 6, 1000
    ok = np.concatenate([keyspace.encode(tag, r, rng.integers(0, max_items, 20), rng.integers(0, 1 << 14, 20))
                         for r in range(ranks)])
    got, owner, counts = routing.check_keys(ok, tag, ranks, max_items)
    assert got.dtype == np.int64 and owner.dtype == np.int64
    np.testing.assert_array_equal(owner, keyspace.decode(ok)[1])
    np.testing.assert_array_equal(counts, np.bincount(keyspace.decode(ok)[1], minlength=ranks))
    got, owner, counts = routing.check_keys(ok[::-2], tag, ranks, max_items)  # a strided view, as a tensor may be
    np.testing.assert_array_equal(owner, keyspace.decode(ok[::-2])[1])
    assert routing.check_keys([], tag, ranks, max_items)[2].tolist() == [0] * ranks
    np.testing.assert_array_equal(owner_of(ok), keyspace.decode(ok)[1])
    bad = [-1, int(np.iinfo(np.int64).min),  # negative: never a key
           int(keyspace.encode(tag + 1, 0, [0], [0])[0]),  # another replay's tag
           int(keyspace.encode(tag, ranks, [0], [0])[0]),  # a rank the replay does not have
           int(keyspace.encode(tag, 0, [max_items], [0])[0])]  # a slot beyond the table
    for k in bad:
        with pytest.raises(InvalidKeyError, match=str(k)):
            routing.check_keys(np.append(ok, k), tag, ranks, max_items)
    assert owner_of(np.array([-1], np.int64))[0] >= FOLD_RANKS  # the fold's padding belongs to no rank of a fold
