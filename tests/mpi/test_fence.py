"""The node fence: an owner's insert after a sample waits until every node peer has published
that it finished reading that sample's windows, and raises CollectiveTimeoutError when one never does.

Needs 2+ ranks on one node (skipped on one); run by tests/test_replay_mpi.py on 3.
Rank 1 plays the slow reader by writing its own reads-done counter in the node's
shared memory (library internals: ``gear_mpi.storage.arenas.reads_done_counter`` and the
replay's sample epoch).
"""
from __future__ import annotations

import time

import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, SPEC, check_windows, fill

pytestmark = pytest.mark.skipif(SIZE < 2, reason="the fence is between node peers: needs 2+ ranks")


def test_insert_waits_for_node_peers_to_finish_reading():
    from gear_mpi.storage import reads_done_counter
    replay = gm.Replay(SPEC, 400, gm.Uniform(), seed=2, timeout=3.0)
    ref = fill(replay, 8, seed=9)
    mine = reads_done_counter(replay.shard.store.arena.buffer)
    batch = replay.sample(6, 4, "head")
    check_windows(batch, ref, 4, "head")
    assert int(mine[0]) == 1, f"sample 1 not published: {int(mine[0])}"
    # rank 1 pretends to be still reading sample 1 for 1.5 s; rank 0's insert must wait for it
    if RANK == 1:
        mine[0] = 0
    COMM.Barrier()
    if RANK == 1:
        time.sleep(1.5)
        t_pub = time.time()
        mine[0] = 1
        COMM.send(t_pub, dest=0)
    elif RANK == 0:
        replay.insert(ref[next(iter(ref))][0])
        t_ins = time.time()
        t_pub = COMM.recv(source=1)
        assert t_ins >= t_pub, f"the insert went ahead {t_pub - t_ins:.3f} s before the peer published"
    COMM.Barrier()
    # after another collective the fence is free: inserts do not wait
    replay.sample(2, 4, "head")
    t0 = time.monotonic()
    replay.insert(ref[next(iter(ref))][0])
    # well under the 3 s a fence wait would last (a bound of 0.5 s left a loaded CI machine no slack)
    assert time.monotonic() - t0 < 2.0
    # a peer that never publishes: the owner's insert raises after the timeout
    replay.sample(2, 4, "head")
    if RANK == 1:
        mine[0] = 0
    COMM.Barrier()  # blocking: ranks wait here while rank 0 is held
    if RANK == 0:
        t0 = time.monotonic()
        with pytest.raises(gm.CollectiveTimeoutError, match="node fence"):
            replay.insert(ref[next(iter(ref))][0])
        took = time.monotonic() - t0
        assert 2.5 < took < 6.0, took
    COMM.Barrier()
    if RANK == 1:
        mine[0] = replay._epoch
    replay.close()

