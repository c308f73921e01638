"""Activity counters, rates and the RateMeter (gear_mpi.stats) on K ranks.

- ``stats()["activity"]`` counts inserted items and bytes (insert and insert_many), windows and
  bytes received, windows served, calls; the time split is consistent (waiting and copying are parts
  of a sample's time) and sees a late rank: the others wait in the collective, it does not;
- ``gm.rates`` turns two snapshots into rates that add up to the counters;
- a RateMeter reports at the same steps on every rank (by step count, and by rank 0's clock),
  calls its sink and log on the root only, and works while ``replay.batches()`` samples on its thread.

Run by tests/test_parallel_mpi.py on 4 ranks; runs unchanged on 1 rank.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

import gear_mpi as gm
from replay_checks import COMM, RANK, SIZE, SPEC, TIMEOUT


def build(n: int = 10, seed: int = 2) -> tuple[gm.Replay, int]:
    """A replay with ``n`` trajectories on each rank (half by insert, half by insert_many); their steps."""
    replay = gm.Replay(SPEC, 1000, gm.Prioritized(0.6, 0.4), seed=seed, timeout=TIMEOUT)
    rng = np.random.default_rng(seed * 10 + RANK)
    trajs = []
    for _ in range(n):
        L = int(rng.integers(1, SPEC.max_length + 1))
        trajs.append({"obs": rng.standard_normal((L, 3)).astype(np.float32), "step": np.arange(L),
                      "flag": np.zeros((L, 2), np.uint8)})
    for t in trajs[: n // 2]:
        replay.insert(t, 1.0)
    replay.insert_many(trajs[n // 2:])
    return replay, sum(len(t["step"]) for t in trajs)


def test_counters_and_rates():
    replay, steps = build()
    before = replay.stats()
    act = before["activity"]
    assert tuple(act["per_rank"]) == gm.stats.ACTIVITY_FIGURES
    assert act["per_rank"]["inserted"] == [10] * SIZE
    assert act["per_rank"]["inserted_bytes"][RANK] == steps * SPEC.step_bytes
    batches = [replay.sample(4 + RANK, 5) for _ in range(6)]
    replay.update_priorities(batches[0].meta_numpy()[0], np.ones(4 + RANK))
    after = replay.stats()
    a = after["activity"]["per_rank"]
    assert a["received"][RANK] == 6 * (4 + RANK) and a["sample_calls"][RANK] == 6
    assert a["received_bytes"][RANK] == sum(b.nbytes for b in batches)
    assert after["activity"]["total"]["served"] == after["activity"]["total"]["received"] == \
        sum(6 * (4 + r) for r in range(SIZE))
    assert a["update_calls"][RANK] == 1 and a["update_seconds"][RANK] > 0
    me = {k: v[RANK] for k, v in a.items()}
    assert 0 < me["sample_seconds"] and me["sample_wait_seconds"] + me["copy_seconds"] <= me["sample_seconds"] + 1e-6
    assert me["wait_seconds"] >= me["sample_wait_seconds"] and (SIZE == 1 or me["copy_seconds"] > 0)
    assert after["activity"]["total"]["uptime"] == max(a["uptime"])

    r = gm.rates(before, after)
    assert r["ranks"] == SIZE and r["seconds"] > 0
    assert r["total"]["samples_per_s"] * r["seconds"] == pytest.approx(sum(6 * (4 + q) for q in range(SIZE)))
    assert r["total"]["inserts_per_s"] == 0.0
    assert r["total"]["sample_ms"] > 0
    for k in ("sample_fraction", "wait_fraction", "copy_fraction", "sample_wait_fraction"):
        assert all(0 <= v <= 1.05 for v in r["per_rank"][k]), (k, r["per_rank"][k])
    flat = gm.stats.flatten(r, per_rank=True)
    assert flat["replay/samples_per_s"] == r["total"]["samples_per_s"] and f"replay/rank{SIZE - 1}/sample_ms" in flat
    assert "windows/s" in gm.stats.describe(r)
    # the gauges of the later snapshot: no writers here, so nothing staged and no age (inf), and no words on them
    assert r["total"]["staged"] == 0 and r["total"]["staged_steps"] == 0 and r["total"]["ingested_age"] == np.inf
    assert "staged" not in gm.stats.describe(r)
    with pytest.raises(ValueError, match="later snapshot"):
        gm.rates(after, before)
    replay.close()


@pytest.mark.skipif(SIZE == 1, reason="needs a rank to wait for")
def test_a_late_rank_shows_as_the_others_waiting():
    replay, _ = build()
    replay.sample(2, 3)
    before = replay.stats()
    if RANK == 0:
        time.sleep(0.4)
    replay.sample(2, 3)
    r = gm.rates(before, replay.stats())
    waited = [s * r["seconds"] for s in r["per_rank"]["sample_wait_fraction"]]
    assert min(waited[1:]) > 0.3, waited  # every other rank waited for rank 0 in the sample's collective
    assert waited[0] < 0.2, waited        # rank 0 came last: it hardly waited
    replay.close()


def test_meter_by_step_count_reports_at_the_same_steps_everywhere():
    replay, _ = build()
    got, lines = [], []
    meter = gm.RateMeter(replay, every=3, sink=got.append, log=lines.append)
    reports = []
    for step in range(1, 11):
        replay.sample(3, 2)
        if meter.step() is not None:
            reports.append(step)
    assert reports == [4, 7, 10] and meter.snapshots == 4
    assert COMM.allgather(reports) == [reports] * SIZE
    if RANK == 0:
        assert [m["step"] for m in got] == [4, 7, 10] and len(lines) == 3
        assert got[-1]["replay/samples_per_s"] > 0 and got[-1]["replay/sample_calls_per_s"] > 0
    else:
        assert got == [] and lines == []
    assert meter.last["total"]["samples_per_s"] * meter.last["seconds"] == pytest.approx(3 * 3 * SIZE)
    meter.close()
    replay.close()


def test_meter_by_seconds_agrees_on_the_steps_from_rank_0s_clock():
    replay, _ = build()
    lines = []
    meter = gm.log_every(replay, 0.25, lines.append, root=None)
    reports = []
    for step in range(1, 61):
        time.sleep(0.01)
        replay.sample(2, 2)
        r = meter.step()
        if r is not None:
            reports.append((step, r["seconds"]))
    steps = [s for s, _ in reports]
    assert COMM.allgather(steps) == [steps] * SIZE  # the same steps on every rank, no message of its own
    assert len(reports) >= 2 and len(lines) == len(reports)
    assert all(sec >= 0.9 * 0.25 for _, sec in reports), reports
    assert meter.snapshots < 30, meter.snapshots  # most steps gathered nothing
    meter.close()
    replay.close()


def test_meter_while_batches_samples_on_its_thread():
    replay, _ = build()
    meter = gm.RateMeter(replay, every=4)  # built before the iterator: the barrier and Dup use the replay's comm
    seen = []
    with replay.batches(3, 2, prefetch=2, limit=12) as it:
        for batch in it:
            r = meter.step()
            if r is not None:
                seen.append(r["total"]["samples_per_s"])
    assert len(seen) == 2 and all(v > 0 for v in seen)
    meter.close()
    replay.close()


def test_bad_meter_arguments():
    replay, _ = build(2)
    with pytest.raises(ValueError, match="exactly one"):
        gm.RateMeter(replay)
    with pytest.raises(ValueError, match="every must be"):
        gm.RateMeter(replay, every=0)
    # one rank's bad or differing argument raises on every rank, in the head (it raised on that rank alone, and the
    # others met its next call as a collective mismatch: the replay was lost)
    last = replay.comm.size - 1
    mine = replay.comm.rank == last
    with pytest.raises(ValueError, match=f"RateMeter: rank {last}: RateMeter: every must be an integer >= 1, got -1"):
        gm.RateMeter(replay, every=-1 if mine else 2)
    if replay.comm.size > 1:
        with pytest.raises(ValueError, match=r"RateMeter: every, seconds and root must be the same on every rank"):
            gm.RateMeter(replay, every=3 if mine else 2)
    assert replay.stats()["total"]["items"] >= 0  # still usable
    replay.close()
