"""Shards in POSIX shared memory: another process attaches by name and reads (and writes)
the very bytes the shard holds; close() unlinks the segment."""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import arenas as memory
from gear_mpi.storage import column_layout

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs in a fresh interpreter: attach to the segment, read each (start, length) window of
# every column from the ring (wrapping at its end), save them; then write a marker value
# into the first step of column "t" of the first window.
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import gear_mpi as gm

    args = json.loads(sys.argv[1])
    spec = gm.TrajectorySpec.from_dict(args["spec"])
    cap = args["capacity"]
    arena, views = gm.attach_columns(args["name"], spec, cap)
    out = {}
    for i, (start, length) in enumerate(args["windows"]):
        idx = (start + np.arange(length)) % cap
        for c in spec.columns:
            steps = views[c.name].view(c.dtype).reshape((cap,) + c.shape)
            out[f"{i}/{c.name}"] = steps[idx]
    np.savez(args["out"], **out)
    t = views["t"].view(np.int64)
    t[args["windows"][0][0]] = args["marker"]
    del views, t
    arena.close()
    print("attached", arena.nbytes)
""")


def run_child(args: dict) -> str:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                          timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def shm_path(name: str) -> str:
    return os.path.join(memory.SHM_DIR, name)


def test_numpy_memory_has_no_segment(shard_factory, spec):
    assert shard_factory(spec, 50).shm_name is None


def test_shm_shard_exposes_a_named_segment(shard_factory, spec, make_traj):
    shard = shard_factory(spec, 50, memory="shm")
    name = shard.shm_name
    assert name.startswith(memory.SHM_PREFIX)
    assert os.path.exists(shm_path(name))
    _, nbytes = column_layout(spec, 50)
    assert os.stat(shm_path(name)).st_size == nbytes
    assert "memory=shm" in repr(shard)
    offsets, _ = column_layout(spec, 50)
    assert all(off % memory.ALIGN == 0 for off in offsets.values())


def test_another_process_reads_the_same_bytes(shard_factory, spec, make_traj, tmp_path):
    cap = 40
    shard = shard_factory(spec, cap, memory="shm", seed=0)
    trs = [make_traj(n) for n in (14, 12, 16, 9)]  # the last two wrap the ring; the first is evicted
    keys = [shard.insert(t) for t in trs[:2]] + shard.insert_many(trs[2:]).tolist()
    live = [(k, t) for k, t in zip(keys, trs) if shard.locate(k)[0][0] >= 0]
    starts, lengths = shard.locate([k for k, _ in live])
    assert len(live) == 3 and ((starts + lengths) > cap).any(), "one live trajectory must straddle the ring end"
    out = tmp_path / "seen.npz"
    marker = -123456789
    stdout = run_child({"name": shard.shm_name, "spec": spec.to_dict(), "capacity": cap, "out": str(out),
                        "windows": [[int(s), int(n)] for s, n in zip(starts, lengths)], "marker": marker})
    assert "attached" in stdout
    seen = np.load(out)
    for i, (key, tr) in enumerate(live):
        for name, col in tr.items():
            got = seen[f"{i}/{name}"]
            assert got.dtype == col.dtype and got.tobytes() == col.tobytes(), (i, name)
    # the child wrote into the shard's memory: the shard sees it (no copy in between), nothing else changed
    first_key, first = live[0]
    now = shard.get(first_key)
    assert now["t"][0] == marker
    np.testing.assert_array_equal(now["t"][1:], first["t"][1:])
    for key, tr in live:
        for name in ("obs", "act", "done", "img"):
            assert shard.get(key)[name].tobytes() == tr[name].tobytes()
    assert shard.sample(1, window=1, align="head")["t"].shape == (1, 1)


def test_attach_in_process_sees_the_live_columns(shard_factory, spec, make_traj):
    cap = 30
    shard = shard_factory(spec, cap, memory="shm")
    arena, views = gm.attach_columns(shard.shm_name, spec, cap)
    try:
        own = shard.store.byte_views()
        key = shard.insert(make_traj(7))  # written after attaching
        for name in spec.names:
            assert views[name].tobytes() == own[name].tobytes()
        start, length = shard.locate(key)
        t = views["t"].view(np.int64)[start[0]:start[0] + length[0]]
        np.testing.assert_array_equal(t, shard.get(key)["t"])
    finally:
        del views
        arena.close()
    assert os.path.exists(shm_path(shard.shm_name)), "an attacher must not unlink the segment"


def test_attach_with_the_wrong_layout_is_refused(shard_factory, spec, make_spec):
    shard = shard_factory(spec, 30, memory="shm")
    with pytest.raises(ValueError, match="this spec and capacity need"):
        gm.attach_columns(shard.shm_name, spec, 40)
    other = gm.TrajectorySpec({"t": ((), "int64")}, max_length=16)
    with pytest.raises(ValueError, match="bytes"):
        gm.attach_columns(shard.shm_name, other, 30)


def test_attach_with_a_layout_of_the_same_size_is_refused(shard_factory, spec):
    """Column sizes round up to 64 bytes, so sizes can match: the header's fingerprint must not."""
    shard = shard_factory(spec, 31, memory="shm")
    with pytest.raises(ValueError, match="another spec or capacity"):
        gm.attach_columns(shard.shm_name, spec, 30)
    renamed = gm.TrajectorySpec({("renamed_" + c.name): (c.shape, c.dtype) for c in spec.columns}, spec.max_length)
    with pytest.raises(ValueError, match="another spec or capacity"):
        gm.attach_columns(shard.shm_name, renamed, 31)


def test_a_closed_shard_refuses_every_operation(spec, make_traj):
    shard = gm.Shard(spec, 64, memory="shm")
    key = shard.insert(make_traj(5))
    assert len(shard) == 1
    shard.close()
    assert len(shard) == 0 and "items=0" in repr(shard)  # a closed shard holds nothing (it said 1)
    assert shard.store.live_steps == 0
    for call in (lambda: shard.get(key), lambda: shard.insert(make_traj(3)), lambda: shard.sample(1, 2),
                 lambda: shard.update_priorities([key], [1.0]), lambda: shard.locate([key])):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def test_close_unlinks_the_segment(spec, make_traj):
    shard = gm.Shard(spec, 30, memory="shm", tag=1)
    shard.insert(make_traj(5))
    name = shard.shm_name
    assert os.path.exists(shm_path(name))
    shard.close()
    assert not os.path.exists(shm_path(name))
    shard.close()  # idempotent
    with pytest.raises(FileNotFoundError, match=name):
        gm.attach_columns(name, spec, 30)


def test_context_manager_unlinks(spec, make_traj):
    with gm.Shard(spec, 30, memory="shm", tag=1) as shard:
        name = shard.shm_name
        shard.insert(make_traj(4))
        assert os.path.exists(shm_path(name))
    assert not os.path.exists(shm_path(name))


def test_close_unlinks_even_while_an_attacher_holds_it(spec):
    shard = gm.Shard(spec, 30, memory="shm", tag=1)
    arena, views = gm.attach_columns(shard.shm_name, spec, 30)
    shard.close()
    assert not os.path.exists(shm_path(arena.name))
    views["t"][:8] = 1  # the attacher's mapping stays valid until it unmaps
    del views
    arena.close()


def test_shm_and_numpy_shards_sample_the_same(shard_factory, spec, make_traj):
    a = shard_factory(spec, 45, gm.Prioritized(0.6, 0.4), memory="shm", seed=9)
    b = shard_factory(spec, 45, gm.Prioritized(0.6, 0.4), memory="private", seed=9)
    rng = np.random.default_rng(0)
    for _ in range(9):
        tr, p = make_traj(int(rng.integers(1, 17))), float(rng.uniform(0.1, 2))
        a.insert(tr, p)
        b.insert(tr, p)
    for align in ("random", "head", "tail"):
        x, y = a.sample(32, window=8, align=align), b.sample(32, window=8, align=align)
        for name in spec.names:
            assert x.numpy()[name].tobytes() == y.numpy()[name].tobytes()
        assert x.keys.tolist() == y.keys.tolist() and x.mask.tolist() == y.mask.tolist()


def test_segment_names_are_unique(shard_factory, spec):
    names = {shard_factory(spec, 16, memory="shm").shm_name for _ in range(5)}
    assert len(names) == 5


@pytest.mark.parametrize("memory", ["shm", "file"])
def test_a_forked_child_that_exits_leaves_the_creators_names(spec, make_traj, memory, tmp_path):
    """The creator's exit handlers (unlink the segment or file) ran in a child forked from it too: a child that
    exited normally deleted the names the creator and its node peers map and attach by (a shared ring, a
    writer registry, a file-backed shard's columns). Now only the creating process unlinks."""
    shard = gm.Shard(spec, 64, memory=memory, path=str(tmp_path) if memory == "file" else None)
    key = shard.insert(make_traj(3))
    path = shard.shm_name if memory == "file" else os.path.join("/dev/shm", shard.shm_name)
    pid = os.fork()
    if pid == 0:  # the child: what a normal exit runs (the exit handlers it inherited), then out of pytest
        atexit._run_exitfuncs()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.path.exists(path)
    assert shard.get(key)["obs"].shape[0] == 3 and len(shard.sample(2, 1)) == 2
    shard.close()
    assert not os.path.exists(path)  # the creator's own close still unlinks
