"""A real single-node Slurm cluster: slurm/replay_sample.sbatch runs a 2-rank replay job.

The cluster (munged, slurmctld, slurmd from Debian's packages, configured in a temporary
directory) is started by scripts/slurm/local_slurm.py and stopped in the fixture's teardown,
which also checks that no daemon of it is left running. Skips where the test cannot be
root, or Slurm is missing and apt-get cannot install it. Every wait is bounded.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.slurm import local_slurm  # the repository root is on sys.path (pyproject: pythonpath)

REPO = Path(__file__).resolve().parents[1]
SBATCH = REPO / "slurm" / "replay_sample.sbatch"
JOB_TIMEOUT_S = 120      # sbatch --wait, whole job
LINE = re.compile(r"^rank (\d+) of (\d+): sampled (\d+), total (\d+)$", re.M)




def clean_env(cluster: Path) -> dict:
    """This process's environment without any outer Slurm/PMI job's variables, pointed at ``cluster``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "PMI_", "PMIX_", "HYDRA_"))}
    env["SLURM_CONF"] = str(cluster / "slurm.conf")
    return env


@pytest.fixture(scope="module")
def cluster():
    if sys.platform != "linux":
        pytest.skip("a local Slurm cluster needs Linux")
    if os.geteuid() != 0:
        pytest.skip("a local Slurm cluster needs root (slurmd runs jobs as their user, munged needs its key)")
    if local_slurm.missing_programs():
        if shutil.which("apt-get") is None:
            pytest.skip(f"Slurm is not installed ({local_slurm.missing_programs()} missing) and there is no apt-get")
        try:
            local_slurm.install_packages(timeout=300)
        except local_slurm.ClusterError as e:
            pytest.skip(f"cannot install Slurm with apt-get: {str(e)[:500]}")
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
