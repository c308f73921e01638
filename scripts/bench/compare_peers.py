#!/usr/bin/env python
"""gear_mpi against Reverb, cpprb and TorchRL on the same workloads, side by side in one run.

    python -m scripts.bench.compare_peers                       # set up the peers (once), then measure
    python -m scripts.bench.compare_peers --quick --reps 2      # small sizes: a few minutes
    python -m scripts.bench.compare_peers --json > peers.jsonl  # JSON lines (for scripts/plots/plot_results.py)
    python -m scripts.bench.compare_peers --save peers.jsonl    # the table, and the JSON lines into a file
    python -m scripts.bench.compare_peers --setup-only          # only create the peers' environments

Peers. Each one lives in its own virtual environment under --cache (default
~/.cache/gear_mpi_peers/<peer>/venv), created with this interpreter's base Python and pip:
  reverb   dm-reverb[tensorflow]==0.14.0 (TensorFlow 2.15, numpy<2)
  cpprb    cpprb
  torchrl  torch==2.14.1 torchrl==0.14.1 (TorchRL's prioritized sampler does not load with torch 2.13)
A peer whose environment cannot be made or imported is reported (table and JSON) with the
reason, never dropped. Each peer runs as a subprocess of its own venv's Python executing
scripts/peers/<peer>_worker.py, which prints one JSON object per case; the gear_mpi side
runs scripts/peers/gear_worker.py in this environment, under ``mpiexec -n K`` for W1.
Reverb's server listens on every interface ([::]:port, no option in 0.14), so its worker
runs in a private network namespace holding only the loopback interface (``unshare --net``,
needs root or user namespaces) and connects to 127.0.0.1; without one Reverb is not run.

Workloads (see scripts/peers/_common.py):
  W1  the GEAR paper's: hopper-like trajectories (T=1000; obs 11 float32, action 3 float32,
      reward float32, done bool; 61 bytes per step), whole trajectories, batch 32 per client,
      uniform and prioritized (alpha 0.6), 1, 2 and 4 clients. gear_mpi: K MPI ranks, modes
      decentralized (shared-memory window path, and the forced alltoallv path inter-node
      windows take) and local. Reverb: one server process, K client processes sampling with
      reverb.TrajectoryDataset over 127.0.0.1, fed per step (auto-tuned chunks, and chunks of
      T steps) and per whole trajectory (one append each: the most favourable).
  W2  transitions: obs uint8[4096] + action + reward (4104 bytes), N=1e5 items, batch 256:
      prioritized sample + priority update of the sampled items per step.
  W3  prioritized selection at scale: B=65536 draws + B priority updates over N=1e7 (and smaller N);
      gear_mpi through a Shard of one-float items (sample + update_priorities: the ratio's row) and,
      for information, its internal PriorityIndex alone.

Measurement. Each repetition (--reps) runs every workload on every system, the systems'
order rotating between repetitions so that the machine's other load falls on all of them
alike; before each workload it measures this machine's memcpy rate (np.copyto of 1 GiB,
best of 5: the ceiling; the table gives the median of those).
A case runs for --seconds after a warm-up. Delivered GB/s = bytes of the returned data
columns (B x W x step bytes; masks, keys and weights not counted for anybody), summed over
clients, divided by the wall time of the measurement; items/s likewise (trajectories for
W1, transitions for W2, draws for W3). ms/call is the median time of one call (one batch
per client; W2/W3: one sample+update step). The table gives the median over repetitions
and the gear_mpi/peer ratio of those medians (W1, W2: GB/s; W3: time per step).
Every subprocess is bounded by --timeout seconds (--setup-timeout for pip).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench.bench_replay import memcpy_gbps  # the same-run memcpy ceiling, one definition
from scripts.bench.json_lines import json_rows
from scripts.peers._common import W2_FLOOR

ROOT = Path(__file__).resolve().parents[2]   # the repository: workers run as modules from there
WORKER_PACKAGE = "scripts.peers"  # the workers run as modules of this package

PEERS = {
    "reverb": {"requirements": ["dm-reverb[tensorflow]==0.14.0"],
               "check": "import reverb, tensorflow; from importlib.metadata import version as v; "
                        "print('dm-reverb', v('dm-reverb'), 'tensorflow', tensorflow.__version__)"},
    "cpprb": {"requirements": ["cpprb"],
              "check": "import cpprb; from importlib.metadata import version as v; print('cpprb', v('cpprb'))"},
    "torchrl": {"requirements": ["torch==2.14.1", "torchrl==0.14.1"],
                "check": "import torch, torchrl; from torchrl.data import PrioritizedSampler, LazyTensorStorage, "
                         "TensorDictPrioritizedReplayBuffer; print('torchrl', torchrl.__version__, 'torch', "
                         "torch.__version__)"},
}
WORKLOAD_SYSTEMS = {"W1": ["gear_mpi", "reverb"], "W2": ["gear_mpi", "cpprb", "torchrl", "reverb"],
                    "W3": ["gear_mpi", "cpprb", "torchrl"]}
GEAR = "gear_mpi"


# ---- peer environments -------------------------------------------------------------------------
def _tail(text: str, n: int = 600) -> str:
    text = " ".join((text or "").split())
    return text[-n:]


def _clean_env(extra: dict | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env.update(extra or {})
    return env


def base_python() -> str:
    """The interpreter that venvs are made from (the base of this venv, if this is one)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def setup_peer(name: str, cache: Path, install: bool, timeout: float, log) -> dict:
    """Make (or reuse) the peer's venv; return {status: ok|unavailable, python, versions|reason}."""
    spec = PEERS[name]
    root = cache / name
    venv = root / "venv"
    py = venv / "bin" / "python"
    marker = root / "installed.json"
    wanted = {"requirements": spec["requirements"], "python": platform.python_version()}

    def check() -> tuple[bool, str]:
        try:
            r = subprocess.run([str(py), "-c", spec["check"]], capture_output=True, text=True, timeout=timeout,
                               env=_clean_env())
        except subprocess.TimeoutExpired:
            return False, f"import check timed out after {timeout:.0f} s"
        except OSError as e:
            return False, f"cannot run {py}: {e}"
        out = [ln for ln in r.stdout.splitlines() if ln.strip()]
        return r.returncode == 0, (out[-1] if r.returncode == 0 and out else _tail(r.stderr))

    if py.exists() and marker.exists():
        try:
            same = json.loads(marker.read_text()) == wanted
        except (OSError, ValueError):
            same = False
        if same:
            ok, msg = check()
            if ok:
                return {"peer": name, "status": "ok", "python": str(py), "versions": msg}
    if not install:
        return {"peer": name, "status": "unavailable", "reason": f"no working environment at {venv} (--no-setup)"}
    root.mkdir(parents=True, exist_ok=True)
    log(f"setting up {name} in {venv}: pip install {' '.join(spec['requirements'])}")
    try:
        if not py.exists():
            r = subprocess.run([base_python(), "-m", "venv", str(venv)], capture_output=True, text=True,
                               timeout=timeout)
            if r.returncode != 0:
                return {"peer": name, "status": "unavailable", "reason": f"venv failed: {_tail(r.stderr)}"}
        r = subprocess.run([str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q",
                            *spec["requirements"]], capture_output=True, text=True, timeout=timeout, env=_clean_env())
        (root / "pip.log").write_text(r.stdout + r.stderr)
        if r.returncode != 0:
            errs = [ln for ln in (r.stdout + r.stderr).splitlines() if "ERROR" in ln or "error" in ln.lower()]
            return {"peer": name, "status": "unavailable",
                    "reason": f"pip install {' '.join(spec['requirements'])} failed (exit {r.returncode}): "
                              f"{_tail(' '.join(errs) or r.stderr)}"}
    except subprocess.TimeoutExpired:
        return {"peer": name, "status": "unavailable", "reason": f"setup timed out after {timeout:.0f} s"}
    ok, msg = check()
    if not ok:
        return {"peer": name, "status": "unavailable", "reason": f"installed but does not import: {msg}"}
    marker.write_text(json.dumps(wanted))
    return {"peer": name, "status": "ok", "python": str(py), "versions": msg}


def netns_available() -> tuple[bool, str]:
    """Can this process start a command in a private network namespace (loopback only)?"""
    for tool in ("unshare", "ip"):
        if not shutil.which(tool):
            return False, f"no '{tool}' command (util-linux / iproute2)"
    try:
        r = subprocess.run(["unshare", "--net", "--", "sh", "-c", "ip link set lo up"], capture_output=True,
                           text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"unshare --net failed: {e}"
    if r.returncode != 0:
        return False, f"unshare --net failed: {_tail(r.stderr, 200)}"
    return True, ""


# ---- running workers ------------------------------------------------------------------------------
def run_worker(cmd: list[str], timeout: float, env: dict) -> tuple[list[dict], str | None]:
    """Run one worker in its own session; kill its whole process group on timeout.
    Returns (JSON rows, error or None)."""
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                cwd=str(ROOT), start_new_session=True)
    except OSError as e:
        return [], f"cannot start {cmd[0]}: {e}"
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = proc.communicate()
        rows = json_rows(out)
        return rows, f"timed out after {timeout:.0f} s"
    rows = json_rows(out)
    if proc.returncode != 0:
        return rows, f"exit {proc.returncode}: {_tail(err, 800)}"
    return rows, None


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    return str(here) if here.exists() else "mpiexec"


def worker_commands(system: str, workload: str, cfg: dict, setup: dict, args) -> list[tuple[list[str], dict]]:
    """The commands (with environments) that measure ``workload`` on ``system`` once."""
    blob = json.dumps(cfg)
    if system == GEAR:
        script = ["-m", f"{WORKER_PACKAGE}.gear_worker"]
        if workload == "W1":
            cores = os.cpu_count() or 1
            cmds = []
            for k in args.clients:  # one numba thread per core per rank; and 1 for K=1 too (see thread_counts)
                for n in sorted({max(1, cores // k)} | ({1} if args.threads == "both" else set())):
                    # -m mpi4py: an exception on one rank aborts every rank at once
                    cmds.append(([mpiexec(), "-n", str(k), sys.executable, "-m", "mpi4py", *script,
                                  json.dumps({**cfg, "clients": k})],
                                 _clean_env({"NUMBA_NUM_THREADS": str(n)})))
            return cmds
        return [([sys.executable, *script, json.dumps({**cfg, "threads": n})],
                 _clean_env({"NUMBA_NUM_THREADS": str(n)})) for n in thread_counts(args)]
    py = setup[system]["python"]
    script = ["-m", f"{WORKER_PACKAGE}.{system}_worker"]
    if system == "reverb":
        return [(["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", py, *script, blob],
                 _clean_env())]
    if system == "torchrl":
        return [([py, *script, json.dumps({**cfg, "threads": n})], _clean_env({"OMP_NUM_THREADS": str(n)}))
                for n in thread_counts(args)]
    return [([py, *script, blob], _clean_env())]


def thread_counts(args) -> list[int]:
    """W2/W3: the multi-threaded systems (gear_mpi's numba kernels, TorchRL's torch) run with one
    thread and with one per core: on a shared machine a parallel kernel waits whenever another
    process holds a core, and cpprb is single-threaded."""
    cores = os.cpu_count() or 1
    return sorted({1, cores}) if args.threads == "both" else [1 if args.threads == "1" else cores]


def workload_config(workload: str, args) -> dict:
    base = {"workload": workload, "seconds": args.seconds, "warmup_s": args.warmup}
    if workload == "W1":
        return {**base, "items": args.w1_items, "step_items": args.w1_step_items, "clients": args.clients}
    if workload == "W2":
        return {**base, "N": args.w2_n, "batches": args.w2_batches}
    return {**base, "B": args.w3_b, "Ns": args.w3_ns}


# ---- summary ----------------------------------------------------------------------------------------
KEY = ("workload", "peer", "variant", "sampler", "threads", "clients", "B", "N")


def derive(row: dict) -> dict:
    """Per-run figures: sustained GB/s and items/s over the measurement's wall time."""
    if row.get("status") == "failed":
        return row
    calls = row["calls"]
    bytes_total = row.get("bytes_total", calls * row["bytes_per_call"])
    items_total = row.get("items_total", calls * row.get("items_per_call", row["B"]))
    el = row["elapsed_s"]
    return {**row, "gbps": bytes_total / el / 1e9, "items_per_s": items_total / el,
            "gbps_median_call": row["bytes_per_call"] / row["median_call_s"] / 1e9,
            "ms_per_call": 1e3 * row["median_call_s"]}


def summarize(runs: list[dict], memcpy: list[float]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("status") == "failed":
            continue
        groups.setdefault(tuple(r.get(k) for k in KEY), []).append(r)
    copy = float(np.median(memcpy)) if memcpy else float("nan")
    out = []
    for key, rs in groups.items():
        g = np.array([r["gbps"] for r in rs])
        row = dict(zip(KEY, key))
        row.update(status="ok", reps=len(rs), gbps=float(np.median(g)), gbps_min=float(g.min()),
                   gbps_max=float(g.max()), items_per_s=float(np.median([r["items_per_s"] for r in rs])),
                   gbps_median_call=float(np.median([r["gbps_median_call"] for r in rs])),
                   ms_per_call=float(np.median([r["ms_per_call"] for r in rs])),
                   bytes_per_call=rs[0]["bytes_per_call"], step_bytes=rs[0].get("step_bytes"),
                   W=rs[0].get("W", 1), memcpy_gbps=copy, pct_memcpy=100 * float(np.median(g)) / copy,
                   fill_s=float(np.median([r.get("fill_s", np.nan) for r in rs])), version=rs[0].get("version"),
                   threads=rs[0].get("threads"), best_call_ms=float(np.min([r["best_call_s"] for r in rs])) * 1e3)
        out.append(row)
    # failures: one row per failing case that never succeeded
    seen = {tuple(r.get(k) for k in KEY) for r in out}
    for r in runs:
        if r.get("status") != "failed":
            continue
        key = tuple(r.get(k) for k in KEY)
        if key in seen:
            for o in out:
                if tuple(o.get(k) for k in KEY) == key:
                    o.setdefault("failures", []).append(r["reason"])
            continue
        seen.add(key)
        out.append({**{k: r.get(k) for k in KEY}, "status": r.get("status", "failed"), "reason": r["reason"]})
    add_ratios(out)
    order = {"W1": 0, "W2": 1, "W3": 2}
    sysorder = {GEAR: 0, "reverb": 1, "cpprb": 2, "torchrl": 3}
    out.sort(key=lambda r: (order.get(r["workload"], 9), r.get("sampler") or "", r.get("clients") or 0,
                            r.get("B") or 0, r.get("N") or 0, sysorder.get(r["peer"], 9), str(r.get("variant")),
                            r.get("threads") or 0))
    return out


def gear_reference(rows: list[dict], r: dict) -> dict | None:
    """The gear_mpi row a peer row is compared with: W1 decentralized (same sampler, K, one
    numba thread per rank: with 2 threads a rank's parallel copy waits whenever another
    process holds the other core); W2 and W3 the Shard's public sample+update, same B and N, with as
    many threads as the peer row used (1 for cpprb and Reverb). (W3's PriorityIndex rows, the internal
    index alone, are information only.)"""
    want = {"W1": "decentralized", "W2": "Shard(Prioritized) sample+update",
            "W3": "Shard(Prioritized) sample+update"}[r["workload"]]
    threads = 1 if r["workload"] == "W1" else (r.get("threads") or 1)
    for g in rows:
        if (g["peer"] == GEAR and g.get("status") == "ok" and g["workload"] == r["workload"]
                and g["variant"] == want and g["sampler"] == r["sampler"] and (g.get("threads") or 1) == threads
                and g["clients"] == r["clients"] and g["B"] == r["B"] and (r["workload"] == "W1" or g["N"] == r["N"])):
            return g
    return None


def add_ratios(rows: list[dict]) -> None:
    for r in rows:
        if r["peer"] == GEAR or r.get("status") != "ok":
            continue
        g = gear_reference(rows, r)
        if g is None:
            continue
        r["gear_variant"] = g["variant"]
        if r["workload"] == "W3":  # time per step
            r["ratio"] = r["ms_per_call"] / g["ms_per_call"]
        else:
            r["ratio"] = g["gbps"] / r["gbps"]
            r["ratio_median_call"] = g["gbps_median_call"] / r["gbps_median_call"]


def targets(rows: list[dict], setup: dict, args) -> list[dict]:
    """The issue's reference targets, checked on this run's medians."""
    out = []

    def add(target, ratio, need, basis):
        out.append({"kind": "target", "target": target, "ratio": ratio, "need": need,
                    "met": None if ratio is None else bool(ratio >= need), "basis": basis})

    def peer_rows(workload, peer, **match):
        return [r for r in rows if r["workload"] == workload and r["peer"] == peer and r.get("status") == "ok"
                and all(r.get(k) == v for k, v in match.items())]

    kmax = max(args.clients)
    cores = os.cpu_count() or 1
    for clients, need, why in ((kmax, 15, ""), (cores, 20, ", one rank per core (issue 34, item 6)")):
        if clients not in args.clients:
            continue
        for s in ("uniform", "prioritized"):
            rv = [r for r in peer_rows("W1", "reverb", sampler=s, clients=clients) if r.get("ratio") is not None]
            best = max(rv, key=lambda r: r["gbps"]) if rv else None  # Reverb fed its most favourable way (measured)
            add(f"W1 {clients} clients{why}, {s}: gear_mpi decentralized >= {need}x Reverb fed the most favourable "
                f"way (GB/s)", best["ratio"] if best else None, need,
                _why_missing(setup, "reverb", rv, "W1" in args.workloads)
                or f"Reverb's fastest feed: {best['variant']}")
    b = 256 if 256 in args.w2_batches else args.w2_batches[0]
    n = max(args.w3_ns)
    for wl, need, match, what in (("W2", 3, {"B": b}, f"W2 B={b}"), ("W3", 5, {"B": args.w3_b, "N": n},
                                                                        f"W3 B={args.w3_b}, N={n:.0e}")):
        unit = "GB/s" if wl == "W2" else "time per sample+update"
        for peer in ("cpprb", "torchrl"):
            rs = [r for r in peer_rows(wl, peer, **match) if r.get("ratio") is not None]
            missing = _why_missing(setup, peer, rs, wl in args.workloads)
            # (a) each system at its fastest configuration on this machine (gear_mpi's numba threads
            # and TorchRL's torch threads as measured; cpprb is single-threaded)
            gear = [g for g in peer_rows(wl, GEAR, **match) if rs and g["variant"] == rs[0]["gear_variant"]]
            ratio = basis = None
            if rs and gear:
                speed = (lambda r: r["gbps"]) if wl == "W2" else (lambda r: -r["ms_per_call"])
                g, p = max(gear, key=speed), max(rs, key=speed)
                ratio = g["gbps"] / p["gbps"] if wl == "W2" else p["ms_per_call"] / g["ms_per_call"]
                basis = (f"gear_mpi {g['threads']} thr vs {p['variant']}, {p['threads']} thr")
            add(f"{what}: gear_mpi >= {need}x {peer}, each at its fastest configuration ({unit})", ratio, need,
                missing or basis)
            # (b) the same number of threads on both sides (gear_mpi single-threaded against cpprb)
            worst = min(rs, key=lambda r: r["ratio"]) if rs else None
            add(f"{what}: gear_mpi >= {need}x {peer}, equal thread counts ({unit}; {peer}'s fastest variant)",
                worst["ratio"] if worst else None, need,
                missing or f"{worst['variant']}, {worst['threads']} thr")
    return out


def bounds(rows: list[dict]) -> list[dict]:
    """The highest W2 ratio any gear_mpi step could reach against each peer row on this machine: the peer's
    step time over gear_mpi's bare gather of the same number of random rows with the same thread count
    (``gear_worker.w2_copy_floor``: the copy alone, which every system returning those rows pays), and over
    the fastest such gather. A target above this bound needs a faster memory system, not a faster sampler."""
    out = []
    for r in rows:
        if r["workload"] != "W2" or r["peer"] == GEAR or r.get("status") != "ok":
            continue
        threads = r.get("threads") or 1
        floors = [g for g in rows if g["peer"] == GEAR and g.get("status") == "ok" and g["workload"] == "W2"
                  and g["variant"] == W2_FLOOR and g["B"] == r["B"] and g["N"] == r["N"]]
        same = [g for g in floors if (g.get("threads") or 1) == threads]
        if same:
            fastest = min(floors, key=lambda g: g["ms_per_call"])
            out.append({"kind": "bound", "B": r["B"], "peer": r["peer"], "variant": r["variant"], "threads": threads,
                        "peer_ms": r["ms_per_call"], "floor_ms": same[0]["ms_per_call"],
                        "bound": r["ms_per_call"] / same[0]["ms_per_call"],
                        "fastest_floor_threads": fastest["threads"], "fastest_floor_ms": fastest["ms_per_call"],
                        "bound_fastest": r["ms_per_call"] / fastest["ms_per_call"]})
    return out


def _why_missing(setup: dict, peer: str, rs: list, ran: bool = True) -> str:
    if rs:
        return ""
    if not ran:
        return "workload not run"
    st = setup.get(peer, {})
    if st.get("status") != "ok":
        return f"not measured: {st.get('reason', 'peer not selected')}"
    return "not measured (the case failed; see the table)"


# ---- printing ----------------------------------------------------------------------------------------
COLUMNS = [("workload", "wl", "{}"), ("peer", "system", "{}"), ("variant", "variant", "{}"),
           ("sampler", "sampler", "{}"), ("threads", "thr", "{}"), ("clients", "K", "{}"), ("B", "B", "{}"),
           ("N", "N", "{}"), ("ms_per_call", "ms/call", "{:.3f}"), ("items_per_s", "items/s", "{:.4g}"),
           ("gbps", "GB/s", "{:.3f}"), ("gbps_range", "GB/s min-max", "{}"), ("gbps_median_call", "GB/s@med", "{:.3f}"),
           ("pct_memcpy", "%memcpy", "{:.1f}"), ("ratio", "gear/this", "{:.2f}"), ("best_call_ms", "best ms", "{:.3f}"),
           ("reps", "reps", "{}")]


def print_table(rows: list[dict], out=sys.stdout) -> None:
    cells = []
    for r in rows:
        if r.get("status") != "ok":
            c = [str(r.get(k, "")) if r.get(k) is not None else "-" for k, _, _ in COLUMNS[:8]]
            c += ["UNAVAILABLE" if r.get("status") == "unavailable" else "FAILED"] + [""] * (len(COLUMNS) - 9)
            cells.append((c, r.get("reason")))
            continue
        r = {**r, "gbps_range": f"{r['gbps_min']:.3g}-{r['gbps_max']:.3g}"}
        c = []
        for k, _, fmt in COLUMNS:
            v = r.get(k)
            c.append("-" if v is None else (fmt.format(v) if isinstance(v, (int, float)) and fmt != "{}" else str(v)))
        cells.append((c, None))
    widths = [max([len(h)] + [len(c[0][i]) for c in cells]) for i, (_, h, _) in enumerate(COLUMNS)]
    left = {1, 2, 3}
    fmt_cell = lambda v, w, i: v.ljust(w) if i in left else v.rjust(w)  # noqa: E731
    print("#" + "  ".join(fmt_cell(h, w, i) for i, ((_, h, _), w) in enumerate(zip(COLUMNS, widths))), file=out)
    last = None
    for c, reason in cells:
        if last is not None and c[0] != last:
            print(file=out)
        last = c[0]
        print(" " + "  ".join(fmt_cell(v, w, i) for i, (v, w) in enumerate(zip(c, widths))), file=out)
        if reason:
            print(f"#   reason: {reason}", file=out)
    out.flush()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "gear_mpi_peers",
                    help="where the peers' virtual environments live (default ~/.cache/gear_mpi_peers)")
    ap.add_argument("--peers", default="reverb,cpprb,torchrl", help="comma-separated subset of reverb,cpprb,torchrl")
    ap.add_argument("--workloads", default="W1,W2,W3", help="comma-separated subset of W1,W2,W3")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions, systems alternating (default 3; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small sizes and short cases")
    ap.add_argument("--seconds", type=float, default=None, help="measured time per case (default 3; 0.7 with --quick)")
    ap.add_argument("--warmup", type=float, default=None, help="warm-up seconds per case (default 0.5; 0.2 quick)")
    ap.add_argument("--clients", default="1,2,4", help="W1 client counts (MPI ranks / Reverb client processes)")
    ap.add_argument("--w1-items", type=int, default=None, help="W1 trajectories stored (default 1024; 64 quick)")
    ap.add_argument("--w1-step-items", type=int, default=None,
                    help="W1 trajectories in Reverb's per-step-fed tables (1000 appends each; default 256; 16 quick)")
    ap.add_argument("--w2-n", type=int, default=None, help="W2 items (default 100000; 10000 quick)")
    ap.add_argument("--w2-batches", default=None, help="W2 batch sizes (default 64,256,1024; 256 quick)")
    ap.add_argument("--w3-b", type=int, default=None, help="W3 batch (default 65536; 8192 quick)")
    ap.add_argument("--w3-ns", default=None, help="W3 sizes N (default 1e5,1e6,1e7; 1e4,1e5,1e6 quick)")
    ap.add_argument("--threads", default="both", choices=["both", "1", "all"],
                    help="W2/W3 threads of gear_mpi and TorchRL: 1, one per core, or both (default)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for each worker process")
    ap.add_argument("--setup-timeout", type=float, default=3600.0, help="seconds allowed for each pip install")
    ap.add_argument("--no-setup", action="store_true", help="use existing peer environments only; install nothing")
    ap.add_argument("--setup-only", action="store_true", help="create the peer environments, then stop")
    ap.add_argument("--json", action="store_true", help="JSON lines on stdout instead of the table")
    ap.add_argument("--save", type=Path, help="also write the JSON lines to this file")
    ap.add_argument("--raw", action="store_true", help="with --json/--save: include every repetition's rows too")
    args = ap.parse_args(argv)
    q = args.quick
    args.reps = args.reps or (2 if q else 3)
    args.seconds = args.seconds or (0.7 if q else 3.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if q else 0.5)
    args.clients = [int(x) for x in args.clients.split(",")]
    args.w1_items = args.w1_items or (64 if q else 1024)
    args.w1_step_items = args.w1_step_items or (16 if q else 256)
    args.w2_n = args.w2_n or (10_000 if q else 100_000)
    args.w2_batches = [int(x) for x in (args.w2_batches or ("256" if q else "64,256,1024")).split(",")]
    args.w3_b = args.w3_b or (8192 if q else 65536)
    args.w3_ns = [int(float(x)) for x in (args.w3_ns or ("1e4,1e5,1e6" if q else "1e5,1e6,1e7")).split(",")]
    workloads = args.workloads = [w.strip().upper() for w in args.workloads.split(",")]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    for p in peers:
        if p not in PEERS:
            ap.error(f"unknown peer {p!r}; choose from {', '.join(PEERS)}")

    def log(msg: str) -> None:
        print(f"# {msg}", file=sys.stderr if args.json else sys.stdout, flush=True)

    # -- setup
    setup = {}
    for p in peers:
        setup[p] = setup_peer(p, args.cache, not args.no_setup, args.setup_timeout, log)
    if "reverb" in setup and setup["reverb"]["status"] == "ok":
        ok, why = netns_available()
        if not ok:
            setup["reverb"] = {"peer": "reverb", "status": "unavailable",
                               "reason": f"installed, but not run: its server listens on every interface and no "
                                         f"private network namespace could be made ({why})"}
    meta = {"kind": "meta", "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "numpy": np.__version__, "load_average_start": os.getloadavg(), "reps": args.reps,
            "seconds": args.seconds, "quick": q, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "setup": list(setup.values()), "sizes": {"w1_items": args.w1_items, "w1_step_items": args.w1_step_items,
                                                      "clients": args.clients, "w2_n": args.w2_n,
                                                      "w2_batches": args.w2_batches, "w3_b": args.w3_b,
                                                      "w3_ns": args.w3_ns}}
    if not args.json:
        for s in setup.values():
            log(f"peer {s['peer']}: {s['status']}: {s.get('versions') or s.get('reason')}")
    if args.setup_only:
        if args.json:
            print(json.dumps(meta))
        return 0 if all(s["status"] == "ok" for s in setup.values()) else 1

    # -- measure, alternating
    runs: list[dict] = []
    memcpy = []
    for rep in range(args.reps):
        log(f"rep {rep + 1}/{args.reps}: load average {os.getloadavg()[0]:.2f}")
        for wl in workloads:
            memcpy.append(memcpy_gbps((256 if q else 1024) << 20))  # before every workload: the load drifts
            log(f"  memcpy {memcpy[-1]:.2f} GB/s")
            systems = [s for s in WORKLOAD_SYSTEMS[wl] if s == GEAR or s in peers]
            shift = rep % len(systems)
            systems = systems[shift:] + systems[:shift]  # rotate the order between repetitions
            cfg = workload_config(wl, args)
            for system in systems:
                if system != GEAR and setup[system]["status"] != "ok":
                    continue
                for cmd, env in worker_commands(system, wl, cfg, setup, args):
                    t0 = time.perf_counter()
                    rows, err = run_worker(cmd, args.timeout, env)
                    log(f"  {wl} {system}{' (mpiexec -n ' + cmd[2] + ')' if cmd[0] == mpiexec() else ''}: "
                        f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s" + (f"; ERROR {err}" if err else ""))
                    for r in rows:
                        r["rep"] = rep
                        runs.append(derive(r))
                    if err:
                        runs.append({"workload": wl, "peer": system, "variant": "(worker)", "status": "failed",
                                     "reason": err, "rep": rep})
    rows = summarize(runs, memcpy)
    for p, s in setup.items():  # unavailable peers: one row per workload they belong to
        if s["status"] != "ok":
            for wl in workloads:
                if p in WORKLOAD_SYSTEMS[wl]:
                    rows.append({"workload": wl, "peer": p, "variant": "-", "sampler": None, "clients": None,
                                 "B": None, "N": None, "status": "unavailable", "reason": s["reason"]})
    tg = targets(rows, setup, args)
    bs = bounds(rows)
    meta.update(memcpy_gbps=float(np.median(memcpy)), memcpy_runs=memcpy, load_average_end=os.getloadavg(),
                finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    lines = ([json.dumps(meta)] + [json.dumps({"kind": "result", **r}) for r in rows] + [json.dumps(t) for t in tg]
             + [json.dumps(b) for b in bs])
    if args.raw:
        lines += [json.dumps({"kind": "run", **r}) for r in runs]
    if args.save:
        args.save.write_text("\n".join(lines) + "\n")
    if args.json:
        print("\n".join(lines), flush=True)
        return 0
    print(f"# gear_mpi vs peers on {meta['host']}: {meta['cpus']} CPUs, Python {meta['python']}; "
          f"{args.reps} repetitions, systems alternating; medians over repetitions", flush=True)
    print(f"# memcpy (np.copyto, one thread, same run): {meta['memcpy_gbps']:.2f} GB/s "
          f"(runs: {', '.join(f'{m:.2f}' for m in memcpy)}); load average start {meta['load_average_start'][0]:.2f}, "
          f"end {meta['load_average_end'][0]:.2f}", flush=True)
    print_table(rows)
    print("#\n# GB/s: data columns delivered (B x W x step bytes, all clients) per second of wall time; GB/s@med: "
          "bytes of one call / its median time; best ms: the fastest single call of all repetitions; gear/this: "
          "gear_mpi's figure over this row's (W1: decentralized, same sampler and K, 1 thread per rank; W2: Shard, "
          "same B; W3: time "
          "per step, Shard sample+update, same N; W2/W3 with the same number of threads, 1 for cpprb and "
          "Reverb)")
    print("#\n# targets (reference):")
    for t in tg:
        state = "n/a" if t["met"] is None else ("met" if t["met"] else "NOT met")
        val = "-" if t["ratio"] is None else f"{t['ratio']:.2f}x"
        print(f"#   {t['target']}: {val} -> {state}" + (f" ({t['basis']})" if t["basis"] else ""))
    if bs:
        print("#\n# W2 bounds: the highest gear_mpi/peer ratio reachable here = the peer's step / gear_mpi's bare "
              "gather of as many random rows (same threads; the copy alone)")
        for b in bs:
            print(f"#   B={b['B']}, {b['peer']} {b['variant']}, {b['threads']} thr: {b['peer_ms']:.3f} ms / "
                  f"{b['floor_ms']:.3f} ms -> at most {b['bound']:.2f}x at equal threads; against gear_mpi's "
                  f"fastest copy ({b['fastest_floor_threads']} thr, {b['fastest_floor_ms']:.3f} ms) at most "
                  f"{b['bound_fastest']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
