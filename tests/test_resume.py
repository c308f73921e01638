"""Resume a killed job: a rank SIGKILLed mid-run from outside, the job rerun on another number of ranks.

scripts/slurm/resume_train.py (the payload of slurm/resume_replay.sbatch; its Slurm test is in
tests/test_slurm.py) checkpoints in the background every 4 steps. Here, under plain ``mpiexec`` (MPICH's
hydra): the test kills rank 1 with ``os.kill(pid, SIGKILL)`` once the ranks have passed step 14; the
job ends within seconds (hydra tears it down; the survivors never hang). The same command on 3 ranks
then resumes from the newest complete checkpoint (resharded onto 3 ranks), reports as lost exactly the
ids the ledgers hold and that checkpoint does not -- the inserts after it began, and nothing before --
and trains on to the end.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from mpi_util import mpich_runtime, remove_leaked_mpi_leftovers

REPO = Path(__file__).resolve().parents[1]
RESUME = re.compile(r"^resume: from (ckpt-\d+) \(steps 0\.\.(-?\d+), (\d+) items\) on (\d+) ranks; "
                    r"lost (\d+) items", re.M)


def launch(mpi, n: int, cmd: list[str]) -> list[str]:
    """``mpiexec -n N cmd`` (no -prepend-rank: the output is read line by line)."""
    return [mpi.mpiexec, *mpi.args, "-n", str(n), *cmd]


def ledger(run: Path, first_run_only: bool = False) -> set[int]:
    """The ids the ranks recorded as inserted (of the job's first run only: its earliest ledger files)."""
    found = sorted(run.glob("ledger-*-rank-*.txt"))
    if first_run_only and found:
        found = [p for p in found if p.name.split("-")[1] == found[0].name.split("-")[1]]
    out: set[int] = set()
    for p in found:
        out.update(int(line.split()[1]) for line in p.read_text().splitlines() if line.strip())
    return out


def check_resumed(text: str, run: Path, before: set[int], newest: str, ranks: int, steps: int,
                  manifest_items: int | None = None) -> None:
    """What the resumed run printed against the ledgers and the checkpoint it loaded (its manifest's item
    count when read before the resumed run pruned it); shared with tests/test_slurm.py."""
    m = RESUME.search(text)
    assert m, text
    name, last, items, on, lost = m[1], int(m[2]), int(m[3]), int(m[4]), int(m[5])
    assert name == newest and on == ranks, (name, newest, on, text)
    assert manifest_items is None or manifest_items == items, (manifest_items, items)
    kept = {i for i in before if i // 1000 <= last}
    assert len(kept) == items, (len(kept), items)  # every insert up to the checkpoint's step is held
    gone = sorted(i for i in before if i // 1000 > last)
    assert lost == len(gone) and lost > 0, (lost, gone, text)
    listed = re.search(r"^lost ids: (.*)$", text, re.M)
    assert listed and sorted(map(int, listed[1].split())) == gone, text
    assert f"done: steps 0..{steps - 1}" in text, text


def test_resume_after_a_rank_is_killed_under_mpiexec(tmp_path):
    mpi = mpich_runtime()
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    steps = 30
    cmd = [sys.executable, "-m", "mpi4py", "-m", "scripts.slurm.resume_train", "--dir", str(run), "--steps", str(steps),
           "--every", "4", "--step-seconds", "0.03", "--timeout", "5"]
    started = time.time()
    job = subprocess.Popen(launch(mpi, 2, cmd), cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        pid_file = run / "pid-rank-1"
        while time.monotonic() < deadline:
            files = list(run.glob("ledger-*-rank-1.txt"))
            rows = files[0].read_text().splitlines() if files else []
            if len(rows) >= 15 and pid_file.exists():
                break
            assert job.poll() is None, job.communicate()[0]
            time.sleep(0.02)
        else:
            raise AssertionError("the job did not reach step 14 in 90 s")
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed = time.monotonic()
        out, _ = job.communicate(timeout=30)
        assert job.returncode != 0, out
        assert time.monotonic() - killed < 20, "the survivors did not end within the deadline"
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
        # the killed rank never reached MPI_Finalize: its MPICH segment (/dev/shm/mpich_shm_*, 2 MiB) stayed
        # behind after every run of the suite
        remove_leaked_mpi_leftovers(started, mpi)
    before = ledger(run)
    newest = max(p.name for p in (run / "checkpoints").iterdir() if (p / "MANIFEST.json").exists())
    items = json.loads((run / "checkpoints" / newest / "MANIFEST.json").read_text())["body"]["items"]
    again = subprocess.run(launch(mpi, 3, cmd), cwd=REPO, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=120)
    assert again.returncode == 0, again.stdout[-3000:]
    check_resumed(again.stdout, run, before, newest, 3, steps, items)
    assert "done: steps 0..29, " in again.stdout
    final = int(re.search(r"^done: steps 0\.\.29, (\d+) items", again.stdout, re.M)[1])
    assert final == len({i for i in before if i // 1000 <= int(RESUME.search(again.stdout)[2])}) + \
        3 * (steps - 1 - int(RESUME.search(again.stdout)[2])), again.stdout
