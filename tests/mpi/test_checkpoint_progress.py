"""Progress reports and the ``gear_mpi`` logger of save and load.

Run by tests/test_checkpoint.py on one and three ranks (``python -m pytest tests/mpi/test_checkpoint_progress.py``
by hand, or under ``mpiexec -n N``: only rank 0 reports). Under pytest stderr is not a terminal, so reports are
plain lines; the ranks' totals are tests/mpi/test_progress.py's.

- by default (and with ``progress=True`` or ``GEAR_MPI_PROGRESS=1``), save and load report
  their bytes on stderr once they have lasted ``GEAR_MPI_PROGRESS_DELAY`` seconds (0 here);
- ``GEAR_MPI_PROGRESS=0`` (or ``progress=False``): nothing on stderr;
- the logger records what a save and a load did (bytes, seconds).
"""
from __future__ import annotations

import logging
import os
import re

import gear_mpi as gm
from checkpoint_checks import RANK, SIZE, SPEC, fill, shared_dir  # noqa: F401
from gear_mpi import progress

LINE = re.compile(r"gear_mpi (save|load): +\d+% \| \d+(\.\d+)? [kMG]?B of \d+(\.\d+)? [kMG]?B")
DONE = re.compile(r"gear_mpi (save|load): 100% \| \d+(\.\d+)? [kMG]?B( over \d+ ranks)? in \d+\.\d s")


def reported(err: str, what: str) -> None:
    """Rank 0's stderr holds plain progress lines of ``what`` and its closing 100 % line; the others' nothing."""
    if RANK == 0:
        assert LINE.search(err) and DONE.search(err) and what in err, err
    else:
        assert what not in err, err


def make() -> gm.Replay:
    replay = gm.Replay(SPEC, 400, gm.Uniform(), seed=5)
    fill(replay, 30, base=1)
    return replay


def test_reports_show_bytes(shared_dir, capsys, monkeypatch):
    monkeypatch.delenv(progress.ENV, raising=False)
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    replay = make()
    path = os.path.join(shared_dir, "bar")
    replay.save(path)  # by default, though stderr is not a terminal
    err = capsys.readouterr().err
    reported(err, "gear_mpi save")
    loaded, _ = gm.Replay.load(path, progress=True)
    err = capsys.readouterr().err
    reported(err, "gear_mpi load")
    monkeypatch.setenv(progress.ENV, "1")  # the variable asks for it too
    loaded.save(path)
    assert ("gear_mpi save" in capsys.readouterr().err) == (RANK == 0)
    loaded.close()
    replay.close()


def test_silent_with_the_variable_or_the_argument(shared_dir, capsys, monkeypatch):
    replay = make()
    path = os.path.join(shared_dir, "quiet")
    monkeypatch.setenv(progress.DELAY_ENV, "0")
    monkeypatch.setenv(progress.ENV, "0")
    replay.save(path)
    loaded, _ = gm.Replay.load(path)
    monkeypatch.setenv(progress.ENV, "1")
    loaded.save(path, progress=False)
    assert capsys.readouterr().err == ""
    loaded.close()
    replay.close()


def test_the_logger_records_save_and_load(shared_dir, caplog):
    replay = make()
    path = os.path.join(shared_dir, "logged")
    with caplog.at_level(logging.INFO, logger="gear_mpi"):
        replay.save(path, progress=False)
        loaded, _ = gm.Replay.load(path, progress=False)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == "gear_mpi")
    assert re.search(rf"save: rank {RANK} wrote \d+(\.\d+)? kB in \d+\.\d\d s", text), text
    assert (f"save: {path} installed: {SIZE} ranks" in text) == (RANK == 0), text
    assert f"load: rank {RANK} restored its shard" in text, text
    loaded.close()
    replay.close()
