"""Deadlines of save and load on 2 ranks: a slow rank is waited for, an absent one is named, nothing is left clogged.

Run by tests/test_checkpoint.py on 2 ranks (``mpiexec -n 2 python -m pytest
tests/mpi/test_checkpoint_deadline.py`` by hand).

- slow: rank 1's first file write (``files.write_file``, wrapped here) sleeps longer
  than ``timeout`` but less than the byte-scaled deadline (``timeout + bytes /
  rate``, the rate set low through ``GEAR_MPI_CHECKPOINT_RATE``): the save succeeds
  and loads; the same for a slow read in ``load``.
- absent: rank 1's first write sleeps past its deadline: rank 0 raises
  CollectiveTimeoutError within the deadline, naming rank 1 as absent with its byte
  count; rank 1, once awake, raises at once that rank 0 gave up waiting for it.
  Afterwards the communicator is clean: a blocking barrier, ``stats()``, a second
  save and a load all work promptly.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

import gear_mpi as gm
from checkpoint_checks import COMM, RANK, SIZE, SPEC, fill, shared_dir  # noqa: F401
from gear_mpi.checkpoint import arrival, files, shard_files

TIMEOUT = 3.0

pytestmark = pytest.mark.skipif(SIZE != 2, reason="written for 2 ranks")


def slow_first(module, name: str, seconds: float):
    """On rank 1, make the first call of ``module.name`` sleep ``seconds`` first; returns an undo."""
    original = getattr(module, name)
    calls = []

    def slow(*args, **kwargs):
        if not calls:
            time.sleep(seconds)
        calls.append(1)
        return original(*args, **kwargs)
    if RANK == 1:
        setattr(module, name, slow)
    return lambda: setattr(module, name, original)


def rate_for(replay: gm.Replay, extra: float) -> str:
    """A GEAR_MPI_CHECKPOINT_RATE (MB/s) that gives rank 1 ``extra`` seconds beyond the timeout."""
    nbytes = COMM.allgather(shard_files.bytes_to_write(replay.shard))
    return repr(nbytes[1] / extra / 1e6)


def test_slow_save_and_load_succeed(shared_dir, monkeypatch):
    replay = gm.Replay(SPEC, 400, gm.Uniform(), seed=3, timeout=TIMEOUT)
    fill(replay, 30, base=1)
    monkeypatch.setenv(arrival.RATE_ENV, rate_for(replay, extra=12.0))  # deadline: 3 s + 12 s
    path = os.path.join(shared_dir, "slow")
    undo = slow_first(files, "write_file", TIMEOUT + 2.0)
    try:
        t0 = time.monotonic()
        replay.save(path, progress=False)
        took = time.monotonic() - t0
    finally:
        undo()
    assert took > TIMEOUT, took  # rank 0 waited past the plain timeout
    undo = slow_first(shard_files, "restore_rank", TIMEOUT + 2.0)
    try:
        loaded, key_map = gm.Replay.load(path, timeout=TIMEOUT, progress=False)
    finally:
        undo()
    assert np.array_equal(key_map[0], key_map[1])
    assert loaded.stats()["total"]["items"] == replay.stats()["total"]["items"]
    loaded.close()
    replay.close()


def test_absent_rank_is_named_and_the_communicator_stays_usable(shared_dir):
    replay = gm.Replay(SPEC, 400, gm.Uniform(), seed=4, timeout=TIMEOUT)
    fill(replay, 10, base=1)
    mine = shard_files.bytes_to_write(replay.shard)
    path = os.path.join(shared_dir, "absent")
    undo = slow_first(files, "write_file", TIMEOUT + 3.0)
    t0 = time.monotonic()
    try:
        with pytest.raises(gm.CollectiveTimeoutError) as info:
            replay.save(path, progress=False)
    finally:
        undo()
    took = time.monotonic() - t0
    msg = str(info.value)
    if RANK == 0:
        allowed = TIMEOUT + COMM.recv(source=1) / arrival.DEFAULT_RATE
        assert "rank 1 is absent" in msg and f"with {arrival.human(COMM.recv(source=1))} to write" in msg, msg
        assert allowed - 0.5 < took < allowed + 2.0, (took, allowed, msg)
    else:
        COMM.send(mine, dest=0)
        COMM.send(mine, dest=0)
        assert "rank 0 gave up waiting for this rank" in msg and "absent" in msg, msg
        assert took < TIMEOUT + 3.0 + 2.0, took  # at once after waking
    COMM.Barrier()  # nothing of the failed save is pending on the replay's communicator
    t0 = time.monotonic()
    assert replay.stats()["total"]["items"] > 0
    assert time.monotonic() - t0 < TIMEOUT - 0.5  # no wait for a message of the failed save (deadline: TIMEOUT)
    replay.save(path, progress=False)  # a second save works
    loaded, _ = gm.Replay.load(path, timeout=TIMEOUT, progress=False)
    assert loaded.stats()["total"]["items"] == replay.stats()["total"]["items"]
    loaded.close()
    replay.close()
    assert not [n for n in os.listdir(shared_dir) if ".tmp-" in n]
