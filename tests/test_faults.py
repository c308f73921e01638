"""Faults under mpiexec: a rank killed during sample(), processes killed during save().

What MPICH's hydra launcher (the ``mpich`` wheel, 5.0) does when a rank dies
from a signal, as measured here and read in its proxy's source: the proxy
SIGKILLs every other rank of the job as soon as it reaps a rank that died from a
signal -- with or without ``-disable-auto-cleanup``. With
``-disable-auto-cleanup`` it first sends the survivors SIGUSR1, whose default
action terminates them. So:

- plain ``mpiexec``: the job is torn down; mpiexec exits non-zero within seconds
  and the survivors print nothing wrong (test 1);
- to see the survivors' own error, each rank runs under a shell that ignores
  SIGUSR1 (inherited by the rank) and exits normally when its rank is killed
  (so hydra reaps no signalled child): the survivors then raise
  CollectiveTimeoutError after ``timeout`` seconds, find the replay unusable, and
  exit (test 2).

A checkpoint written before the kill, or before a save that is killed midway
(after some files, or between the two renames that install it), loads in a
later job with every trajectory bit for bit (test 4). No job may hang, leave a
process behind, or leave a shared-memory segment in /dev/shm.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from mpi_util import PROGRAMS, _mapped_paths, mpiexec_path, passes, remove_leaked_mpich_segments

PROGRAM = str(PROGRAMS / "check_faults.py")
TIMEOUT = 4.0  # the replay's collective deadline in the kill scenario
SHELL = 'trap "" USR1; "$0" "$@"; exit $?'  # ignore hydra's SIGUSR1; exit (not die) when the rank is killed


@dataclass
class Job:
    returncode: int
    stdout: str
    stderr: str
    elapsed: float
    hung: bool
    leftovers: list

    @property
    def out(self) -> str:
        return self.stdout + self.stderr[-3000:]


def _session_members(sid: int) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(rest[3]) == sid and rest[0] != "Z":
            pids.append(int(pid))
    return pids


def _gear_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("gear_mpi_")}


def _created_since(name: str, since: float) -> bool:
    try:
        return os.stat(f"/dev/shm/{name}").st_ctime >= since - 1
    except OSError:
        return False


def run_job(args: list[str], limit: float) -> Job:
    """Run a job in its own session; kill the whole session if it outlives ``limit`` (a hang).

    Afterwards: no process of the session may remain, MPICH segments of ranks
    that died unfinalized are removed, and no gear_mpi segment may be left.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    before = _gear_segments()
    started, t0 = time.time(), time.monotonic()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    hung = False
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        hung = True
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    elapsed = time.monotonic() - t0
    leftovers = _session_members(proc.pid)
    for _ in range(50):  # give stragglers a moment, then record and kill them
        if not leftovers:
            break
        time.sleep(0.1)
        leftovers = _session_members(proc.pid)
    if leftovers:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    remove_leaked_mpich_segments(started)
    mapped = _mapped_paths()
    leaked = [n for n in _gear_segments() - before if f"/dev/shm/{n}" not in mapped and _created_since(n, started)]
    assert not leaked, f"shared-memory segments left behind: {leaked}"
    return Job(proc.returncode, out, err, elapsed, hung, leftovers)


def mpiexec(nprocs: int, *args: str, keep_survivors: bool = False) -> list[str]:
    if keep_survivors:
        return [mpiexec_path(), "-disable-auto-cleanup", "-n", str(nprocs), "sh", "-c", SHELL, sys.executable,
                PROGRAM, *args]
    return [mpiexec_path(), "-n", str(nprocs), sys.executable, PROGRAM, *args]


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """Run every fault job once; the tests below read their results."""
    base = tmp_path_factory.mktemp("faults")
    (base / "files").mkdir()
    (base / "rename").mkdir()
    jobs = {
        "plain": run_job(mpiexec(3, "kill", str(base), str(TIMEOUT), "kill-plain"), 120),
        "kept": run_job(mpiexec(3, "kill", str(base), str(TIMEOUT), "kill-kept", keep_survivors=True), 120),
        "files": run_job(mpiexec(2, "crash-save", str(base / "files"), "files"), 120),
        "rename": run_job(mpiexec(2, "crash-save", str(base / "rename"), "rename"), 120),
    }
    return base, jobs


def no_hang(job: Job) -> None:
    assert not job.hung, f"the job hung (killed after {job.elapsed:.0f}s)\n{job.out}"
    assert not job.leftovers, f"processes left behind: {job.leftovers}"
    assert "WRONG" not in job.stdout, job.out


def test_killed_rank_tears_down_the_job_without_a_hang(faults):
    _, jobs = faults
    job = jobs["plain"]
    no_hang(job)
    assert job.returncode != 0, job.out
    got = passes(job.stdout)
    assert {f"PASS sampled-before-kill rank={r}" for r in range(3)} <= got, job.out
    assert job.stdout.count("SAVED kill-plain") == 3, job.out
    # the launcher kills the survivors at once, or they time out first: both well within the limit
    assert job.elapsed < 60, job.elapsed


def test_survivors_of_a_killed_rank_raise_a_clear_error(faults):
    _, jobs = faults
    job = jobs["kept"]
    no_hang(job)
    got = passes(job.stdout)
    for r in (0, 1):
        assert f"PASS survivor-timeout rank={r}" in got, job.out
    for line in job.stdout.splitlines():
        if line.startswith("PASS survivor-timeout"):
            took = float(line.split("took=")[1].split("s")[0])
            assert TIMEOUT - 0.5 <= took <= TIMEOUT + 5, line
            assert f"not every rank of 3 arrived within timeout={TIMEOUT:g} s" in line, line
    assert job.returncode != 0, job.out  # the killed rank's status


@pytest.mark.parametrize("mode", ["files", "rename"])
def test_killed_save_leaves_the_previous_checkpoint(faults, mode):
    base, jobs = faults
    job = jobs[mode]
    no_hang(job)
    assert job.stdout.count("SAVED cp") == 2, job.out  # the first save completed on both ranks
    assert job.returncode != 0, job.out
    d = base / mode
    tmps = [p for p in os.listdir(d) if p.startswith("cp.tmp-")]
    if mode == "files":  # killed while writing: the previous checkpoint is untouched
        assert (d / "cp" / "MANIFEST.json").is_file()
        assert not (d / "cp.old").exists()
        for t in tmps:  # a partial save never looks whole
            assert not (d / t / "MANIFEST.json").exists()
    else:  # killed between the renames: only cp.old, which load() takes
        assert not (d / "cp").exists() and (d / "cp.old" / "MANIFEST.json").is_file()


def test_checkpoints_from_crashed_jobs_load_bit_exact(faults):
    base, jobs = faults
    for name in ("plain", "kept", "files", "rename"):
        assert "SAVED" in jobs[name].stdout, jobs[name].out
    job = run_job(mpiexec(2, "verify", str(base), "kill-plain", "kill-kept", "files/cp", "rename/cp"), 180)
    assert job.returncode == 0 and not job.hung, job.out
    got = passes(job.stdout)
    want = {f"PASS verify/{n}/{k}to2 rank={r}" for n, k in (("kill-plain", 3), ("kill-kept", 3), ("files/cp", 2),
                                                            ("rename/cp", 2)) for r in range(2)}
    assert want <= got, job.out
