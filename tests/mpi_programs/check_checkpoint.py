"""Multi-rank checks of gear_mpi.checkpoint, run as ``mpiexec -n K python check_checkpoint.py SCENARIO DIR``.

Every rank prints ``PASS <check> rank=R`` for each check it passed; a failure raises.

Scenarios:
- ``exact DIR``: for several samplers and modes, a replay whose rings have wrapped
  (evictions, removals by max_times_sampled, updated priorities, uneven shards) is
  saved, sampled further, and loaded on the same ranks: the loaded replay draws
  the very same batches (keys, every column, mask, weights, probabilities) and
  applies the same updates; key_map is the identity. Saving over an existing
  checkpoint replaces it; a checkpoint found only as ``DIR.old`` (a save that
  crashed between its renames) loads; the next save cleans up. Damaged
  checkpoints (missing file, flipped byte, truncated file, unknown format
  version, missing or extra rank directory, corrupted manifest, nothing there)
  raise CheckpointError naming the file, with the same message on every rank.
  Finally writes ``DIR/shared`` (a checkpoint) and ``DIR/shared.ref.npz`` (what
  it holds) for ``reshard``.
- ``reshard DIR [capacity]``: loads ``DIR/shared`` onto this many ranks (and
  optionally another capacity): every live trajectory arrives once, with its data
  bit for bit, priority, times sampled and stamp; each new shard keeps global
  insertion order; shards are balanced by steps; dropped ones (if it does not
  fit) are exactly the oldest; old keys are refused; sampling works.
- ``device DIR`` (one rank, NUMBA_ENABLE_CUDASIM=1): a ``device="cuda"`` replay (a
  device priority index) saved and loaded onto the GPU path and onto the CPU path
  draws the same batches as the saved one.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
from mpi4py import MPI

import gear_mpi as gm
from gear_mpi import checkpoint as ck
from gear_mpi import keys as keyspace
from gear_mpi.kernels import ring

comm = MPI.COMM_WORLD
RANK, SIZE = comm.rank, comm.size
SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "id": ((), "int64"), "flag": ((2,), "uint8")}, max_length=9)


def passed(name: str) -> None:
    print(f"PASS {name} rank={RANK}", flush=True)


def traj(ident: int) -> dict[str, np.ndarray]:
    """The trajectory with id ``ident``: everything in it follows from the id."""
    rng = np.random.default_rng(ident)
    length = 1 + ident % SPEC.max_length
    return {"obs": rng.standard_normal((length, 3)).astype(np.float32),
            "id": np.full(length, ident, np.int64),
            "flag": rng.integers(0, 256, (length, 2)).astype(np.uint8)}


def fill(replay: gm.Replay, count: int, base: int) -> None:
    ids = [base + 100_000 * RANK + i for i in range(count)]
    for j in range(0, len(ids), 5):
        part = ids[j:j + 5]
        replay.insert_many([traj(i) for i in part], [0.25 + (i % 11) for i in part])


def same_batch(a: gm.Batch, b: gm.Batch, what: str) -> None:
    for name in ("keys", "lengths", "probabilities", "weights", "mask"):
        x, y = getattr(a, name).numpy(), getattr(b, name).numpy()
        assert x.dtype == y.dtype and np.array_equal(x, y), (what, name, x, y)
    for name in SPEC.names:
        assert np.array_equal(a[name].numpy(), b[name].numpy()), (what, name)


def drive(replay: gm.Replay, steps: int, seed: int) -> list:
    """Samples and updates, identical on every call with the same replay state; returns the batches."""
    rng = np.random.default_rng(seed + RANK)
    out = []
    for i in range(steps):
        b = replay.sample(3 + RANK, 4, ("random", "head", "tail")[i % 3])
        out.append(b)
        replay.update_priorities(b.keys, rng.uniform(0.0, 3.0, len(b)))
    return out


def check_exact(base: str) -> None:
    configs = [("prio-dec", gm.Prioritized(0.7, 0.5), "decentralized", {}),
               ("uni-cen", gm.Uniform(), "centralized", {"max_times_sampled": 4}),
               ("fifo-dec", gm.Fifo(), "decentralized", {"max_items": 9}),
               ("max-dec", gm.MaxPriority(), "decentralized", {})]
    for name, sel, mode, kw in configs:
        path = os.path.join(base, name)
        replay = gm.Replay(SPEC, 60, sel, mode=mode, seed=11, timeout=30.0, **kw)
        fill(replay, 14 + 5 * RANK, base=1)  # more than fits: the rings wrap and evict
        drive(replay, 3, seed=5)
        replay.save(path)
        saved = replay.stats()["total_items"]
        expect = drive(replay, 4, seed=9)
        stats = replay.stats()
        loaded, key_map = gm.Replay.load(path)
        assert np.array_equal(key_map[0], key_map[1]), "key_map of an exact restore is the identity"
        assert len(key_map[0]) == saved, (len(key_map[0]), saved)
        got = drive(loaded, 4, seed=9)
        for i, (a, b) in enumerate(zip(expect, got)):
            same_batch(a, b, f"{name} batch {i}")
        after = loaded.stats()
        for k in ("items", "live_steps", "steps_used", "total_weight", "inserted", "evicted", "removed", "sampled",
                  "stale_updates"):
            assert after[k] == stats[k], (name, k, after[k], stats[k])
        # identical stores afterwards, the keys still name the same trajectories
        st0, st1 = replay.shard.store, loaded.shard.store
        assert np.array_equal(st0.state, st1.state)
        live = ring.live_in_order(st0.state, st0.alive, st0.order, False, len(st0))
        for k in st0.keys_of(live).tolist():
            a, b = replay.get(k), loaded.get(k)
            assert all(np.array_equal(a[c], b[c]) for c in SPEC.names)
        replay.close()
        loaded.close()
        passed(f"exact/{name}")
    check_replace_and_old(base)
    check_damaged(base)
    make_shared(base)


def check_replace_and_old(base: str) -> None:
    path = os.path.join(base, "replace")
    replay = gm.Replay(SPEC, 80, gm.Prioritized(0.6, 0.4), seed=2, timeout=30.0)
    fill(replay, 4, base=1)
    replay.save(path)
    fill(replay, 3, base=50)
    replay.save(path)  # replaces the first
    n_now = replay.stats()["total_items"]
    loaded, key_map = gm.Replay.load(path)
    assert loaded.stats()["total_items"] == n_now and len(key_map[0]) == n_now
    loaded.close()
    assert not os.path.exists(path + ".old")
    # a save that crashed between its renames leaves only path.old: load takes it
    comm.Barrier()
    if RANK == 0:
        os.rename(path, path + ".old")
        os.makedirs(path + ".tmp-deadbeef/rank-00000")  # debris of an interrupted save
    comm.Barrier()
    loaded, key_map = gm.Replay.load(path)
    assert loaded.stats()["total_items"] == n_now
    loaded.close()
    fill(replay, 2, base=70)
    replay.save(path)  # installs the new one, removes path.old and the debris
    comm.Barrier()
    assert os.path.isdir(path) and not os.path.exists(path + ".old") and not os.path.exists(path + ".tmp-deadbeef")
    # refuses to replace a directory that is not a checkpoint
    other = os.path.join(base, "not-a-checkpoint")
    if RANK == 0:
        os.makedirs(other, exist_ok=True)
        open(os.path.join(other, "precious.txt"), "w").write("keep me")
    comm.Barrier()
    try:
        replay.save(other)
    except gm.CheckpointError as e:
        assert "not a gear_mpi checkpoint" in str(e), str(e)
    else:
        raise AssertionError("save replaced a directory that is not a checkpoint")
    assert open(os.path.join(other, "precious.txt")).read() == "keep me"
    replay.close()
    passed("replace-and-old")


def expect_checkpoint_error(path: str, needle: str, what: str) -> None:
    try:
        gm.Replay.load(path, timeout=20.0)
    except gm.CheckpointError as e:
        msgs = comm.allgather(str(e))
        assert len(set(msgs)) == 1, (what, msgs)
        assert needle in msgs[0], (what, needle, msgs[0])
        if RANK == 0:
            print(f"damaged/{what}: {msgs[0]}", flush=True)
        return
    raise AssertionError(f"{what}: load accepted a damaged checkpoint (rank {RANK})")


def check_damaged(base: str) -> None:
    good = os.path.join(base, "good")
    replay = gm.Replay(SPEC, 60, gm.Prioritized(0.6, 0.4), seed=3, timeout=30.0)
    fill(replay, 6, base=1)
    replay.save(good)
    replay.close()
    victim = SIZE - 1

    def damaged(name: str, hurt) -> str:
        path = os.path.join(base, "bad-" + name)
        if RANK == 0:
            shutil.copytree(good, path)
            hurt(path)
        comm.Barrier()
        return path

    def flip(fn: str, where: int = 5) -> None:
        with open(fn, "r+b") as f:
            f.seek(where)
            b = f.read(1)
            f.seek(where)
            f.write(bytes([b[0] ^ 0x40]))

    rd = ck.rank_dir(victim)
    fn = os.path.join(rd, "table.bin")
    p = damaged("missing", lambda p: os.remove(os.path.join(p, fn)))
    expect_checkpoint_error(p, os.path.join(p, fn) + ": missing", "missing-file")
    fn = os.path.join(rd, "column-000.bin")
    p = damaged("flipped", lambda p: flip(os.path.join(p, fn)))
    expect_checkpoint_error(p, os.path.join(p, fn) + ": sha256 does not match", "bad-checksum")
    fn = os.path.join(rd, "column-002.bin")
    p = damaged("truncated", lambda p: os.truncate(os.path.join(p, fn), 3))
    expect_checkpoint_error(p, os.path.join(p, fn) + ": 3 bytes, the manifest says", "truncated")

    def set_version(p):
        m = os.path.join(p, ck.MANIFEST)
        doc = json.load(open(m))
        doc["version"] = 99
        open(m, "w").write(json.dumps(doc))
    p = damaged("version", set_version)
    expect_checkpoint_error(p, os.path.join(p, ck.MANIFEST) + ": format version 99", "wrong-version")
    p = damaged("manifest", lambda p: flip(os.path.join(p, ck.MANIFEST), 400))
    expect_checkpoint_error(p, os.path.join(p, ck.MANIFEST) + ": ", "corrupted-manifest")
    if SIZE > 1:
        p = damaged("no-rank", lambda p: shutil.rmtree(os.path.join(p, rd)))
        expect_checkpoint_error(p, os.path.join(p, rd) + ": missing, but the manifest lists rank", "missing-rank")
    p = damaged("extra-rank", lambda p: shutil.copytree(os.path.join(p, ck.rank_dir(0)),
                                                        os.path.join(p, ck.rank_dir(SIZE))))
    expect_checkpoint_error(p, os.path.join(p, ck.rank_dir(SIZE)) + ": not listed in the manifest", "rank-mismatch")
    nothing = os.path.join(base, "nothing-here")
    expect_checkpoint_error(nothing, f"{nothing}: no checkpoint there", "nothing")
    passed("damaged")


def make_shared(base: str) -> None:
    """A checkpoint for the reshard scenario, with a reference of everything it holds."""
    path = os.path.join(base, "shared")
    replay = gm.Replay(SPEC, 70, gm.Prioritized(0.8, 0.4), seed=4, timeout=30.0)
    fill(replay, 12 + 4 * RANK, base=1)  # rank 0 wraps; all ranks differ
    drive(replay, 2, seed=3)
    replay.save(path)
    st = replay.shard.store
    live = ring.live_in_order(st.state, st.alive, st.order, False, len(st))
    mine = {"key": st.keys_of(live), "id": np.array([int(st.columns["id"][st.start[s]]) for s in live], np.int64),
            "priority": st.priority[live], "times": st.times_sampled[live], "stamp": st.stamp[live],
            "length": st.length[live], "seq": st.seq[live], "rank": np.full(len(live), RANK, np.int64)}
    parts = comm.gather(mine, root=0)
    if RANK == 0:
        ref = {k: np.concatenate([p[k] for p in parts]) for k in mine}
        np.savez(path + ".ref.npz", **ref)
    comm.Barrier()
    replay.close()
    passed("shared")


def check_reshard(base: str, capacity: int | None) -> None:
    path = os.path.join(base, "shared")
    ref = dict(np.load(path + ".ref.npz"))
    kw = {} if capacity is None else {"capacity_steps": capacity}
    replay, (old, new) = gm.Replay.load(path, timeout=30.0, **kw)
    assert np.array_equal(old, np.sort(ref["key"])), "key_map covers every live trajectory"
    by_key = {int(k): i for i, k in enumerate(ref["key"])}
    # global insertion order as the loader defines it
    eff = np.zeros(len(ref["key"]), np.int64)
    for r in np.unique(ref["rank"]):
        idx = np.flatnonzero(ref["rank"] == r)
        idx = idx[np.argsort(ref["seq"][idx])]
        eff[idx] = np.maximum.accumulate(ref["stamp"][idx])
    glob = np.lexsort((ref["seq"], ref["rank"], eff))
    age = np.empty(len(glob), np.int64)
    age[glob] = np.arange(len(glob))
    dropped = new == -1
    if capacity is None:
        assert not dropped.any(), "everything fits"
    else:
        assert dropped.any(), "this capacity cannot hold everything"
    st = replay.shard.store
    cap = replay.shard.capacity_steps
    # new keys are live on their owner, with the same data, priority, times sampled and stamp
    tag_new, owner, _, _ = keyspace.decode(new[~dropped])
    mine = new[~dropped][owner == RANK]
    olds = old[~dropped][owner == RANK]
    for o, k in zip(olds.tolist(), mine.tolist()):
        i = by_key[o]
        got = replay.get(k)
        want = traj(int(ref["id"][i]))
        for c in SPEC.names:
            assert got[c].dtype == want[c].dtype and np.array_equal(got[c], want[c]), (o, k, c)
        slot = int(keyspace.decode(np.array([k]))[3][0])
        assert st.priority[slot] == ref["priority"][i]
        assert st.times_sampled[slot] == ref["times"][i]
        assert st.stamp[slot] == ref["stamp"][i]
    # this shard's order is the global insertion order
    live = ring.live_in_order(st.state, st.alive, st.order, False, len(st))
    keys_in_order = st.keys_of(live).tolist()
    pos = {k: j for j, k in enumerate(keys_in_order)}
    ordered = sorted(zip(mine.tolist(), olds.tolist()), key=lambda t: pos[t[0]])
    ages = [age[by_key[o]] for _, o in ordered]
    assert ages == sorted(ages), "a new shard keeps the global insertion order"
    assert len(keys_in_order) == len(mine)
    # balanced by steps (without drops: max - min <= max_length); drops are the globally oldest per shard
    steps = comm.allgather(st.live_steps)
    if capacity is None:
        assert max(steps) - min(steps) <= SPEC.max_length, steps
        assert sum(steps) == int(ref["length"].sum())
    else:
        assert max(steps) <= cap
        if SIZE == 1:  # one shard: the dropped ones are exactly the globally oldest
            ages_dropped = age[[by_key[int(o)] for o in old[dropped]]]
            ages_kept = age[[by_key[int(o)] for o in old[~dropped]]]
            assert ages_dropped.max() < ages_kept.min()
            assert int(ref["length"][[by_key[int(o)] for o in old[~dropped]]].sum()) + \
                int(ref["length"][[by_key[int(o)] for o in old[dropped]]][-1:].sum()) > 0
    # old keys are refused by the new replay (another tag)
    if len(old):
        try:
            replay.update_priorities(old[:1] if RANK == 0 else [], np.ones(1 if RANK == 0 else 0))
        except gm.InvalidKeyError:
            pass
        else:
            raise AssertionError("the resharded replay accepted a key of the saved one")
    assert np.array_equal(ck.remap((old, new), old), new)
    # it samples, and the windows hold the right data
    b = replay.sample(5, 3, "head")
    owners = comm.allgather({k: by_key[o] for o, k in zip(old.tolist(), new.tolist()) if k >= 0})
    lookup = {}
    for part in owners:
        lookup.update(part)
    for row, k in enumerate(b.keys.tolist()):
        i = lookup[k]
        want = traj(int(ref["id"][i]))
        n = int(b.lengths[row])
        assert np.array_equal(b["obs"].numpy()[row, :n], want["obs"][:n])
    st_all = replay.stats()
    assert st_all["total_items"] == int((~dropped).sum()), st_all
    replay.close()
    passed(f"reshard/{SIZE}" + ("" if capacity is None else f"/cap{capacity}"))


def check_device(base: str) -> None:
    path = os.path.join(base, "device")
    replay = gm.Replay(SPEC, 60, gm.Prioritized(0.6, 0.4), seed=3, device="cuda")
    fill(replay, 16, base=1)
    drive(replay, 1, seed=1)
    replay.save(path)
    expect = drive(replay, 2, seed=2)
    for device in ("cuda", "cpu"):
        loaded, _ = gm.Replay.load(path, device=device)
        for i, (a, b) in enumerate(zip(expect, drive(loaded, 2, seed=2))):
            for name in ("keys", "probabilities", "weights", "mask"):
                assert np.array_equal(getattr(a, name).cpu().numpy(), getattr(b, name).cpu().numpy()), (device, name)
            for name in SPEC.names:
                assert np.array_equal(a[name].cpu().numpy(), b[name].cpu().numpy()), (device, name)
        loaded.close()
        passed(f"device/{device}")
    replay.close()


if __name__ == "__main__":
    scenario, base = sys.argv[1], sys.argv[2]
    if scenario == "exact":
        check_exact(base)
    elif scenario == "device":
        check_device(base)
    elif scenario == "reshard":
        check_reshard(base, int(sys.argv[3]) if len(sys.argv) > 3 else None)
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
