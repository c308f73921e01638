"""File-backed shards (memory="file", path=) and mapped checkpoints (load(mmap=True)): one process.

- A file-backed Shard draws the very same batches as a private-memory one with the same seed and
  inserts, for every selector, window and alignment (bit for bit), through ring wrap-around.
- Its files: path/rank-NNNNN/columns.bin (the arena, reserved on disk, MADV_RANDOM) and the table's
  slots.bin; another process maps the columns by name; close removes them.
- Clear errors: no path, path missing / not a directory / not writable, a file in the way, not
  enough disk (the free-space check, and posix_fallocate failing), nothing left behind.
- The guard of a mapped checkpoint file (storage.file_guard): a read lease holds another process's
  writer or truncation until the call using the mapping ends, then every use raises CheckpointError;
  the lease goes back at once when idle and on close; without a lease (file open for writing: a
  warning; GEAR_MPI_MMAP_LEASE=0: none) a write or truncation is seen by size and modification time.
- The multi-rank checks (every mode, node peers, checkpoints of file-backed replays, load(mmap=True))
  are tests/mpi/test_file_memory.py, started here on 1 to 3 ranks, and on 2 ranks with a device
  replay over file-backed and mapped arenas on numba's CUDA simulator.
"""
from __future__ import annotations

import errno
import gc
import os
import re
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.storage import file_arenas as file_memory
from gear_mpi.storage import file_guard
from gear_mpi.errors import StorageError
from gear_mpi.storage import attach_columns

from mpi_util import run_pytest_mpi

SPEC = gm.TrajectorySpec({"obs": ((3,), "float32"), "t": ((), "int64"), "flag": ((2,), "uint8")}, max_length=12)
SELECTORS = [gm.Uniform(), gm.Prioritized(0.7, 0.5), gm.Fifo(), gm.Lifo(), gm.MaxPriority(), gm.MinPriority()]


def trajectories(n: int, seed: int) -> tuple[list[dict], np.ndarray]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, SPEC.max_length + 1))
        out.append({"obs": rng.standard_normal((length, 3)).astype(np.float32),
                    "t": np.arange(length, dtype=np.int64) + 1000 * i,
                    "flag": rng.integers(0, 256, (length, 2)).astype(np.uint8)})
    return out, rng.uniform(0.1, 3.0, n)


def same(a: gm.Batch, b: gm.Batch) -> None:
    for name in ("keys", "lengths", "probabilities", "weights", "mask"):
        assert np.array_equal(getattr(a, name).numpy(), getattr(b, name).numpy()), name
    for name in SPEC.names:
        assert np.array_equal(a[name].numpy(), b[name].numpy()), name


@pytest.mark.parametrize("sel", SELECTORS, ids=[type(s).__name__ for s in SELECTORS])
def test_file_backed_shard_draws_what_a_private_one_draws(tmp_path, sel):
    trajs, prios = trajectories(40, seed=3)  # ~260 steps into a 120-step ring: it wraps and evicts
    shards = [gm.Shard(SPEC, 120, sel, seed=5, tag=9, max_times_sampled=6),
              gm.Shard(SPEC, 120, sel, seed=5, tag=9, max_times_sampled=6, memory="file", path=tmp_path)]
    try:
        for j in range(0, 40, 8):
            keys = [s.insert_many(trajs[j:j + 8], prios[j:j + 8]) for s in shards]
            assert np.array_equal(keys[0], keys[1])
            for window, align in ((5, "random"), (12, "head"), (7, "tail"), (None, "random")):
                a, b = (s.sample(6, window, align) for s in shards)
                same(a, b)
                if sel.proportional:
                    new = np.random.default_rng(j).uniform(0.0, 2.0, 6)
                    assert shards[0].update_priorities(a.keys, new) == shards[1].update_priorities(a.keys, new)
        for key in shards[0].store.keys_of(shards[0].store.live_slots()).tolist():
            x, y = shards[0].get(key), shards[1].get(key)
            assert all(np.array_equal(x[c], y[c]) for c in SPEC.names)
        assert shards[0].stats() == shards[1].stats()
    finally:
        for s in shards:
            s.close()
    # closed, still referenced: no mapping of its (unlinked) files is left, so their disk space is free now,
    # not when the shard is collected (the table's arrays kept slots.bin mapped)
    assert _mapped_under(tmp_path) == [], _mapped_under(tmp_path)


def _mapped_under(directory) -> list[str]:
    with open("/proc/self/maps") as f:
        return sorted({line.split(None, 5)[5].strip() for line in f
                       if len(line.split(None, 5)) == 6 and str(directory) in line})


def test_files_reserved_advised_shared_and_removed(tmp_path):
    shard = gm.Shard(SPEC, 5000, gm.Uniform(), memory="file", path=str(tmp_path), rank=3)
    d = tmp_path / "rank-00003"
    assert sorted(os.listdir(d)) == ["columns.bin"]  # the table's file is unlinked once mapped
    columns = d / "columns.bin"
    st = os.stat(columns)
    assert shard.shm_name == str(columns) and st.st_size == shard.store.arena.nbytes
    assert st.st_blocks * 512 >= st.st_size, "the blocks are reserved up front (posix_fallocate)"
    assert shard.store.arena.kind == "file" and shard.store._table_arena is not None
    # MADV_RANDOM shows as "rr" in the mapping's VmFlags
    addr = shard.store.arena.buffer.ctypes.data
    flags = _vm_flags(addr)
    assert "rr" in flags.split(), flags
    trajs, prios = trajectories(5, seed=1)
    keys = shard.insert_many(trajs, prios)
    arena, views = attach_columns(shard.shm_name, SPEC, 5000)  # as a node peer maps it
    try:
        slot = int(gm.keys.decode(keys[2:3])[3][0])
        start, length = int(shard.store.start[slot]), len(trajs[2]["t"])
        got = views["t"][start * 8:(start + length) * 8].view(np.int64)
        assert np.array_equal(got, trajs[2]["t"])
        # written through the peer's mapping, seen by the owner: one page cache
        views["t"][start * 8:start * 8 + 8].view(np.int64)[0] = -5
        assert shard.get(int(keys[2]))["t"][0] == -5
    finally:
        arena.close()
    shard.close()
    assert not d.exists(), "close removes the files and the rank's directory"


def _vm_flags(addr: int) -> str:
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("VmFlags:"):
                return line[len("VmFlags:"):]
    return ""


def test_bad_paths_give_clear_errors(tmp_path):
    with pytest.raises(StorageError, match="needs path="):
        gm.Shard(SPEC, 100, memory="file")
    with pytest.raises(StorageError, match="does not exist"):
        gm.Shard(SPEC, 100, memory="file", path=tmp_path / "nope")
    (tmp_path / "plain").write_text("x")
    with pytest.raises(StorageError, match="is not a directory"):
        gm.Shard(SPEC, 100, memory="file", path=tmp_path / "plain")
    with pytest.raises(ValueError, match='path= is for memory="file"'):
        gm.Shard(SPEC, 100, memory="shm", path=tmp_path)
    (tmp_path / "rank-00000").mkdir()
    (tmp_path / "rank-00000" / "columns.bin").write_text("left over")
    with pytest.raises(StorageError, match="exists: a file-backed shard needs files of its own"):
        gm.Shard(SPEC, 100, memory="file", path=tmp_path)
    assert (tmp_path / "rank-00000" / "columns.bin").read_text() == "left over"  # never clobbered
    assert issubclass(StorageError, OSError) and issubclass(StorageError, gm.GearError)


def test_not_writable_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes anywhere but on a read-only file system
        if not _mount(ro, "ro,size=1m"):
            pytest.skip("running as root and cannot mount a read-only tmpfs")
    else:
        ro.chmod(0o500)
    try:
        with pytest.raises(StorageError, match="not writable"):
            gm.Shard(SPEC, 100, memory="file", path=ro)
    finally:
        _umount(ro) if os.geteuid() == 0 else ro.chmod(0o700)


def test_not_enough_disk_fails_at_construction(tmp_path, monkeypatch):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    big = gm.TrajectorySpec({"img": ((1 << 20,), "uint8")}, max_length=4)
    with pytest.raises(StorageError, match="not enough disk .* it needs .* is free there"):
        gm.Shard(big, free // (1 << 20) + 1024, memory="file", path=tmp_path)  # 1 GiB more than is free
    assert os.listdir(tmp_path) == [], "nothing left behind"

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)  # the space went between the check and the reservation
    with pytest.raises(StorageError, match="not enough disk for .*columns.bin.*No space left"):
        gm.Shard(SPEC, 100, memory="file", path=tmp_path)
    assert os.listdir(tmp_path) == [], "nothing left behind"


def test_full_small_file_system_fails_with_storage_error(tmp_path, monkeypatch):
    """A real 1 MiB tmpfs: the free-space check, then posix_fallocate itself (with the check skipped)."""
    small = tmp_path / "small"
    small.mkdir()
    if not _mount(small, "size=1m"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        with pytest.raises(StorageError, match="not enough disk"):
            gm.Shard(SPEC, 40_000, memory="file", path=small)  # 1.3 MB of columns
        monkeypatch.setattr(file_memory, "require_space", lambda d, n: None)
        with pytest.raises(StorageError, match="not enough disk for"):
            gm.Shard(SPEC, 40_000, memory="file", path=small)
        assert os.listdir(small) == []
        shard = gm.Shard(SPEC, 1000, memory="file", path=small)  # what fits works
        shard.insert(trajectories(1, 0)[0][0])
        shard.close()
        del shard  # its arrays keep the mappings (and the file system busy) until they go
        gc.collect()
    finally:
        _umount(small)


def _mount(where, options: str) -> bool:
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, timeout=30)
    return r.returncode == 0


def _umount(where) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)  # busy: detach it


# ---- multi-rank: every mode, node peers, checkpoints, load(mmap=True) ---------------------------------
RUNS = [(1, False), (2, True), (3, False)]


@pytest.mark.parametrize("nprocs,force", RUNS, ids=[f"{n}-{'alltoallv' if f else 'direct'}" for n, f in RUNS])
def test_file_backed_replay_on_ranks(nprocs, force):
    run = run_pytest_mpi(nprocs, "test_file_memory.py", *(["--force-alltoallv"] if force else []),
                         mpiexec=nprocs > 1, timeout=600)
    assert any(t.startswith("test_file_memory::") for t in run.passed(0))


def test_device_replay_on_file_memory_on_the_simulator():
    run = run_pytest_mpi(2, "test_file_memory.py::test_device_replay_on_file_memory_on_the_simulator",
                         env={"NUMBA_ENABLE_CUDASIM": "1"}, timeout=600)
    assert len(run.passed(0)) == 1, run.passed(0)


def test_memory_budget_counts_what_stays_in_ram():
    """A file-backed shard reserves RAM for its priority index only; a mapped one for its table and index."""
    from gear_mpi.storage import budget
    big = gm.TrajectorySpec({"img": ((84, 84, 4), "uint8")}, max_length=100)
    cap = 40_000_000  # 1.1 TB of steps: no node's RAM
    ram = budget.shard_bytes(big, cap, 100_000, True, "private")
    assert ram > 1 << 40 and budget.check(ram, 1, "private") is not None
    assert budget.shard_bytes(big, cap, 100_000, True, "file") == 100_000 * 10
    assert budget.check(budget.shard_bytes(big, cap, 100_000, True, "file"), 4, "file") is None
    # the widest table these sizes allow: start uint32, length uint8, status, stamp, times, order, priority
    assert budget.shard_bytes(big, cap, 100_000, True, "mapped") == 100_000 * (10 + 4 + 1 + 2 + 8 + 4 + 4 + 8)


def test_memory_budget_message_shows_small_sizes(monkeypatch):
    """A budget refusal names its sizes in a unit that shows them (issue 30, item 5: not "0.00 GiB")."""
    from gear_mpi.storage import budget
    monkeypatch.setattr(budget, "mem_available", lambda: (3000, "the cgroup limit"))
    why = budget.check(2048, 2, "private")
    assert "need 4.1 kB for their shards (2.05 kB each) but the cgroup limit leaves 3 kB" in why, why
    assert budget.check(1000, 2, "private") is None


# ---- the guard of a mapped checkpoint file (load(mmap=True)) against other processes ---------------------
# A FileGuard on a plain file, in this process; the replays' side (sample, get, get_many, insert, save raising
# CheckpointError on every rank, a truncation never killing a rank) is tests/mpi/test_file_memory.py.

def _guarded(tmp_path, nbytes: int = 1 << 16):
    f = tmp_path / "columns.bin"
    f.write_bytes(bytes(range(256)) * (nbytes // 256))
    return str(f), file_guard.FileGuard(str(f), os.open(f, os.O_RDONLY))


def _leases_of(filename: str) -> list[str]:
    """This process's lines of /proc/locks for ``filename``'s inode (its leases)."""
    ino = os.stat(filename).st_ino
    with open("/proc/locks") as f:
        return [ln for ln in f if " LEASE " in ln and f" {os.getpid()} " in ln and ln.split()[-3].endswith(f":{ino}")]


def _writer(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.mark.parametrize("how", ["write", "truncate"])
def test_guard_holds_a_writer_until_the_call_ends_then_breaks(tmp_path, monkeypatch, how):
    monkeypatch.delenv(file_guard.LEASE_VAR, raising=False)
    name, guard = _guarded(tmp_path)
    if guard.mode != "lease":
        guard.close()
        pytest.skip(f"no lease here: {guard.why_no_lease}")
    assert guard.leased and len(_leases_of(name)) == 1, "a read lease on the mapped file"
    code = {"write": f"f = open({name!r}, 'r+b'); f.write(b'\\xff' * 100); f.close()",
            "truncate": f"import os; os.truncate({name!r}, 4096)"}[how]
    with guard.hold():  # a call uses the mapping: the writer must wait for it
        t0 = time.monotonic()
        proc = _writer(code)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(1.0)
        assert open(name, "rb").read(1) == b"\0", "nothing changed while the call ran"
    proc.wait(20)  # the call ended: the lease goes back, the writer goes on
    assert proc.returncode == 0 and time.monotonic() - t0 < 10, "well before /proc/sys/fs/lease-break-time"
    assert not guard.leased and _leases_of(name) == []
    what = {"write": "was written by another process (its modification time changed)",
            "truncate": "was truncated by another process (now 4096 bytes, 65536 when mapped)"}[how]
    with pytest.raises(gm.CheckpointError, match=f"columns.bin {re.escape(what)} while mapped by this process .*"
                                                 f"close the replay and load the checkpoint again"):
        with guard.hold():
            pass
    with guard.hold(strict=False) as problem:
        assert isinstance(problem, gm.CheckpointError)
    guard.close()


def test_guard_gives_the_lease_back_at_once_when_idle_and_on_close(tmp_path, monkeypatch):
    monkeypatch.delenv(file_guard.LEASE_VAR, raising=False)
    name, guard = _guarded(tmp_path)
    if guard.mode != "lease":
        guard.close()
        pytest.skip(f"no lease here: {guard.why_no_lease}")
    with guard.hold():
        pass
    assert guard.problem() is None
    t0 = time.monotonic()
    proc = _writer(f"open({name!r}, 'r+b').close()")  # opened for writing, nothing written: still a break
    proc.wait(20)
    assert time.monotonic() - t0 < 10 and not guard.leased
    with pytest.raises(gm.CheckpointError, match="was opened for writing or truncated by another process"):
        guard.hold().__enter__()
    guard.close()
    # a second guard, closed while healthy: the lease goes, the descriptor too
    other, guard = _guarded(_fresh_dir(tmp_path), 4096)
    assert len(_leases_of(other)) == 1
    fd = guard._fd
    guard.close()
    guard.close()  # idempotent
    assert _leases_of(other) == [] and not guard.leased
    with pytest.raises(OSError):
        os.fstat(fd)


def _fresh_dir(tmp_path):
    d = tmp_path / "other"
    d.mkdir()
    return d


def test_guard_without_a_lease_warns_and_compares_size_and_time(tmp_path, monkeypatch):
    """A file open for writing when mapped cannot be leased (EAGAIN): a RuntimeWarning says what is then not
    caught; a write or a truncation is still seen at the next call, by the file's size and modification time."""
    monkeypatch.delenv(file_guard.LEASE_VAR, raising=False)
    f = tmp_path / "columns.bin"
    f.write_bytes(b"\1" * 8192)
    with open(f, "r+b") as w:
        with pytest.warns(RuntimeWarning, match="no lease on .*columns.bin \\(it is open for writing by some "
                                                "process\\).*SIGBUS"):
            guard = file_guard.FileGuard(str(f), os.open(f, os.O_RDONLY))
        assert guard.mode == "stat" and not guard.leased
        with guard.hold():
            pass
        time.sleep(0.02)  # the file system's clock may tick coarsely
        w.write(b"\2")
        w.flush()
    with pytest.raises(gm.CheckpointError, match="was written by another process .* \\(no lease: it is open for "
                                                 "writing"):
        guard.hold().__enter__()
    guard.close()
    monkeypatch.setenv(file_guard.LEASE_VAR, "0")  # leases turned off: no warning, the same checks
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard = file_guard.FileGuard(str(f), os.open(f, os.O_RDONLY))
    assert guard.mode == "stat" and guard.why_no_lease == f"{file_guard.LEASE_VAR}=0"
    assert guard.problem() is None
    os.truncate(f, 100)
    assert "was truncated by another process (now 100 bytes, 8192 when mapped)" in str(guard.problem())
    guard.close()
