#!/usr/bin/env python3
"""Start and stop a real single-node Slurm cluster by hand (no systemd), for tests and demos.

    python -m scripts.slurm.local_slurm start [--dir DIR] [--timeout 60]   # prints shell exports
    python -m scripts.slurm.local_slurm status --dir DIR
    python -m scripts.slurm.local_slurm stop --dir DIR [--keep]

``start`` writes into DIR (default: a new ``/tmp/gear-slurm-XXXX``): a random MUNGE key,
``slurm.conf`` and ``cgroup.conf`` (one node -- this host's CPUs as ``slurmd -C`` reports
them -- in one partition ``debug``, free TCP ports picked at start), state, spool and log
folders. It then runs ``munged``, ``slurmctld`` and ``slurmd`` in the foreground of their
own sessions (so their process ids are known: ``DIR/pids.json``) and waits until the node
is ``idle``. Clients find the cluster through ``SLURM_CONF=DIR/slurm.conf``; MUNGE's
socket is inside DIR (``AuthInfo=socket=...``), so a system munged is neither needed
nor touched. ``start`` prints ``export SLURM_CONF=...`` lines (``eval`` them).

``stop`` cancels every job (bounded wait), sends SIGTERM then SIGKILL to the daemons,
kills any slurmstepd left over from this cluster (found by a marker in its environment)
and removes DIR (``--keep`` leaves it, logs included).

Needs root (slurmd launches jobs as their user) and the Debian/Ubuntu packages
``slurmctld slurmd slurm-client munge`` (``--install`` runs apt-get for them).
Only the standard library is used, so any python3 runs it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge", "libpmix-dev")  # libpmix-dev: srun --mpi=pmix
DAEMONS = ("munged", "slurmctld", "slurmd")
MARKER = "GEAR_LOCAL_SLURM_DIR"   # put in the daemons' environment; slurmstepd inherits it
PARTITION = "debug"


class ClusterError(RuntimeError):
    pass


# ---- helpers ---------------------------------------------------------------------------
def missing_programs() -> list[str]:
    return [p for p in ("munged", "slurmctld", "slurmd", "sbatch", "srun", "sinfo", "scontrol", "scancel")
            if shutil.which(p) is None]


def install_packages(timeout: float = 600.0) -> None:
    """apt-get install the Slurm and MUNGE packages (non-interactive; daemons are not started
    by the package scripts where policy-rc.d forbids it, and we never rely on them)."""
    if os.geteuid() != 0:
        raise ClusterError("installing Slurm needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    notes = []
    # a failed `update` is noted, not fatal: the package lists already there may do
    for cmd in (["apt-get", "update", "-q"],
                ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        try:
            r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               timeout=timeout)
            ok, out = r.returncode == 0, f"exited {r.returncode}:\n{r.stdout[-1500:]}"
        except (OSError, subprocess.TimeoutExpired) as e:
            ok, out = False, f"failed: {e}"
        if not ok:
            notes.append(f"{' '.join(cmd)} {out}")
            if cmd[1] == "install":
                raise ClusterError("\n".join(notes))
    if missing_programs():
        raise ClusterError(f"still missing after apt-get: {missing_programs()}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line(hostname: str) -> str:
    """The hardware part of this host's NodeName line, from ``slurmd -C``."""
    try:
        out = subprocess.run(["slurmd", "-C"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    for line in out.splitlines():
        if line.startswith("NodeName="):
            fields = [f for f in line.split()[1:] if not f.startswith(("RealMemory=", "UpTime="))]
            return " ".join(fields)
    return f"CPUs={os.cpu_count() or 1}"


def gpu_devices() -> list[str]:
    return sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))


def client_env(directory: Path, base: dict | None = None) -> dict:
    env = dict(os.environ if base is None else base)
    env["SLURM_CONF"] = str(directory / "slurm.conf")
    return env


def fnv1a32(text: str) -> int:
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def mpich_segments(first_job: int, next_job: int, steps: int = 32) -> set[str]:
    """Names in /dev/shm that MPICH (4.2+) gives the node-shared memory of job steps
    ``first_job <= id < next_job``: ``mpich_shm_<FNV-1a of the PMI kvsname>_<node>``, and
    under srun the kvsname is ``<jobid>.<stepid>`` (the batch step included)."""
    names = set()
    for job in range(first_job, next_job):
        for step in [*range(steps), 0xFFFFFFFB, 0xFFFFFFFE]:
            h = fnv1a32(f"{job}.{step}")
            names |= {f"mpich_shm_{h:x}_0", f"mpich_vci_{h:x}_0"}
    return names



def cluster_conf(d: Path, name: str, controller: str, ports: tuple[int, int], nodes: str, partition: str,
                 first_job: int, *, per_node: bool, origin: str) -> str:
    """The text of a slurm.conf for a cluster kept under ``d`` (munge socket, state, spool, logs, pids).

    ``controller`` is ``SlurmctldHost`` (``name(address)``), ``ports`` the slurmctld and slurmd ports,
    ``nodes`` the NodeName lines (and any GresTypes), ``partition`` the PartitionName line.
    ``per_node``: several slurmd share ``d`` (spool, pid and log files named after the node).
    No systemd, no accounting, proctrack by process list: what a hand-started cluster can run.
    """
    n = ".%n" if per_node else ""
    return f"""# generated by {origin}, no systemd, no accounting
ClusterName={name}
SlurmctldHost={controller}
SlurmctldPort={ports[0]}
SlurmdPort={ports[1]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool{"/%n" if per_node else ""}
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd{n}.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd{n}.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS={d}/tmp
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
InactiveLimit=0
KillWait=5
# a random first job id, not 1: MPICH names its node segment after the job step, and a segment of
# another cluster's job may be left in /dev/shm
FirstJobId={first_job}
# sbatch --wait polls every 2 s while MinJobAge/2 <= 2 (else 2, 8, 32 s: slow tests), and a job
# must outlive one poll after it ends (else sbatch reports "no longer found" and exit 0)
MinJobAge=5
MessageTimeout=30
SlurmctldTimeout=30
SlurmdTimeout=60
{nodes}{partition}
"""

def write_config(d: Path, gpus: bool) -> dict:
    host = socket.gethostname().split(".")[0]
    # Job ids start at a random number, not 1: MPICH names its node-shared memory after the
    # job step ("<jobid>.<step>"), so a step killed in an earlier cluster (its segment left in
    # /dev/shm) or a second cluster on this host must never reuse an id -- MPICH would attach
    # to the other job's segment and fail in MPI_Init ("Message truncated", UCX "failed to
    # unpack address") or hang.
    first_job = int.from_bytes(os.urandom(4), "little") % 60_000_000 + 1_000_000
    ctld_port, slurmd_port = free_port(), free_port()
    while slurmd_port == ctld_port:
        slurmd_port = free_port()
    for sub in ("state", "spool", "log", "run", "tmp", "munge"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755)
    os.chmod(d / "munge", 0o755)   # munged wants the socket directory searchable by all
    key = d / "munge" / "munge.key"
    with open(os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o400), "wb") as f:
        f.write(os.urandom(1024))
    sock = d / "munge" / "munge.socket"
    gres = ""
    devices = gpu_devices() if gpus else []
    if devices:
        gres = f" Gres=gpu:{len(devices)}"
        (d / "gres.conf").write_text("AutoDetect=off\n" + "".join(f"Name=gpu File={dev}\n" for dev in devices))
    nodes = (("GresTypes=gpu\n" if devices else "") +
             f"NodeName={host} NodeAddr=127.0.0.1 NodeHostname={host} {node_line(host)}{gres} State=UNKNOWN\n")
    conf = cluster_conf(d, "gearlocal", f"{host}(127.0.0.1)", (ctld_port, slurmd_port), nodes,
                        f"PartitionName={PARTITION} Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                        first_job, per_node=False, origin="scripts/slurm/local_slurm.py -- one node")
    (d / "slurm.conf").write_text(conf)
    # Only read by cgroup plugins; none is configured above (containers rarely allow them),
    # but Slurm tools look for the file next to slurm.conf.
    (d / "cgroup.conf").write_text("# generated by scripts/slurm/local_slurm.py\nCgroupPlugin=autodetect\n"
                                   "IgnoreSystemd=yes\nConstrainCores=no\nConstrainDevices=no\n"
                                   "ConstrainRAMSpace=no\n")
    return {"host": host, "ctld_port": ctld_port, "slurmd_port": slurmd_port, "munge_socket": str(sock),
            "first_job_id": first_job}


def _spawn(d: Path, name: str, cmd: list[str]) -> int:
    env = dict(os.environ, SLURM_CONF=str(d / "slurm.conf"), **{MARKER: str(d)})
    log = open(d / "log" / f"{name}.out", "ab")
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                         start_new_session=True, close_fds=True)
    log.close()
    return p.pid


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _is_ours(pid: int, d: Path) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARKER}={d}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def node_state(d: Path, timeout: float = 10.0) -> str:
    try:
        r = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], env=client_env(d), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "(sinfo timed out)"
    return r.stdout.strip() if r.returncode == 0 else f"(sinfo failed: {r.stdout.strip()})"


# ---- start / stop ----------------------------------------------------------------------
def start(directory: str | os.PathLike | None = None, timeout: float = 60.0, gpus: bool = False,
          install: bool = False) -> Path:
    """Start munged, slurmctld and slurmd; return the cluster directory once the node is idle.
    On any failure everything started is stopped again and ClusterError is raised."""
    if os.geteuid() != 0:
        raise ClusterError("a local Slurm cluster needs root (slurmd runs jobs as their user)")
    if missing_programs():
        if not install:
            raise ClusterError(f"missing programs {missing_programs()}: apt-get install {' '.join(PACKAGES)}"
                               " (or pass --install)")
        install_packages()
    d = Path(directory) if directory else Path(tempfile.mkdtemp(prefix="gear-slurm-"))
    d = d.resolve()
    d.mkdir(parents=True, exist_ok=True)
    if (d / "pids.json").exists():
        raise ClusterError(f"{d} already holds a cluster (pids.json); stop it first")
    info = write_config(d, gpus)
    pids: dict[str, int] = {}

    def save() -> None:
        (d / "pids.json").write_text(json.dumps({"pids": pids, **info}, indent=1))

    try:
        pids["munged"] = _spawn(d, "munged", [
            "munged", "--foreground", "--force", f"--key-file={d}/munge/munge.key",
            f"--socket={info['munge_socket']}", f"--pid-file={d}/munge/munged.pid",
            f"--log-file={d}/log/munged.log", f"--seed-file={d}/munge/munged.seed"])
        save()
        deadline = time.monotonic() + timeout
        while not Path(info["munge_socket"]).exists():
            if not _alive(pids["munged"]) or time.monotonic() > deadline:
                raise ClusterError(f"munged did not start:\n{_tail(d / 'log' / 'munged.out')}\n"
                                   f"{_tail(d / 'log' / 'munged.log')}")
            time.sleep(0.1)
        pids["slurmctld"] = _spawn(d, "slurmctld", ["slurmctld", "-D", "-c", "-i", "-f", str(d / "slurm.conf")])
        save()
        pids["slurmd"] = _spawn(d, "slurmd", ["slurmd", "-D", "-f", str(d / "slurm.conf"), "-N", info["host"]])
        save()
        state = ""
        while True:
            for name, pid in pids.items():
                if not _alive(pid):
                    log = d / "log" / (f"{name}.log" if name != "munged" else "munged.log")
                    raise ClusterError(f"{name} exited during start-up:\n{_tail(d / 'log' / f'{name}.out')}\n"
                                       f"{_tail(log)}")
            state = node_state(d)
            if state.startswith("idle"):
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"node not idle after {timeout:.0f} s (sinfo: {state!r});\nslurmctld log:\n"
                                   f"{_tail(d / 'log' / 'slurmctld.log')}\nslurmd log:\n{_tail(d / 'log' / 'slurmd.log')}")
            time.sleep(0.5)
        return d
    except ClusterError as e:
        stop(d, keep=True)
        raise ClusterError(f"{e}\n(configuration and logs kept in {d})") from None
    except BaseException:
        stop(d, keep=True)
        raise


def stop(directory: str | os.PathLike, keep: bool = False, timeout: float = 20.0) -> list[str]:
    """Cancel jobs, stop the daemons (SIGTERM, then SIGKILL), kill leftover slurmstepds of this
    cluster, and remove the directory unless ``keep``. Returns a list of what was killed."""
    d = Path(directory).resolve()
    killed: list[str] = []
    meta = d / "pids.json"
    if not meta.exists():
        return killed
    info = json.loads(meta.read_text())
    pids = info["pids"]
    next_job = info.get("first_job_id", 0)
    if _alive(pids.get("slurmctld", -1)):
        try:
            r = subprocess.run(["scontrol", "show", "config"], env=client_env(d), stdout=subprocess.PIPE,
                               stderr=subprocess.DEVNULL, text=True, timeout=10)
            for line in r.stdout.splitlines():
                if line.split("=")[0].strip() == "NEXT_JOB_ID":
                    next_job = int(line.split("=")[1])
        except (OSError, ValueError, subprocess.TimeoutExpired):
            pass
        try:
            subprocess.run(["scancel", "--full", f"--partition={PARTITION}"], env=client_env(d),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
            end = time.monotonic() + 10
            while time.monotonic() < end:
                r = subprocess.run(["squeue", "-h", "-o", "%i"], env=client_env(d), stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True, timeout=10)
                if r.returncode != 0 or not r.stdout.strip():
                    break
                time.sleep(0.5)
        except (OSError, subprocess.TimeoutExpired):
            pass
    # slurmd, then slurmctld, then munged (the others need munge to say goodbye)
    for name in ("slurmd", "slurmctld", "munged"):
        pid = pids.get(name)
        if pid is None or not _alive(pid) or not _is_ours(pid, d):
            continue
        os.kill(pid, signal.SIGTERM)
        end = time.monotonic() + timeout / 2
        while _alive(pid) and time.monotonic() < end:
            _reap(pid)
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            killed.append(f"{name} ({pid}, SIGKILL)")
        else:
            killed.append(f"{name} ({pid})")
        _reap(pid)
    # anything else carrying this cluster's marker: slurmstepd of jobs cancelled too late
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != me and _is_ours(int(entry.name), d):
            pid = int(entry.name)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(f"stray {pid}")
            except ProcessLookupError:
                pass
    # MPICH shared memory left in /dev/shm by steps of this cluster that were killed
    first_job = info.get("first_job_id", 0)
    if first_job and next_job > first_job:
        ours = {n for n in mpich_segments(first_job, min(next_job, first_job + 1000))
                if os.path.exists(f"/dev/shm/{n}")}
        if ours:
            mapped = set()
            for maps in Path("/proc").glob("[0-9]*/maps"):
                try:
                    mapped |= {n for n in ours if n in maps.read_text()}
                except OSError:
                    pass
            for n in sorted(ours - mapped):
                try:
                    os.unlink(f"/dev/shm/{n}")
                    killed.append(f"/dev/shm/{n}")
                except OSError:
                    pass
    meta.unlink()
    if not keep:
        shutil.rmtree(d, ignore_errors=True)
    return killed


def status(directory: str | os.PathLike) -> dict:
    d = Path(directory).resolve()
    meta = d / "pids.json"
    if not meta.exists():
        return {"dir": str(d), "running": False}
    pids = json.loads(meta.read_text())["pids"]
    alive = {name: _alive(pid) and _is_ours(pid, d) for name, pid in pids.items()}
    return {"dir": str(d), "running": all(alive.values()), "daemons": alive,
            "node": node_state(d) if alive.get("slurmctld") else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("start", help="start munged, slurmctld, slurmd; wait until the node is idle")
    a.add_argument("--dir", help="cluster directory (default: a new /tmp/gear-slurm-XXXX)")
    a.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the node to be idle")
    a.add_argument("--gpus", action="store_true",
                   help="declare this host's /dev/nvidia[0-9]* as gres gpu (then sbatch --gpus-per-node=G works)")
    a.add_argument("--install", action="store_true", help=f"apt-get install {' '.join(PACKAGES)} if missing")
    b = sub.add_parser("stop", help="cancel jobs, kill the daemons, remove the directory")
    b.add_argument("--dir", required=True)
    b.add_argument("--keep", action="store_true", help="keep the directory (logs)")
    c = sub.add_parser("status", help="which daemons run; the node's state")
    c.add_argument("--dir", required=True)
    args = ap.parse_args(argv)
    try:
        if args.cmd == "start":
            d = start(args.dir, args.timeout, gpus=args.gpus, install=args.install)
            print(f"export SLURM_CONF={d}/slurm.conf")
            print(f"# stop with: {sys.executable} -m scripts.slurm.local_slurm stop --dir {d}", file=sys.stderr)
        elif args.cmd == "stop":
            for what in stop(args.dir, keep=args.keep):
                print(f"stopped/removed {what}")
        else:
            print(json.dumps(status(args.dir), indent=1))
    except ClusterError as e:
        print(f"local_slurm: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
