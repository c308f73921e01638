"""Checkpoints (gear_mpi.checkpoint): the multi-rank pytest modules, the crash-recovery rule, the files.

The multi-rank checks are the pytest modules tests/mpi/test_checkpoint_*.py (see
their docstrings), started here on K ranks: exact restores, replacement, damaged
checkpoints, resharding and the deadlines of slow and absent ranks on 2 ranks (and
resharding onto 3), the format-2 fixture written by the code before the refactor on
2 ranks and on one, the device index on one rank (on numba's CUDA simulator), and
progress reports and the logger on one rank, and the progress of every rank on 3. Here too:
when progress is shown (lines, or a tqdm bar on a terminal), what a missing tqdm does, the assumed file-system rate, and the record of communicators
left unusable by a timeout.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gear_mpi import checkpoint as ck
from gear_mpi.checkpoint import files

from mpi_util import run_pytest_mpi

MPI_TESTS = Path(__file__).parent / "mpi"


def run_modules(nprocs: int, *modules: str, env: dict | None = None, timeout: float = 600.0) -> None:
    """Run pytest modules of tests/mpi on ``nprocs`` ranks (one plain process for 1); fail on any failure."""
    run_pytest_mpi(nprocs, *modules, env=env, mpiexec=nprocs > 1, timeout=timeout)


def test_checkpoints_on_two_ranks():
    run_modules(2, "test_checkpoint_restore.py", "test_checkpoint_fixture.py", "test_checkpoint_deadline.py")


def test_background_checkpoints_on_two_ranks():
    """Replay.checkpoint_every / load_latest (tests/mpi/test_checkpoint_background.py: incremental, hard links,
    keep, the schedule carried by sample, failures agreed, resharding onto one rank)."""
    run_modules(2, "test_checkpoint_background.py")


def test_background_checkpoints_on_one_rank():
    """One rank samples its shard without a head (Replay._sample's one-rank path): the checkpoint schedule,
    which rides on the head, must still fire there."""
    run_modules(1, "test_checkpoint_background.py::test_the_schedule_rides_on_sample",
                "test_checkpoint_background.py::test_exact_restore_from_a_background_checkpoint")


def test_reshard_onto_three_ranks():
    run_modules(3, "test_checkpoint_restore.py::test_reshard_onto_more_ranks",
                "test_checkpoint_restore.py::test_reshard_onto_fewer_ranks_fails_unless_drops_are_allowed")


def test_progress_and_segment_parts_on_three_ranks():
    """Progress over every rank, rank 0's report lines and segments stored in parts, on an odd number of ranks
    (these modules assumed one or two ranks until 2026-12-06)."""
    run_modules(3, "test_progress.py", "test_checkpoint_progress.py", "test_checkpoint_parts.py")


def test_one_rank_device_index_fixture_and_progress():
    run_modules(1, "test_checkpoint_device.py", "test_checkpoint_fixture.py", "test_checkpoint_progress.py",
                env={"NUMBA_ENABLE_CUDASIM": "1"})


def test_resolve_rule(tmp_path):
    path = tmp_path / "cp"
    with pytest.raises(ck.CheckpointError, match="no checkpoint there"):
        ck.resolve(path)
    (tmp_path / "cp.old").mkdir()
    assert ck.resolve(path) == str(path) + ".old"  # crashed between the two renames
    path.mkdir()
    assert ck.resolve(path) == str(path)  # path wins; path.old is stale debris
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointError, match="not a directory"):
        ck.resolve(tmp_path / "file")
    with pytest.raises(ck.CheckpointError, match="MANIFEST.json: missing"):
        ck.read_manifest(path)


def test_remap():
    old = np.array([3, 7, 9], np.int64)
    new = np.array([30, -1, 90], np.int64)
    assert ck.remap((old, new), [9, 3, 7, 4]).tolist() == [90, 30, -1, -1]
    assert ck.remap((old[:0], new[:0]), [1]).tolist() == [-1]


@pytest.mark.parametrize("size", [0, 1, 4095, files.DIRECT_BLOCK, files.DIRECT_BLOCK + 7, 3 * files.DIRECT_BLOCK + 12345])
def test_direct_writes_make_the_same_file(tmp_path, size):
    """write_file_direct (O_DIRECT through an aligned buffer, the tail buffered; the page cache where refused):
    the same bytes, size and sha256 as write_file, from chunks of any size; never overwrites."""
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    parts = [data[i:i + 300_007] for i in range(0, size, 300_007)]
    info = files.write_file_direct(str(tmp_path / "d"), parts)
    assert info == files.write_file(str(tmp_path / "b"), parts)
    assert (tmp_path / "d").read_bytes() == data.tobytes()
    with pytest.raises(FileExistsError):
        files.write_file_direct(str(tmp_path / "d"), [b"x"])
    assert os.path.getsize(tmp_path / "d") == size
    shm = Path("/dev/shm")  # tmpfs: O_DIRECT refused before Linux 6.6, the page cache then
    if shm.is_dir() and os.access(shm, os.W_OK):
        target = shm / f"gear_direct_{os.getpid()}_{size}"
        try:
            assert files.write_file_direct(str(target), parts) == info
            assert target.read_bytes() == data.tobytes()
        finally:
            target.unlink(missing_ok=True)


def test_the_pacer_keeps_the_byte_budget_and_stops_when_hurried():
    from gear_mpi.checkpoint import pacing
    CHUNK, Pacer, lower_priority = pacing.CHUNK, pacing.Pacer, pacing.lower_priority
    data = np.zeros(4 * CHUNK + 5, np.uint8)
    pacer = Pacer(rate=8 * CHUNK)  # 4 chunks ahead of the first: at least 0.5 s
    t0 = time.monotonic()
    got = b"".join(bytes(p) for p in pacer.chunks([data[:CHUNK + 3], data[CHUNK + 3:]]))
    assert got == data.tobytes() and pacer.moved == len(data)
    assert time.monotonic() - t0 >= 0.45 and pacer.slept > 0  # the rest of the 0.5 s: copying 32 MiB above
    hurried = Pacer(rate=1.0)  # one byte a second: only a hurried pacer gets through
    hurried.hurry = True
    t0 = time.monotonic()
    assert sum(len(p) for p in hurried.chunks([data])) == len(data)
    assert time.monotonic() - t0 < 5.0  # paced, it would take a year; unpaced, the copy alone (loaded CI: slack)
    for bad in (0, -1.0, "fast", True):
        with pytest.raises(ValueError, match="write_rate must be a number"):
            Pacer(rate=bad)
    with pytest.raises(ValueError, match="cpu_share must be a number > 0 and <= 1"):
        Pacer(cpu_share=1.5)
    seen = {}

    def lowered():  # in a thread of its own: the caller's thread alone is lowered
        seen["how"] = lower_priority()
        seen["policy"] = os.sched_getscheduler(0)
    before = os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=lowered)
    t.start()
    t.join()
    assert seen["how"] in ("idle", "nice", "none")
    if seen["how"] == "idle":
        assert seen["policy"] == os.SCHED_IDLE
    assert (os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())) == before


def test_files_are_written_in_chunks_with_checksums(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    info = files.write_file(str(tmp_path / "f"), files.slices(data, 0, 1000, step=64))
    assert info == {"bytes": 1000, "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
    assert [len(p) for p in files.slices(data, 100, 300, step=64)] == [64, 64, 64, 8]
    with pytest.raises(FileExistsError):  # never overwrites
        files.write_file(str(tmp_path / "f"), [b"x"])
    assert os.path.getsize(tmp_path / "f") == 1000
    with files.CheckedFile(str(tmp_path / "f"), info) as c:  # reads back, checking size and sha256
        head = np.empty(10, np.uint8)
        c.read_into(head)
        assert head.tolist() == list(range(10))
        c.finish()
    with pytest.raises(ck.CheckpointError, match="sha256 does not match"):
        with files.CheckedFile(str(tmp_path / "f"), dict(info, sha256="0" * 64)) as c:
            c.finish()
    with pytest.raises(ck.CheckpointError, match="the manifest says 999"):
        files.CheckedFile(str(tmp_path / "f"), dict(info, bytes=999))


def test_public_names_and_layers():
    """The names of the old gear_mpi.checkpoint module still work; the package imports no replay code."""
    import gear_mpi as gm
    from gear_mpi.errors import CheckpointError
    assert ck.CheckpointError is CheckpointError and ck.MANIFEST == "MANIFEST.json" and ck.FORMAT_VERSION == 3
    assert ck.rank_dir(3) == "rank-00003"
    assert gm.save_checkpoint is ck.save and gm.load_checkpoint == gm.Replay.load
    with pytest.raises(TypeError, match="build"):
        ck.load("anywhere")  # the package cannot build a Replay by itself
    with pytest.raises(TypeError, match="unexpected keyword"):
        ck.load("anywhere", build=gm.Replay, colour="red")
    import ast
    import pathlib
    for source in pathlib.Path(ck.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").endswith("replay"), (source.name, node.module)
                names = {a.name for a in node.names}
                assert not names & {"replay", "Replay", "__version__"}, (source.name, names)


def test_when_progress_is_shown(monkeypatch):
    from gear_mpi import progress
    monkeypatch.delenv(progress.ENV, raising=False)
    assert progress.wanted(None, 0)  # by default, though stderr is not a terminal under pytest (nor mpiexec)
    assert not progress.wanted(None, 1)  # rank 0 only
    assert progress.wanted(True, 0) and not progress.wanted(True, 1) and not progress.wanted(False, 0)
    monkeypatch.setenv(progress.ENV, "1")
    assert progress.wanted(None, 0) and not progress.wanted(None, 2) and not progress.wanted(False, 0)
    monkeypatch.setenv(progress.ENV, "0")  # the way off
    assert not progress.wanted(None, 0) and progress.wanted(True, 0)  # the argument wins
    with pytest.raises(TypeError, match="progress"):
        progress.wanted("yes", 0)


def test_short_work_is_silent_long_work_reports_lines(monkeypatch, capsys):
    from gear_mpi import progress
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")
    monkeypatch.delenv(progress.DELAY_ENV, raising=False)
    with progress.Meter(100, "gear_mpi save", show=True) as m:  # ends well within the default 2 s
        progress.advance(100)
    assert not m.showing and capsys.readouterr().err == ""
    monkeypatch.setenv(progress.DELAY_ENV, "0.2")
    with progress.Meter(100, "gear_mpi save", show=True, ranks=3) as m:
        progress.advance(10)
        assert capsys.readouterr().err == ""  # not yet: the delay
        time.sleep(0.25)
        progress.advance(10)
        m.report_peers(40)
        progress.advance(50)  # 110 of an estimate of 100: the total shown follows, never "?"
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("gear_mpi save:  20% | 20 B of 100 B over 3 ranks |"), err
    assert err[1].startswith("gear_mpi save:  60% | 60 B of 100 B over 3 ranks |"), err
    assert err[2].startswith("gear_mpi save: 100% | 110 B of 110 B over 3 ranks |"), err
    assert err[3].startswith("gear_mpi save: 100% | 110 B over 3 ranks in "), err
    assert len(err) == 4 and m.total == 110
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    with pytest.raises(OSError):
        with progress.Meter(100, "gear_mpi load", show=True):
            progress.advance(30)
            raise OSError("disk gone")
    assert "gear_mpi load: stopped by an error at 30 B of 100 B" in capsys.readouterr().err


def test_a_terminal_gets_a_tqdm_bar_that_ends_at_its_total(monkeypatch, capsys):
    pytest.importorskip("tqdm")
    from gear_mpi import progress
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    monkeypatch.setattr(progress, "_stderr_is_terminal", lambda: True)
    with progress.Meter(1000, "gear_mpi save", show=True, ranks=2) as m:
        progress.advance(600)
        m.report_peers(500)  # past the estimate: the bar's total follows (tqdm shows "?" past its total)
    assert m.bar is None and m.total == 1100
    err = capsys.readouterr().err
    assert "gear_mpi save (2 ranks): 100%" in err and "/?B" not in err, err  # never an unknown total


def test_no_tqdm_plain_lines_no_error(monkeypatch, capsys):
    import sys
    from gear_mpi import progress
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    monkeypatch.setattr(progress, "_stderr_is_terminal", lambda: True)
    heard = []
    with progress.Meter(100, "gear_mpi save", show=True) as m:
        m.listeners.append(heard.append)
        progress.advance(60)
        progress.advance(40)
    progress.advance(5)  # no meter open: nothing happens
    assert m.bar is None and m.done == 100 and heard == [60, 100]
    assert "gear_mpi save: 100% | 100 B in" in capsys.readouterr().err


def test_assumed_rate_and_sizes(monkeypatch):
    from gear_mpi.checkpoint import arrival
    monkeypatch.delenv(arrival.RATE_ENV, raising=False)
    assert arrival.assumed_rate() == arrival.DEFAULT_RATE
    monkeypatch.setenv(arrival.RATE_ENV, "2.5")
    assert arrival.assumed_rate() == 2.5e6
    for bad in ("0", "-1", "fast", "nan"):
        monkeypatch.setenv(arrival.RATE_ENV, bad)
        with pytest.raises(ValueError, match="GEAR_MPI_CHECKPOINT_RATE"):
            arrival.assumed_rate()
    assert [arrival.human(n) for n in (56, 2310, 56e6, 1.1e9)] == ["56 B", "2.31 kB", "56 MB", "1.1 GB"]


def test_a_timed_out_communicator_is_remembered():
    from gear_mpi.distributed import deadline

    class Comm:
        def __init__(self, handle):
            self.handle = handle

        def py2f(self):
            return self.handle
    a, b = Comm(7), Comm(8)
    deadline.mark_pending(a, "save: not every rank arrived")
    assert deadline.pending_reason(Comm(7)) == "save: not every rank arrived"  # another object, same handle
    assert deadline.pending_reason(b) is None
    deadline.forget(a)
    assert deadline.pending_reason(a) is None
    assert deadline.poll(lambda: True, 0.0) and not deadline.poll(lambda: False, 0.01)
