"""compare_peers' W2 floor: gear_worker's bare-gather row copies real ring rows, and the bounds it yields."""
import json

import numpy as np
import pytest

import gear_mpi as gm
from scripts.bench import compare_peers
from scripts.peers import gear_worker
from scripts.peers._common import TRANSITION, transitions


def test_copy_floor_row_copies_rows_of_the_ring(capsys):
    n, b = 3000, 64
    data = transitions(n)
    shard = gm.Shard(gm.TrajectorySpec(TRANSITION, max_length=1), n, gm.Prioritized(0.6, 0.4), seed=0)
    shard.insert_packed(data, np.ones(n, np.int64), np.ones(n))
    batch = shard.sample(b, 1)
    gear_worker.w2_copy_floor(shard, batch, b, n, {"seconds": 0.05, "warmup_s": 0.01, "threads": 1})
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["variant"] == compare_peers.W2_FLOOR == gear_worker.W2_FLOOR
    assert row["B"] == b and row["N"] == n and row["calls"] >= 5 and 0 < row["best_call_s"] <= row["median_call_s"]
    # the batch now holds the last gather's rows: each one is a stored item, all three columns from the same one
    got = batch.numpy()
    items = [int(np.flatnonzero(data["action"] == a)[0]) for a in got["action"][:, 0]]  # actions are distinct
    assert np.array_equal(got["obs"][:, 0], data["obs"][items])
    assert np.array_equal(got["reward"][:, 0], data["reward"][items])
    assert len(set(items)) > b // 2  # random rows, not one row again and again
    shard.close()


def row(peer, variant, threads, ms):
    return {"workload": "W2", "peer": peer, "variant": variant, "threads": threads, "B": 256, "N": 100_000,
            "status": "ok", "ms_per_call": ms}


def test_bounds_are_the_peer_step_over_the_floor():
    rows = [row("gear_mpi", compare_peers.W2_FLOOR, 1, 0.1), row("gear_mpi", compare_peers.W2_FLOOR, 2, 0.05),
            row("gear_mpi", "Shard(Prioritized) sample+update", 1, 0.2), row("cpprb", "PRB", 1, 0.3),
            row("torchrl", "PS", 2, 1.0), row("torchrl", "PS", 4, 1.0)]
    got = {(b["peer"], b["threads"]): b for b in compare_peers.bounds(rows)}
    assert set(got) == {("cpprb", 1), ("torchrl", 2)}  # no floor measured with 4 threads: no bound claimed
    assert got["cpprb", 1]["bound"] == pytest.approx(3.0) and got["cpprb", 1]["bound_fastest"] == pytest.approx(6.0)
    assert got["torchrl", 2]["bound"] == pytest.approx(20.0) and got["torchrl", 2]["fastest_floor_threads"] == 2
