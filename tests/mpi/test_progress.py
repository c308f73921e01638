"""Progress of long collective work on rank 0, over every rank's bytes (gear_mpi.progress).

Run by tests/test_checkpoint.py on 3 ranks (``mpiexec -n 3 python -m pytest
tests/mpi/test_progress.py`` by hand). Under mpiexec (and pytest) stderr is not a terminal: rank 0
writes plain lines. ``GEAR_MPI_PROGRESS_DELAY=0`` and ``GEAR_MPI_PROGRESS_INTERVAL=0`` make every
call here "long" and every report a line, so the tests stay fast.

- save, exact load, reshard and from_npz_dir: rank 0 (only) writes lines of the bytes of all
  ranks out of the total of all ranks, ending with ``100% | <the sum over every rank> over 3
  ranks``; never a ``?`` total, never past 100 %;
- a slow peer: while rank 0 waits for it, its lines count the peer's bytes as they are reported;
- silence: with the default delay a short save shows nothing; ``GEAR_MPI_PROGRESS=0`` or
  ``progress=False`` silence even long ones.
"""
from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import gear_mpi as gm
from checkpoint_checks import SPEC, fill, shared_dir  # noqa: F401
from gear_mpi import progress
from gear_mpi.checkpoint import files, read_manifest

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size
LINE = re.compile(r"^(gear_mpi [^:]+): +(\d+)% \| ([\d.]+ [kMG]?B)(?: of ([\d.]+ [kMG]?B))?(?: over (\d+) ranks)?")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


@pytest.fixture
def fast(monkeypatch):
    """Every call long enough to report, every report a line."""
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    monkeypatch.setenv(progress.INTERVAL_ENV, "0")


def make(base: int) -> gm.Replay:
    replay = gm.Replay(SPEC, 3000, gm.Uniform(), seed=3)
    fill(replay, 40 + 150 * RANK, base=base)  # the ranks hold different amounts: rank 0 the least
    return replay


def lines(err: str, desc: str) -> list[re.Match]:
    found = [LINE.match(s) for s in err.splitlines() if s.startswith(desc + ":")]
    assert all(found), err
    return found


def amount(text: str) -> float:
    number, unit = text.split()
    return float(number) * UNITS[unit]


def every_rank(body: dict) -> int:
    """Bytes of every rank's files (the data of a columns.bin, not its holes), from the manifest."""
    return sum(int(e.get("data", e["bytes"])) for s in body["shards"] for e in s["files"].values())


def check_report(err: str, desc: str, total: int) -> list[re.Match]:
    """Rank 0's lines of ``desc``: totals of all ranks, none past 100 %, the last one 100 % of ``total``."""
    if RANK != 0:
        assert desc not in err, err  # only rank 0 reports
        return []
    assert "?" not in err, err
    found = lines(err, desc)
    assert len(found) >= 2, err
    assert all(int(m.group(2)) <= 100 for m in found), err
    last = found[-1]
    assert last.group(2) == "100" and last.group(4) is None, err  # the closing line: what was moved, in all
    assert last.group(3) == progress.human(total), (err, progress.human(total))  # every rank's bytes
    assert last.group(5) == (str(SIZE) if SIZE > 1 else None), err
    return found


def test_save_load_and_reshard_report_every_rank(shared_dir, capfd, fast):
    replay = make(1)
    path = os.path.join(shared_dir, "cp")
    replay.save(path)
    body = read_manifest(path)["body"]
    total = every_rank(body)
    err = capfd.readouterr().err
    found = check_report(err, "gear_mpi save", total)
    if RANK == 0 and SIZE > 1:
        own = sum(int(e.get("data", e["bytes"])) for e in body["shards"][0]["files"].values())
        assert amount(found[0].group(4)) > 2 * own, err  # the total is every rank's, not rank 0's
    loaded, _ = gm.Replay.load(path)
    check_report(capfd.readouterr().err, "gear_mpi load", total)
    loaded.close()
    resharded, key_map = gm.Replay.load(path, capacity_steps=3100)  # other sizes: a reshard
    err = capfd.readouterr().err
    if RANK == 0:
        found = lines(err, "gear_mpi load (reshard)")
        assert found[-1].group(2) == "100" and "?" not in err, err
    else:
        assert err == "", err
    assert COMM.allreduce(len(resharded)) == len(key_map[0])
    resharded.close()
    replay.close()


def test_rank_0_counts_a_slow_peer_while_it_waits(shared_dir, capfd, fast, monkeypatch):
    replay = make(2)
    slow = SIZE - 1
    if RANK == slow:  # a pause before each file after the columns: heartbeats report the columns meanwhile
        real = files.write_file

        def write_file(filename, chunks):
            if not filename.endswith("columns.bin"):
                time.sleep(1.2)
            return real(filename, chunks)
        monkeypatch.setattr(files, "write_file", write_file)
    path = os.path.join(shared_dir, "slow")
    replay.save(path)
    body = read_manifest(path)["body"]
    err = capfd.readouterr().err
    found = check_report(err, "gear_mpi save", every_rank(body))
    if RANK == 0 and SIZE > 1:
        before_slow = sum(int(e.get("data", e["bytes"])) for s in body["shards"][:slow] for e in s["files"].values())
        moved = [amount(m.group(3)) for m in found[:-1]]
        # a line while waiting: more than the fast ranks' bytes (the slow rank's columns, reported), not all
        assert any(before_slow * 1.05 < m < amount(m_total.group(4)) * 0.99
                   for m, m_total in zip(moved, found[:-1])), (err, before_slow)
    replay.close()


def test_from_npz_dir_reports_every_rank(shared_dir, capfd, fast, monkeypatch):
    if RANK == 0:
        for e in range(12):
            n = 5 + 3 * e
            np.savez(os.path.join(shared_dir, f"ep_{e:03d}.npz"), obs=np.full((n, 16), e, np.float32),
                     reward=np.ones(n, np.float32))
    COMM.Barrier()
    replay = gm.datasets.from_npz_dir(shared_dir, COMM, headroom=0)
    steps = sum(5 + 3 * e for e in range(12))
    check_report(capfd.readouterr().err, "gear_mpi from_npz_dir", steps * (16 + 1) * 4)
    replay.close()
    monkeypatch.setenv(progress.ENV, "0")  # the way off
    replay = gm.datasets.from_npz_dir(shared_dir, COMM)
    assert capfd.readouterr().err == ""
    replay.close()


def test_short_work_is_silent_and_the_way_off_silences_long_work(shared_dir, capfd, monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.delenv(progress.DELAY_ENV, raising=False)
    replay = make(3)
    path = os.path.join(shared_dir, "quiet")
    replay.save(path)  # well under the default delay of 2 s
    assert "gear_mpi" not in capfd.readouterr().err
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    monkeypatch.setenv(progress.ENV, "0")
    replay.save(path)
    loaded, _ = gm.Replay.load(path)
    monkeypatch.delenv(progress.ENV)
    loaded.save(path, progress=False)
    loaded.close()
    assert "gear_mpi" not in capfd.readouterr().err
    replay.close()
