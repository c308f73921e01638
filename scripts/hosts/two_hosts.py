#!/usr/bin/env python3
"""Two "hosts" on this machine, joined by a network link, for multi-node MPI tests.

    python -m scripts.hosts.two_hosts up [--dir DIR]          # prints exports and an mpiexec line
    python -m scripts.hosts.two_hosts run --dir DIR -- CMD... # runs CMD on the first host
    python -m scripts.hosts.two_hosts down --dir DIR
    python -m scripts.hosts.two_hosts clean                   # hosts left behind by dead owners
    python -m scripts.hosts.two_hosts job [--ranks-per-host N] -- PROGRAM...  # up, mpiexec PROGRAM, down

Each host is a set of namespaces held by one sleeping process (its *holder*):

- a network namespace (``ip netns add``) with ``lo`` and one end of a veth pair that joins
  the two hosts (198.18.0.1/30 and 198.18.0.2/30, the benchmarking range: nothing else on
  the machine or outside it is reachable from a host, and no route leaves it);
- a UTS namespace with its own hostname (``gmhost-a``, ``gmhost-b``);
- a mount namespace with a fresh tmpfs on ``/dev/shm`` (so POSIX shared memory, MPICH's and
  gear_mpi's, is per host, as on two machines), an ``/etc/hosts`` naming both hosts, and the
  sysfs of its own network namespace (the machine's cgroup tree kept under it).

Anything started with ``nsenter --target HOLDER --net --uts --mount`` runs "on" that host.
``scripts/hosts/ns_ssh`` does that for MPICH's hydra, standing in for ssh:

    mpiexec -launcher ssh -launcher-exec scripts/hosts/ns_ssh -iface <veth of host a> \\
            -hosts gmhost-a:2,gmhost-b:2 -n 4 -genv UCX_TLS tcp python ...

started on the first host (:meth:`TwoHosts.mpiexec` builds the line), so that hydra reaches its
proxies over the link; ns_ssh finds the holders through ``GEAR_MPI_HOSTS_DIR`` (this object's
folder). ``UCX_TLS=tcp``: see :data:`MPI_ENV`.

Lifetime: a holder exits by itself when the process that made the hosts (its *owner*) is
gone (``tail --pid``; the command line's ``up`` has no owner: its hosts stay until ``down``).
:meth:`TwoHosts.down` (also run when :meth:`TwoHosts.up` fails half way, and on leaving the
``with`` block) kills every process inside either host, deletes the namespaces (the veth pair
goes with them, and the tmpfs with its segments with the last process), and removes the
folder. ``clean`` (and every ``up``) also removes hosts whose owner died without ``down``.
Namespace names carry the owner's pid: ``gmh<pid>-<n>-<a|b>``.

Needs root, ``ip`` (iproute2), ``unshare``, ``nsenter`` and ``tail`` (util-linux, coreutils).
Only the standard library is used, so any python3 runs it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gear_mpi.feeds import process_alive

HERE = Path(__file__).resolve().parent
LAUNCHER = HERE / "ns_ssh"
DIR_VAR = "GEAR_MPI_HOSTS_DIR"          # the launcher's way to the holders; also marks the hosts' processes
NAME_RE = re.compile(r"^gmh(\d+)-(\d+)-([ab])$")
PREFIX = "198.18.0."                    # RFC 2544 benchmarking range; /30 between the two hosts
_serial = itertools.count()
#: given to every rank by :meth:`TwoHosts.mpiexec`. The hosts share one kernel, and UCX (MPICH's
#: inter-node netmod) would otherwise reach the other host's ranks through shared memory or
#: cross-memory attach (same boot id, same pid namespace), never touching the link: TCP only, as
#: between two machines. MPICH's own intra-node shared memory (per host) is unaffected.
MPI_ENV = {"UCX_TLS": "tcp"}

# The holder: set the hostname, mount a fresh /dev/shm, the hosts file and the sysfs of its own
# network namespace (as `ip netns exec` does, so /sys/class/net shows the host's own links) with
# the machine's cgroup tree moved back under it (slurmd needs /sys/fs/cgroup), say so, then sleep
# until the owner is gone. Run by `nsenter --net=/run/netns/NS unshare --uts --mount sh -c ...`,
# which all exec: the holder's pid is the pid of the Popen.
HOLDER = r"""set -e
hostname "$1"
mount -t tmpfs -o size="$2",mode=1777 gear-hosts-shm /dev/shm
mount --bind "$3" /etc/hosts
if [ -d /sys/fs/cgroup ]; then mkdir -p "$5"; mount --rbind /sys/fs/cgroup "$5"; fi
mount -t sysfs gear-hosts-sys /sys
if [ -d "$5" ]; then mount --move "$5" /sys/fs/cgroup; fi
echo "ready $$"
if [ "$4" = 0 ]; then exec sleep infinity; fi
exec tail --pid="$4" -f /dev/null >/dev/null 2>&1
"""


class HostsError(RuntimeError):
    """The hosts could not be made (the message says which step failed and what it printed)."""


@dataclass
class Host:
    """One host: its hostname, its address on the link, its namespace and veth names, its holder."""
    name: str
    address: str
    netns: str
    veth: str
    pid: int = 0


def missing_programs() -> list[str]:
    """The programs this needs that are not on PATH."""
    return [p for p in ("ip", "unshare", "nsenter", "tail", "mount") if shutil.which(p) is None]


def _run(cmd: list[str], what: str, timeout: float = 20.0) -> str:
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise HostsError(f"{what}: `{' '.join(cmd)}` failed: {e}") from None
    if r.returncode != 0:
        raise HostsError(f"{what}: `{' '.join(cmd)}` exited {r.returncode}: {r.stdout.strip()[-800:]}")
    return r.stdout


def namespaces() -> list[str]:
    """Names of the network namespaces of ``ip netns list``."""
    try:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def netns_pids(ns: str) -> list[int]:
    """Processes whose network namespace is ``ns`` (``ip netns pids``)."""
    try:
        out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in out.split() if p.isdigit()]


def marked_pids(directory: str | Path) -> list[int]:
    """Processes whose environment has ``GEAR_MPI_HOSTS_DIR=<directory>`` (what ran through the hosts)."""
    marker = f"{DIR_VAR}={directory}".encode()
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker in (p / "environ").read_bytes().split(b"\0"):
                    found.append(int(p.name))
            except OSError:
                continue
    return found


def _kill_all(pids_of, timeout: float) -> list[int]:
    """SIGKILL what ``pids_of()`` lists until it lists nothing (or ``timeout``); return what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids_of() if p != os.getpid() and process_alive(p)]
        if not left or time.monotonic() > deadline:
            return left
        for p in left:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.05)


def _delete_ns(ns: str, timeout: float = 5.0) -> list[int]:
    left = _kill_all(lambda: netns_pids(ns), timeout)
    subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    return left


def clean_stale() -> list[str]:
    """Delete the hosts (namespaces and their processes) whose owner process is gone.

    Returns:
        The namespaces deleted.
    """
    removed = []
    for ns in namespaces():
        m = NAME_RE.match(ns)
        if m and int(m[1]) != 0 and not process_alive(int(m[1])):
            _delete_ns(ns)
            removed.append(ns)
    return removed


class TwoHosts:
    """Two hosts on this machine (see the module docstring); a context manager.

    Args:
        directory: the folder for the holders' pid files, the hosts file and logs (None: a new
            temporary one, removed by :meth:`down`; a given one is kept).
        names: the two hostnames.
        shm_size: the size limit of each host's /dev/shm tmpfs (memory is used only as filled).
        owner: the process whose end ends the holders (default: this one; 0: none, the hosts stay
            until :meth:`down`).
    Raises (from :meth:`up`):
        HostsError: a step failed (not root, ``unshare`` not permitted, ...): the message names it;
            whatever was made is removed first.
    """

    def __init__(self, directory: str | Path | None = None, names: tuple[str, str] = ("gmhost-a", "gmhost-b"),
                 shm_size: str = "1g", owner: int | None = None):
        self.owner = os.getpid() if owner is None else owner
        self._own_dir = directory is None
        self.dir = Path(tempfile.mkdtemp(prefix="gear-hosts-")) if directory is None else Path(directory)
        serial = next(_serial) % 100 if self.owner else int.from_bytes(os.urandom(2), "little") % 100
        tag = f"gmh{self.owner}-{serial}"
        self.hosts = [Host(names[i], f"{PREFIX}{i + 1}", f"{tag}-{x}", f"{tag}-{x}") for i, x in enumerate("ab")]
        self.shm_size = shm_size
        self._holders: list[subprocess.Popen] = []
        self.is_up = False

    # ---- lifetime ------------------------------------------------------------------------
    def up(self, timeout: float = 20.0) -> "TwoHosts":
        """Make both hosts and the link; on any failure remove what was made and raise HostsError."""
        if os.geteuid() != 0:
            raise HostsError("network namespaces need root (this process runs as uid %d)" % os.geteuid())
        missing = missing_programs()
        if missing:
            raise HostsError(f"missing programs: {missing} (iproute2, util-linux, coreutils)")
        clean_stale()
        try:
            self._make(timeout)
        except BaseException:
            self.down()
            raise
        self.is_up = True
        return self

    def _make(self, timeout: float) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        hosts_file = self.dir / "hosts"
        hosts_file.write_text("127.0.0.1 localhost\n" + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        a, b = self.hosts
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns], f"creating the network namespace of {h.name}")
        _run(["ip", "link", "add", a.veth, "type", "veth", "peer", "name", b.veth], "creating the veth pair")
        for h in self.hosts:
            _run(["ip", "link", "set", h.veth, "netns", h.netns], f"moving {h.veth} into {h.netns}")
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/30", "dev", h.veth], f"addressing {h.veth}")
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"], f"raising lo of {h.name}")
            _run(["ip", "-n", h.netns, "link", "set", h.veth, "up"], f"raising {h.veth}")
        for h in self.hosts:
            self._start_holder(h, hosts_file, timeout)
        (self.dir / "hosts.json").write_text(json.dumps(
            {"owner": self.owner, "hosts": [asdict(h) for h in self.hosts]}, indent=1))

    def _start_holder(self, h: Host, hosts_file: Path, timeout: float) -> None:
        log = self.dir / f"holder.{h.name}.log"
        cmd = ["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--uts", "--mount", "--propagation", "private",
               "sh", "-c", HOLDER, "holder", h.name, self.shm_size, str(hosts_file), str(self.owner),
               str(self.dir / f"cgroup.{h.name}")]
        with open(log, "wb") as err:
            p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                 start_new_session=True)
        self._holders.append(p)
        ready, _, _ = select.select([p.stdout], [], [], timeout)
        line = p.stdout.readline().decode(errors="replace").split() if ready else []
        p.stdout.close()
        if line[:1] != ["ready"] or int(line[1]) != p.pid:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            why = log.read_text(errors="replace").strip()[-800:] or "(nothing on stderr)"
            raise HostsError(f"starting {h.name} (`nsenter --net=/run/netns/{h.netns} unshare --uts --mount "
                             f"sh -c ...`) failed, exit status {p.returncode}: {why}")
        h.pid = p.pid
        for key in (h.name, h.address):
            (self.dir / f"host.{key}.pid").write_text(f"{p.pid}\n")

    def down(self, timeout: float = 10.0) -> list[str]:
        """Kill every process inside either host, delete the namespaces (and so the link), remove
        the folder (when this object made it). Safe to call twice, or after a failed :meth:`up`.

        Returns:
            What could not be removed (empty when all went).
        """
        problems = []
        left = _kill_all(lambda: marked_pids(self.dir), timeout / 2)
        if left:
            problems.append(f"processes with {DIR_VAR}={self.dir} survive SIGKILL: {left}")
        for h in self.hosts:
            left = _delete_ns(h.netns, timeout / 2)
            if left:
                problems.append(f"processes in {h.netns} survive SIGKILL: {left}")
        # a veth pair not yet moved into its namespace lives here
        subprocess.run(["ip", "link", "del", self.hosts[0].veth], capture_output=True, timeout=10)
        for p in self._holders:
            try:
                p.wait(timeout=timeout / 2)
            except subprocess.TimeoutExpired:
                problems.append(f"holder {p.pid} did not exit")
        self._holders.clear()
        still = [h.netns for h in self.hosts if h.netns in namespaces()]
        if still:
            problems.append(f"namespaces not deleted: {still}")
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
        self.is_up = False
        return problems

    def __enter__(self) -> "TwoHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # ---- using the hosts -----------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process's environment) with ``GEAR_MPI_HOSTS_DIR`` set."""
        env = dict(os.environ if base is None else base)
        env[DIR_VAR] = str(self.dir)
        return env

    def on(self, host: int | str, cmd: list[str], wd: str | Path | None = None) -> list[str]:
        """``cmd`` prefixed so that it runs on ``host`` (an index or a name), in ``wd`` there."""
        h = self.hosts[host] if isinstance(host, int) else next(x for x in self.hosts if x.name == host)
        return ["nsenter", "--target", str(h.pid), "--net", "--uts", "--mount",
                *([f"--wd={wd}"] if wd is not None else []), "--", *cmd]

    def mpiexec(self, mpiexec: str, ranks_per_host: int, program: list[str], wd: str | Path | None = None,
                extra: list[str] | None = None) -> list[str]:
        """The command that runs ``program`` on ``ranks_per_host`` ranks of each host: hydra's
        ``mpiexec`` started on the first host, launching its proxies through ``ns_ssh`` and
        reaching them over the link (ranks 0..k-1 on the first host, the next k on the second),
        with :data:`MPI_ENV` set for every rank."""
        a = self.hosts[0]
        hosts = ",".join(f"{h.name}:{ranks_per_host}" for h in self.hosts)
        return self.on(0, [mpiexec, "-launcher", "ssh", "-launcher-exec", str(LAUNCHER), "-iface", a.veth,
                           "-hosts", hosts, "-n", str(ranks_per_host * len(self.hosts)),
                           *[w for k, v in MPI_ENV.items() for w in ("-genv", k, v)], *(extra or []),
                           *program], wd=wd)

    def link_bytes(self) -> int:
        """Bytes sent plus received so far on the first host's end of the link."""
        total = 0
        a = self.hosts[0]
        for what in ("tx_bytes", "rx_bytes"):
            out = _run(["ip", "netns", "exec", a.netns, "cat", f"/sys/class/net/{a.veth}/statistics/{what}"],
                       "reading the link's counters")
            total += int(out.strip())
        return total


# ---- command line ------------------------------------------------------------------------
def _mpiexec() -> str:
    """The mpiexec beside this Python (a virtual environment's MPI wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def _job(ranks_per_host: int, program: list[str], timeout: float) -> int:
    """``program`` on ``ranks_per_host`` ranks of each of two fresh hosts (this folder as working
    directory, this environment plus :data:`MPI_ENV`); prints the bytes the link carried. The hosts
    and every process that ran on them are removed at the end, also on a timeout."""
    if not program:
        raise SystemExit("job: give the program after --")
    mpiexec = _mpiexec()
    with TwoHosts() as hosts:
        cmd = hosts.mpiexec(mpiexec, ranks_per_host, program, wd=os.getcwd())
        print("# " + " ".join(shlex.quote(w) for w in cmd), flush=True)
        before, t0 = hosts.link_bytes(), time.monotonic()
        proc = subprocess.Popen(cmd, env=hosts.env(dict(os.environ, **MPI_ENV)), start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
        print(f"# job: exit {rc} after {time.monotonic() - t0:.1f} s; the link carried "
              f"{(hosts.link_bytes() - before) / 1e6:.1f} MB", flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="make the two hosts; print the exports and an mpiexec line")
    up.add_argument("--dir", help="the hosts' folder (default: a new /tmp/gear-hosts-*)")
    up.add_argument("--owner", type=int, default=0,
                    help="the hosts go down when this process ends (default: 0, they stay until `down`)")
    run = sub.add_parser("run", help="run a command on a host")
    run.add_argument("--dir", required=True)
    run.add_argument("--host", default="0", help="index or name (default: the first host)")
    run.add_argument("command", nargs=argparse.REMAINDER)
    down = sub.add_parser("down", help="remove the hosts of --dir")
    down.add_argument("--dir", required=True)
    sub.add_parser("clean", help="remove hosts whose owner process is gone")
    job = sub.add_parser("job", help="make the hosts, run PROGRAM under mpiexec on them, remove them")
    job.add_argument("--ranks-per-host", type=int, default=1)
    job.add_argument("--timeout", type=float, default=600.0, help="seconds before the job is killed")
    job.add_argument("program", nargs=argparse.REMAINDER, help="e.g. -- python -m mpi4py examples/offline_dt.py")
    args = ap.parse_args(argv)
    if args.cmd == "job":
        return _job(args.ranks_per_host, args.program[1:] if args.program[:1] == ["--"] else args.program,
                    args.timeout)
    if args.cmd == "clean":
        print("\n".join(clean_stale()) or "nothing to clean")
        return 0
    if args.cmd == "up":
        directory = Path(args.dir or tempfile.mkdtemp(prefix="gear-hosts-"))
        hosts = TwoHosts(directory, owner=args.owner).up()
        mpiexec = _mpiexec()
        names = ",".join(h.name for h in hosts.hosts)
        print(f"export {DIR_VAR}={directory} GEAR_MPI_TWO_HOSTS={names}")
        print("# 2 ranks on each host (mpiexec runs on the first; --wd: this folder):")
        cmd = hosts.mpiexec(mpiexec, 2, [sys.executable, "-m", "mpi4py", "-m", "pytest", "-q",
                                         "tests/mpi/test_hosts_replay.py"], wd=os.getcwd())
        print(" ".join(shlex.quote(w) for w in cmd))
        print(f"# remove them: {sys.executable} -m scripts.hosts.two_hosts down --dir {directory}")
        return 0
    state = json.loads((Path(args.dir) / "hosts.json").read_text())
    hosts = TwoHosts(args.dir, owner=state["owner"])
    hosts.hosts = [Host(**h) for h in state["hosts"]]
    if args.cmd == "down":
        problems = hosts.down()
        shutil.rmtree(args.dir, ignore_errors=True)
        print("\n".join(problems) or "down")
        return 1 if problems else 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    host = int(args.host) if args.host.isdigit() else args.host
    return subprocess.run(hosts.on(host, cmd, wd=os.getcwd()), env=hosts.env()).returncode


if __name__ == "__main__":
    sys.exit(main())
