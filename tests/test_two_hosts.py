"""gear_mpi on two "hosts" made on this machine, launched by the MPI runtime itself.

scripts/hosts/two_hosts.py makes two hosts: network namespaces joined by a veth pair, each
with its own hostname (UTS namespace) and its own /dev/shm (a mount namespace with a fresh
tmpfs). MPICH's hydra ``mpiexec`` runs on the first host and starts its proxies with
``-launcher ssh -launcher-exec scripts/hosts/ns_ssh``, which enters the named host's
namespaces as ssh would log into it; hydra reaches the proxies over the link (``-iface``),
MPICH splits ``COMM_TYPE_SHARED`` per host, and ranks of different hosts talk over the link.

One 4-rank job (2 per host) runs tests/mpi/test_hosts_replay.py (node detection, per-host
/dev/shm, which path windows take, every mode and selector bit-exact) and, across the hosts,
tests/mpi/test_windows.py (global weights and order, priority updates) and
tests/mpi/test_distribution.py (chi-square of the decentralized and centralized modes).
Then, where Slurm is installed, a two-node cluster on the same hosts (one slurmd in each,
scripts/hosts/two_host_slurm.py) runs the node and window-path checks in an
``sbatch -N 2`` allocation. docs/TWO_HOSTS.md has the details and the figures.

Skips, with the reason, where the hosts cannot be made: not Linux, not root, a missing
program (ip, unshare, nsenter), or the kernel refusing namespaces (``Operation not
permitted``); ``GEAR_MPI_SKIP_HOSTS=1`` skips on purpose. The hosts, their processes and
the link are removed after the tests, and on any failure (checked here).
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mpi_util import CHILD_PYTEST_PLUGINS_OFF, MpiPytestRun, _read_junit, mpiexec_path
from scripts.hosts import two_host_slurm, two_hosts
from scripts.hosts.two_hosts import HostsError, TwoHosts

REPO = Path(__file__).resolve().parents[1]
MPI_TESTS = REPO / "tests" / "mpi"
SKIP_VAR = "GEAR_MPI_SKIP_HOSTS"
RANKS_PER_HOST = 2
JOB_TIMEOUT_S = 150   # the whole 4-rank job; it takes ~25-40 s on the 2-core CI machine
MODULES = ["test_hosts_replay.py",
           "test_windows.py::test_exact_windows_weights_and_order",
           "test_windows.py::test_priority_updates_reach_owners_and_stale_keys_are_dropped",
           "test_distribution.py"]
REFUSED = ("Operation not permitted", "Permission denied", "not permitted")
SLURM_SKIP_VAR = "GEAR_MPI_SKIP_SLURM"   # as in tests/test_slurm.py
SLURM_TIMEOUT_S = 120


def skip_reason(env, platform: str, uid: int, missing: list[str]) -> str | None:
    """Why two hosts cannot (or must not) be made here; None: go on. Pure: the caller passes the facts."""
    if env.get(SKIP_VAR, "").strip().lower() not in ("", "0", "no", "false"):
        return f"{SKIP_VAR} is set: the two-host tests are skipped"
    if platform != "linux":
        return "two hosts on one machine need Linux namespaces"
    if uid != 0:
        return f"making network namespaces needs root (running as uid {uid})"
    if missing:
        return f"missing programs to make the hosts: {missing} (Debian: iproute2, util-linux)"
    return None


@pytest.fixture(scope="module")
def hosts():
    reason = skip_reason(os.environ, sys.platform, os.geteuid() if hasattr(os, "geteuid") else -1,
                         two_hosts.missing_programs())
    if reason:
        pytest.skip(reason)
    h = TwoHosts()
    try:
        h.up()
    except HostsError as e:
        if any(s in str(e) for s in REFUSED):   # a sandbox that forbids namespaces: nothing to test here
            pytest.skip(f"namespaces cannot be made here: {e}")
        raise
    try:
        yield h
    finally:
        holders = [x.pid for x in h.hosts]
        problems = h.down()
        assert not problems, problems
        assert_gone(h, holders)


def assert_gone(h: TwoHosts, holders: list[int]) -> None:
    """Nothing of ``h`` is left: namespaces, holders, processes that ran on the hosts, the folder."""
    left = set(two_hosts.namespaces()) & {x.netns for x in h.hosts}
    assert not left, f"namespaces left: {left}"
    alive = [p for p in holders if p and two_hosts.process_alive(p)]
    assert not alive, f"holder processes left: {alive}"
    marked = two_hosts.marked_pids(h.dir)
    assert not marked, f"processes that ran on the hosts are left: {marked}"
    assert not h.dir.exists(), f"{h.dir} was not removed"


def _pytest_program(args: list[str]) -> list[str]:
    args = [str(MPI_TESTS / a) if a.startswith("test_") else a for a in args]
    return [sys.executable, "-m", "pytest", "-q", "-x", *CHILD_PYTEST_PLUGINS_OFF, *args]


def _job_env(h: TwoHosts, env: dict, reports: str) -> dict:
    env = dict(env)
    env.pop("PYTHONUNBUFFERED", None)
    env.update(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1", GEAR_MPI_REPORT_DIR=reports,
               GEAR_MPI_TWO_HOSTS=",".join(x.name for x in h.hosts), **two_hosts.MPI_ENV)
    return env


def _collect(run: MpiPytestRun, reports: str) -> dict[str, list[str]]:
    for r in range(run.nprocs):
        _read_junit(Path(reports) / f"rank{r}.xml", r, run)
    return {p.stem[4:]: p.read_text().split() for p in Path(reports).glob("shm-*.txt")}


def _launch(h: TwoHosts, cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """Run ``cmd``; on timeout kill it, and every process that ran on the hosts, and return None."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        two_hosts._kill_all(lambda: [p for p in two_hosts.marked_pids(h.dir) if p not in {x.pid for x in h.hosts}],
                            5.0)
        return None, proc.communicate()[0]


def run_on_hosts(h: TwoHosts, args: list[str], timeout: float) -> tuple[MpiPytestRun, dict[str, list[str]]]:
    """``mpiexec`` on the hosts (2 ranks each) running pytest on ``args`` (tests/mpi modules), each rank
    writing its JUnit report; on timeout the job is killed (and the hosts' processes with it).

    Returns:
        The run, and what each host's /dev/shm held (hostname -> names; written by
        test_hosts_replay.py's first rank of each host).
    """
    with tempfile.TemporaryDirectory(prefix="gear_mpi_reports_") as reports:
        cmd = h.mpiexec(mpiexec_path(), RANKS_PER_HOST, _pytest_program(args), wd=REPO, extra=["-prepend-rank"])
        code, out = _launch(h, cmd, _job_env(h, h.env(), reports), timeout)
        run = MpiPytestRun(RANKS_PER_HOST * len(h.hosts), ["mpiexec", *cmd[cmd.index("-launcher"):]], code, out)
        return run, _collect(run, reports)


def run_under_slurm(h: TwoHosts, args: list[str], timeout: float) -> tuple[MpiPytestRun, dict[str, list[str]]]:
    """``sbatch --wait -N 2 --ntasks-per-node=2`` (from the first host) of MPICH's ``mpiexec`` running
    pytest on ``args``, on the cluster of scripts/hosts/two_host_slurm.py; as :func:`run_on_hosts`.

    Inside the allocation hydra reads the nodes from Slurm and starts its proxies with ``srun``. Not
    ``srun --mpi=pmi2`` for the ranks: Slurm 22.05's PMI-2 server garbled MPICH 5's segmented
    allgather of the inter-node (UCX) addresses in 2 of about 12 runs here (``mpi/pmi2: value not
    properly terminated in client request``) and the job hung (docs/TWO_HOSTS.md)."""
    with tempfile.TemporaryDirectory(prefix="gear_mpi_reports_") as reports:
        out_file = h.dir / "slurm" / "job-%j.out"
        srun = [mpiexec_path(), "-n", str(RANKS_PER_HOST * len(h.hosts)), "-prepend-rank", *_pytest_program(args)]
        cmd = h.on(0, ["sbatch", "--wait", "--parsable", "-N", str(len(h.hosts)), f"--ntasks-per-node={RANKS_PER_HOST}",
                       "-O", "--time=3", f"--chdir={REPO}", f"--output={out_file}", "--export=ALL",
                       "--wrap", " ".join(shlex.quote(w) for w in srun)])
        code, out = _launch(h, cmd, _job_env(h, two_host_slurm.client_env(h), reports), timeout)
        job = out.strip().splitlines()[0].split(";")[0] if out.strip() else "?"
        path = Path(str(out_file).replace("%j", job))
        out += path.read_text(errors="replace") if path.exists() else f"(no job output {path})"
        run = MpiPytestRun(RANKS_PER_HOST * len(h.hosts), cmd[cmd.index("sbatch"):], code, out)
        return run, _collect(run, reports)


def check_host_shm(h: TwoHosts, host_shm: dict[str, list[str]]) -> None:
    """Each host had its own /dev/shm, with MPICH's node segment in it; none of it is in the machine's."""
    assert sorted(host_shm) == sorted(x.name for x in h.hosts), host_shm
    for name, listing in host_shm.items():
        assert any(n.startswith("mpich_shm_") for n in listing), (name, listing)
        assert not set(listing) & set(os.listdir("/dev/shm")), (name, listing)


def test_gear_mpi_on_two_hosts(hosts):
    started = time.time()
    link_before = hosts.link_bytes()
    run, host_shm = run_on_hosts(hosts, MODULES, JOB_TIMEOUT_S)
    link_bytes = hosts.link_bytes() - link_before
    if run.problems():
        pytest.fail(run.report(), pytrace=False)
    check_host_shm(hosts, host_shm)
    ran = run.passed(0)
    per_module = {m: sum(t.startswith(m + "::") for t in ran)
                  for m in ("test_hosts_replay", "test_windows", "test_distribution")}
    # none skipped or deselected: 4 layout tests, 2 window-path modes, 3 modes x 6 selectors; 2 modes x 6
    # selectors + priority updates; 2 modes x 2 selectors
    assert per_module == {"test_hosts_replay": 4 + 2 + 18, "test_windows": 12 + 1, "test_distribution": 4}, \
        sorted(ran)
    assert len(ran) == sum(per_module.values()), sorted(ran)
    # the windows, headers and chi-square draws of the other host really crossed the link
    assert link_bytes > 100_000, link_bytes
    print(f"two hosts: {len(ran)} tests on 4 ranks in {time.time() - started:.1f} s, {link_bytes} bytes over the link")


def test_failure_on_the_hosts_leaves_nothing_behind(hosts):
    """A job that fails (a rank exits 3 on the second host) is reported; then a separate pair of
    hosts with a process left running inside is torn down by an exception: nothing survives."""
    r = subprocess.run(hosts.mpiexec(mpiexec_path(), 1, ["sh", "-c", 'test "$(hostname)" != gmhost-b || exit 3']),
                       env=hosts.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode != 0, r.stdout + r.stderr
    extra = TwoHosts(names=("gmhost-x", "gmhost-y"))
    sleeper = None
    with pytest.raises(RuntimeError, match="on purpose"):
        with extra:
            sleeper = subprocess.Popen(extra.on(1, ["sleep", "300"]), env=extra.env())
            raise RuntimeError("on purpose")
    assert sleeper is not None and sleeper.wait(timeout=5) == -signal.SIGKILL
    assert_gone(extra, [x.pid for x in extra.hosts])


def test_half_made_hosts_are_removed(hosts):
    """``up`` failing half way (the second namespace's name is taken) removes what it made."""
    h = TwoHosts()
    subprocess.run(["ip", "netns", "add", h.hosts[1].netns], check=True, timeout=10)
    with pytest.raises(HostsError, match="creating the network namespace of gmhost-b"):
        h.up()
    assert_gone(h, [])


def test_ns_ssh_refuses_unknown_hosts(hosts):
    r = subprocess.run([str(two_hosts.LAUNCHER), "-x", "nohost", "true"], env=hosts.env(), capture_output=True,
                       text=True, timeout=10)
    assert r.returncode == 255 and "unknown host 'nohost'" in r.stderr, r.stderr
    r = subprocess.run([str(two_hosts.LAUNCHER), "-x", "gmhost-b", "hostname; cat /proc/self/net/dev | grep -c gmh"],
                       env=hosts.env(), capture_output=True, text=True, timeout=10)
    assert r.returncode == 0 and r.stdout.split() == ["gmhost-b", "1"], r.stdout + r.stderr


def test_slurm_allocation_of_the_two_hosts(hosts):
    """Two slurmd, one in each host: ``sbatch -N 2 --ntasks-per-node=2`` + ``mpiexec`` (hydra over srun) runs the
    node and window-path checks of tests/mpi/test_hosts_replay.py (and one bit-exact case) across them.
    Last in this module: the cluster stays up until the hosts go down."""
    if os.environ.get(SLURM_SKIP_VAR, "").strip().lower() not in ("", "0", "no", "false"):
        pytest.skip(f"{SLURM_SKIP_VAR} is set")
    if two_host_slurm.missing_programs():
        pytest.skip(f"Slurm is not installed ({two_host_slurm.missing_programs()} missing; tests/test_slurm.py "
                    "installs it with apt-get, as root)")
    started = time.time()
    two_host_slurm.start(hosts, timeout=30)
    up = time.time() - started
    subset = ["test_hosts_replay.py", "-k", "not every_mode or decentralized-Prioritized"]
    run, host_shm = run_under_slurm(hosts, subset, SLURM_TIMEOUT_S)
    if run.problems():
        pytest.fail(run.report(), pytrace=False)
    check_host_shm(hosts, host_shm)
    ran = run.passed(0)
    assert len(ran) == 4 + 2 + 1 and all(t.startswith("test_hosts_replay::") for t in ran), sorted(ran)
    print(f"two-node Slurm: up in {up:.1f} s, {len(ran)} tests on 4 ranks, {time.time() - started:.1f} s in all")


@pytest.mark.parametrize("env, platform, uid, missing, expect", [
    ({SKIP_VAR: "1"}, "linux", 0, [], SKIP_VAR),
    ({}, "darwin", 0, [], "Linux"),
    ({}, "linux", 1000, [], "root"),
    ({}, "linux", 0, ["ip"], "missing programs"),
    ({SKIP_VAR: "0"}, "linux", 0, [], None),
])
def test_skip_reasons(env, platform, uid, missing, expect):
    reason = skip_reason(env, platform, uid, missing)
    assert (reason is None) if expect is None else (expect in reason), reason
