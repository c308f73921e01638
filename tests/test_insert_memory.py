"""Insert temporaries: chunked table passes store what one pass stores, and a big insert leaves no
n-sized temporaries resident (issue 16 item 5: RSS as the user leaves it).

- A shard planning in tiny chunks (3 trajectories, 8 eviction entries) ends with the very tables,
  steps, index and keys of one planning in one chunk, through evictions, wrap-arounds, removals
  and both index paths; the eviction bound is never passed.
- In a fresh process, a 2e6-item prioritized shard filled by one big insert_packed and then by
  chunks grows its RSS by its arrays' bytes plus a few MB (before chunking: +16 MB of scratch
  kept, and heap garbage per chunk).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import store_insert
from gear_mpi.kernels import ring
from test_insert_packed import same_state

ROOT = Path(__file__).resolve().parents[1]


def _pack(trajs):
    cols = {k: np.concatenate([t[k] for t in trajs]) for k in trajs[0]}
    return cols, np.array([len(t["t"]) for t in trajs])


@pytest.mark.parametrize("sampler", [gm.Uniform(), gm.Prioritized(0.6, 0.4), gm.Fifo()], ids=repr)
def test_chunked_passes_store_what_one_pass_stores(spec, make_traj, shard_factory, sampler, monkeypatch):
    rng = np.random.default_rng(11)
    a = shard_factory(spec, 150, sampler, max_items=40, max_times_sampled=2, seed=3)
    b = shard_factory(spec, 150, sampler, max_items=40, max_times_sampled=2, seed=3)
    plan = ring.plan_insert

    def checked_plan(table, capacity, lengths, now, slots_out, evicted_out):
        room = np.empty(10_000, np.int64)  # the kernel may not need more than the bound it is given
        k = plan(table, capacity, lengths, now, slots_out, room)
        assert k <= len(evicted_out)
        evicted_out[:k] = room[:k]
        return k

    monkeypatch.setattr(store_insert.ring, "plan_insert", checked_plan)
    for round_ in range(14):
        trajs = [make_traj(int(n)) for n in rng.integers(1, 9, rng.integers(1, 30))]
        pr = rng.uniform(0.0, 3.0, len(trajs))
        pr[0] = -0.0
        cols, lengths = _pack(trajs)
        with monkeypatch.context() as m:
            m.setattr(store_insert, "CHUNK_ITEMS", 3)
            m.setattr(store_insert, "SCRATCH_ENTRIES", 8)
            ka = a.insert_packed(cols, lengths, pr)
        kb = b.insert_packed(cols, lengths, pr)
        np.testing.assert_array_equal(ka, kb)
        same_state(a, b)
        if round_ % 3 == 2:  # removals (twice sampled) leave REMOVED entries in the order ring
            for _ in range(2):
                np.testing.assert_array_equal(a.sample(8, 1).keys.numpy(), b.sample(8, 1).keys.numpy())


_CHILD = textwrap.dedent("""
    import gc, json, sys
    import numpy as np
    import gear_mpi as gm
    from gear_mpi.storage import store_insert

    from scripts.bench.bench_memory import rss_bytes as rss

    n = int(sys.argv[1])
    spec = gm.TrajectorySpec({"obs": ((), np.float32)}, max_length=1)
    for slots in (64, 1024):  # load both index paths' kernels first
        w = gm.Shard(spec, slots, gm.Prioritized(0.6, 0.4), seed=0)
        w.insert_packed({"obs": np.zeros(8, np.float32)}, np.ones(8, np.int64), np.ones(8))
        w.close()
    rng = np.random.default_rng(0)
    obs, pr, ones = rng.standard_normal(n).astype(np.float32), rng.uniform(0.1, 2.0, n), np.ones(n, np.int64)
    gc.collect()
    before = rss()
    s = gm.Shard(spec, n, gm.Prioritized(0.6, 0.4), seed=0)
    s.insert_packed({"obs": obs}, ones, pr)  # one big insert: every slot of the table, the index
    for lo in range(0, n, n // 10):  # then chunks (each evicts as many)
        s.insert_packed({"obs": obs[lo:lo + n // 10]}, ones[:n // 10], pr[lo:lo + n // 10])
    gc.collect()
    grown = rss() - before
    arrays = sum(a.nbytes for a in s.store.table if a.strides != (0,)) + sum(c.nbytes for c in s.store.columns.values())
    arrays += sum(a.nbytes for a in s.index.tree)
    print(json.dumps({"grown": grown, "arrays": arrays, "scratch": int(s.store._insert_scratch.buffer.nbytes)}))
""")


def test_a_big_insert_leaves_no_temporaries_resident():
    n = 2_000_000
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", _CHILD, str(n)], capture_output=True, text=True, timeout=240,
                       env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["scratch"] <= store_insert.SCRATCH_ENTRIES * 8
    # the arrays are committed whole (every slot written); what else stays is bounded, not per item:
    # the scratch (2 MB) and a few MB of numba/Python heap. The old path kept 16 n bytes (32 MB) more.
    extra = got["grown"] - got["arrays"]
    assert extra <= 8 << 20, f"RSS grew {got['grown'] / n:.1f} B/item, arrays {got['arrays'] / n:.1f} B/item"
