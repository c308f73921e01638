#!/usr/bin/env python
"""Writer ingest: steps/s and GB/s that K actor processes per rank write with per-step ``append``.

    python -m scripts.bench.bench_ingest                 # gear_mpi and Reverb, 3 repetitions (~6 min)
    python -m scripts.bench.bench_ingest --quick         # a short run (about a minute)
    python -m scripts.bench.bench_ingest --no-peers      # gear_mpi only
    python -m scripts.bench.bench_ingest --json > ingest.jsonl  # or --save ingest.jsonl beside the table

Workloads (scripts/peers/_ingest.py): per-step ``append`` of W1's hopper steps (61 bytes;
episodes of 1000 steps) and of 4 KiB image steps (obs uint8[4096] + action + reward, 4104
bytes; episodes of 100 steps), one ``end_episode`` (one item) per episode, K = 1, 2, 4 actor
processes per rank, each appending a pre-built episode's steps again and again.

Cases:
  alone     gear_mpi: one rank (``mpiexec -n 1``), ``gm.Replay`` (Uniform, no rate limiter), K
            ``gm.Writer`` processes on its ``writer_address()``; the rank drains them with
            ``replay.ingest()`` in a loop (sleeping --drain-sleep when nothing came).
            Reverb: an in-process ``reverb.Server`` (one table, Uniform, FIFO, MinSize(1)) and
            K writer processes, each its own ``reverb.Client`` to 127.0.0.1 and a
            ``TrajectoryWriter``: ``append`` per step, ``create_item`` over the episode's steps
            and ``end_episode()`` per episode (scripts/peers/reverb_ingest.py, in Reverb's venv,
            under ``unshare --net`` as in compare_peers).
  sampling  gear_mpi only: 2 ranks (``mpiexec -n 2``), a hopper replay prefilled with
            --items trajectories per rank; every rank samples W1 batches (32 windows of 1000
            steps, ``"head"``) in a loop, first alone for --seconds, then while its K writers
            stream hopper episodes for --seconds (its ``sample`` calls drain them). Reported:
            the sampling GB/s alone and while ingesting (and their ratio), and the ingest.

Timing. A case's writers open their writer and write one warm-up episode (waited until it
has entered), then all start together; each writes whole episodes for --seconds and then
waits until its episodes are in the replay (gear_mpi: ``Writer.flush()``; Reverb:
``end_episode`` returns once the server has confirmed the item). A case's time runs from
the start until the last writer is done (the data is in the shard / the table), and its
steps are all those the writers wrote meanwhile (checked against what entered). steps/s and
GB/s (steps x step bytes) are summed over the case's writer processes; us/step is the median
over writers of their own time per appended step. The table gives the median and the
min-max over --reps repetitions (systems alternating), and gear_mpi / Reverb of the medians
(same workload and K). The load average and the busiest other processes (sampled for 0.5 s)
are printed at the start and the load average at the end: on a shared machine they say what
else was running. Every subprocess is bounded by --timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from scripts.bench.compare_peers import (ROOT, _clean_env, mpiexec, netns_available, run_worker,
                                         setup_peer)
from scripts.peers._common import HOPPER, HOPPER_T, W1_BATCH, hopper_trajectory, step_bytes
from scripts.peers._ingest import HANDSHAKE_TIMEOUT, WORKLOADS, LinePool, serve_writer, summarize_writers

GEAR = "gear_mpi"
MPI_ENV = ("PMI_", "HYDRA_", "HYDI_", "MPIR_", "MPI_LOCAL", "OMPI_", "PMIX_")


# ---- gear_mpi: the writer processes ---------------------------------------------------------------
def writer_main() -> None:
    """A gear_mpi actor process: a ``gm.Writer`` per ``open``; its ``go`` ends with ``flush()``."""
    import gear_mpi as gm

    def open_writer(msg: dict):
        w = gm.Writer(msg["address"], timeout=float(msg.get("timeout", 60.0)),
                      **({"staging_steps": msg["staging_steps"]} if msg.get("staging_steps") else {}))

        def end_episode():
            w.end_episode(1.0)

        return w.append, end_episode, w.flush, w.close

    serve_writer(open_writer)


def writer_env() -> dict:
    """The environment of an actor process: not an MPI rank (no launcher variables), one numba thread."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(MPI_ENV)}
    env["NUMBA_NUM_THREADS"] = "1"
    return env


# ---- gear_mpi: the owner ranks (under mpiexec) ------------------------------------------------------
class Owner:
    """One rank's replay side of a case: its writer pool and the waits that keep draining."""

    def __init__(self, comm, cfg: dict):
        self.comm, self.cfg = comm, cfg
        kmax = max(cfg["ks"])
        cmd = [sys.executable, "-m", "scripts.bench.bench_ingest", "--writer"]
        self.pool = LinePool([cmd] * kmax, env=writer_env(), cwd=str(ROOT))

    def wait(self, procs, drain, timeout: float) -> list[dict]:
        """The next reply of every proc in ``procs``, calling ``drain()`` meanwhile (the writers' flush waits
        for it); sleeps ``drain_sleep`` when ``drain()`` found nothing."""
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout
        nap = float(self.cfg.get("drain_sleep", 0.0002))
        while len(got) < len(procs):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(procs) - len(got)} writer process(es) did not answer in {timeout:.0f} s")
            n = drain()
            for i, p in enumerate(procs):
                if i not in got:
                    r = self.pool.poll_line(p, 0.0)
                    if r is not None:
                        got[i] = r
            if not n and nap > 0:
                time.sleep(nap)
        return [got[i] for i in range(len(procs))]

    def open(self, procs, replay, workload: str) -> None:
        addr = replay.writer_address()
        rank = self.comm.rank
        for i, p in enumerate(procs):
            self.pool.send([p], {"cmd": "open", "address": addr, "workload": workload,
                                 "length": WORKLOADS[workload]["length"], "seed": 1000 * rank + i, "warmup": 1,
                                 "staging_steps": self.cfg.get("staging_steps"), "timeout": 120.0})
        self.wait(procs, replay.ingest, HANDSHAKE_TIMEOUT)
        while replay.ingest():  # the warm-up episodes are in (each writer waited for its own: flush)
            pass

    def close(self, procs, replay) -> None:
        self.pool.send(procs, {"cmd": "close"})
        self.wait(procs, replay.ingest, HANDSHAKE_TIMEOUT)
        replay.ingest()


def owner_alone(comm, gm, owner: Owner, cfg: dict) -> list[dict]:
    rows = []
    for wl in cfg["workloads"]:
        w = WORKLOADS[wl]
        spec = gm.TrajectorySpec(w["columns"], max_length=w["length"])
        for k in cfg["ks"]:
            procs = owner.pool.procs[:k]
            replay = gm.Replay(spec, int(cfg["capacity_episodes"]) * w["length"], gm.Uniform(), comm=comm, seed=0,
                               timeout=300)
            owner.open(procs, replay, wl)
            entered = [0]

            def drain():
                n = replay.ingest()
                entered[0] += n
                return n

            comm.Barrier()
            t0 = time.perf_counter()
            owner.pool.send(procs, {"cmd": "go", "seconds": cfg["seconds"]})
            res = owner.wait(procs, drain, cfg["seconds"] + HANDSHAKE_TIMEOUT)
            elapsed = time.perf_counter() - t0
            while drain():
                pass
            owner.close(procs, replay)
            replay.close()
            row = {"workload": wl, "system": GEAR, "variant": "Writer per-step append", "mode": "alone",
                   "K": k, "rate": 0, "ranks": comm.size, **summarize_writers(res, wl), "elapsed_s": elapsed,
                   "inserted": entered[0]}
            if row["inserted"] != row["episodes"]:
                row.update(status="failed", reason=f"{row['inserted']} episodes entered, writers ended "
                                                    f"{row['episodes']}")
            rows.append(gather_ranks(comm, row))
    return rows


def gather_ranks(comm, row: dict) -> dict:
    """One row for the case: counts summed over ranks, times the slowest rank's."""
    from mpi4py import MPI
    out = dict(row)
    for key in ("episodes", "steps", "inserted", "writer_cpu_s"):
        out[key] = comm.allreduce(row[key])
    for key in ("elapsed_s", "writer_elapsed_s", "us_per_step"):
        out[key] = comm.allreduce(row[key], op=MPI.MAX)
    bad = comm.allgather(row.get("reason"))
    if any(bad):
        out.update(status="failed", reason="; ".join(b for b in bad if b))
    return out


def timed_sampling(comm, replay, seconds: float, warmup_s: float) -> dict:
    """Sample W1 batches for ``seconds`` (all ranks together; chunks of ~0.1 s, one allreduce after each)."""
    from mpi4py import MPI
    t_start = time.perf_counter()
    n = 0
    while True:
        replay.sample(W1_BATCH, HOPPER_T, "head")
        n += 1
        if comm.allreduce(n >= 2 and time.perf_counter() - t_start > warmup_s, op=MPI.LOR):
            break
    rate = comm.allreduce(n / (time.perf_counter() - t_start), op=MPI.MIN)
    chunk = max(1, int(rate * 0.1))
    calls = 0
    t_start = time.perf_counter()
    while True:
        for _ in range(chunk):
            replay.sample(W1_BATCH, HOPPER_T, "head")
        calls += chunk
        if comm.allreduce(time.perf_counter() - t_start >= seconds, op=MPI.LOR):
            break
    elapsed = comm.allreduce(time.perf_counter() - t_start, op=MPI.MAX)
    nbytes = comm.size * W1_BATCH * HOPPER_T * step_bytes(HOPPER)
    return {"calls": calls, "elapsed_s": elapsed, "gbps": calls * nbytes / elapsed / 1e9}


def owner_sampling(comm, gm, owner: Owner, cfg: dict) -> list[dict]:
    spec = gm.TrajectorySpec(HOPPER, max_length=HOPPER_T)
    items = int(cfg["items"])
    replay = gm.Replay(spec, int(cfg["capacity_episodes"]) * HOPPER_T, gm.Uniform(), comm=comm, seed=0, timeout=300)
    traj = [hopper_trajectory(comm.rank * 100_000 + i) for i in range(min(items, 8))]
    replay.insert_many([traj[i % len(traj)] for i in range(items)], np.ones(items))
    rows = []
    for k, rate in [(k, r) for k in cfg["ks"] for r in cfg["rates"]]:
        procs = owner.pool.procs[:k]
        owner.open(procs, replay, "hopper")
        alone = timed_sampling(comm, replay, cfg["seconds"], cfg["warmup_s"])
        comm.Barrier()
        t0 = time.perf_counter()
        owner.pool.send(procs, {"cmd": "go", "seconds": cfg["seconds"], "rate": rate})
        during = timed_sampling(comm, replay, cfg["seconds"], 0.0)
        res = owner.wait(procs, replay.ingest, cfg["seconds"] + HANDSHAKE_TIMEOUT)
        elapsed = time.perf_counter() - t0
        owner.close(procs, replay)
        row = {"workload": "hopper", "system": GEAR, "variant": "Writer per-step append", "mode": "sampling",
               "K": k, "rate": rate, "ranks": comm.size, **summarize_writers(res, "hopper"), "elapsed_s": elapsed,
               "inserted": 0, "sample_gbps_alone": alone["gbps"], "sample_gbps_during": during["gbps"],
               "sample_ratio": during["gbps"] / alone["gbps"], "sample_calls": during["calls"]}
        rows.append(gather_ranks(comm, row))
    total = replay.stats()["total"]
    replay.close()
    want = comm.size * items + sum(r["episodes"] for r in rows) + comm.size * len(cfg["rates"]) * sum(cfg["ks"])
    got = total.get("inserted")
    for r in rows:
        r["inserted_total"] = got
        if got is not None and got != want:
            r.update(status="failed", reason=f"the replay counts {got} inserted, expected {want}")
    return rows


def owner_main(cfg: dict) -> None:
    from mpi4py import MPI

    import gear_mpi as gm
    comm = MPI.COMM_WORLD
    owner = Owner(comm, cfg)
    try:
        rows = (owner_alone if cfg["mode"] == "alone" else owner_sampling)(comm, gm, owner, cfg)
    finally:
        owner.pool.close()
    if comm.rank == 0:
        import numba
        version = f"gear_mpi {gm.__version__}, numba {numba.__version__}, numpy {np.__version__}"
        for r in rows:
            print(json.dumps({"status": "ok", **r, "version": version}), flush=True)


# ---- the driver ------------------------------------------------------------------------------------
def busiest_others(interval: float = 0.5, top: int = 4) -> list[tuple[str, float]]:
    """The processes (not this one) that used the most CPU over ``interval`` seconds: (name, % of a core)."""
    def snap() -> dict:
        out = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == os.getpid():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    s = f.read()
            except OSError:
                continue
            name = s[s.index("(") + 1:s.rindex(")")]
            fields = s[s.rindex(")") + 2:].split()
            out[pid] = (name, int(fields[11]) + int(fields[12]))
        return out
    try:
        a = snap()
        time.sleep(interval)
        b = snap()
    except OSError:
        return []
    hz = os.sysconf("SC_CLK_TCK")
    use = [(b[p][0], 100.0 * (b[p][1] - a[p][1]) / hz / interval) for p in b if p in a]
    return [(n, round(u)) for n, u in sorted(use, key=lambda x: -x[1])[:top] if u >= 5]


def gear_command(mode: str, args) -> list[str]:
    ranks = 1 if mode == "alone" else 2
    cfg = {"mode": mode, "ks": args.ks if mode == "alone" else args.sampling_ks, "seconds": args.seconds, "warmup_s": args.warmup,
           "workloads": args.workloads if mode == "alone" else ["hopper"], "items": args.items,
           "capacity_episodes": args.capacity_episodes, "staging_steps": args.staging_steps,
           "drain_sleep": args.drain_sleep, "rates": args.actor_rates}
    return [mpiexec(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "scripts.bench.bench_ingest",
            "--owner", json.dumps(cfg)]


def reverb_command(py: str, args) -> list[str]:
    cfg = {"workloads": args.workloads, "ks": args.ks, "seconds": args.seconds,
           "table_items": args.capacity_episodes}
    return ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", py, "-m",
            "scripts.peers.reverb_ingest", json.dumps(cfg)]


KEY = ("workload", "mode", "system", "ranks", "K", "rate")


def summarize(runs: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if r.get("status") == "ok":
            groups.setdefault(tuple(r[k] for k in KEY), []).append(r)
    rows = []
    for key, rs in groups.items():
        sps = np.array([r["steps"] / r["elapsed_s"] for r in rs])
        row = dict(zip(KEY, key))
        row.update(status="ok", reps=len(rs), steps_per_s=float(np.median(sps)), steps_per_s_min=float(sps.min()),
                   steps_per_s_max=float(sps.max()), step_bytes=rs[0]["step_bytes"],
                   gbps=float(np.median(sps)) * rs[0]["step_bytes"] / 1e9,
                   us_per_step=float(np.median([r["us_per_step"] for r in rs])),
                   actor_cores=float(np.median([r["writer_cpu_s"] / r["elapsed_s"] for r in rs])),
                   version=rs[0].get("version"))
        if key[1] == "sampling":
            ratio = np.array([r["sample_ratio"] for r in rs])
            row.update(sample_gbps_alone=float(np.median([r["sample_gbps_alone"] for r in rs])),
                       sample_gbps_during=float(np.median([r["sample_gbps_during"] for r in rs])),
                       sample_ratio=float(np.median(ratio)), sample_ratio_min=float(ratio.min()),
                       sample_ratio_max=float(ratio.max()))
        rows.append(row)
    by = {tuple(r[k] for k in KEY): r for r in rows}
    for r in rows:
        if r["system"] != GEAR:
            g = by.get((r["workload"], r["mode"], GEAR, r["ranks"], r["K"], r["rate"]))
            if g:
                g["ratio"] = g["steps_per_s"] / r["steps_per_s"]
    order = {"alone": 0, "sampling": 1}
    rows.sort(key=lambda r: (order[r["mode"]], r["workload"] != "hopper", r["rate"], r["K"], r["system"] != GEAR))
    return rows


def fmt(v, spec="{:.3g}") -> str:
    return "-" if v is None else spec.format(v)


def print_table(rows: list[dict], failures: list[dict]) -> None:
    head = ["workload", "mode", "system", "ranks", "K/rank", "cap/actor", "steps/s", "min-max", "GB/s", "us/step",
            "actor cores", "gear/reverb",
            "sample GB/s alone", "while ingesting", "ratio (min-max)", "reps"]
    cells = []
    for r in rows:
        samp = r["mode"] == "sampling"
        cells.append([r["workload"], r["mode"], r["system"], str(r["ranks"]), str(r["K"]),
                      f"{r['rate']:,.0f}" if r["rate"] else "none",
                       f"{r['steps_per_s']:,.0f}", f"{r['steps_per_s_min']:,.0f}-{r['steps_per_s_max']:,.0f}",
                       f"{r['gbps']:.3g}", f"{r['us_per_step']:.2f}", f"{r['actor_cores']:.2f}",
                       fmt(r.get("ratio"), "{:.1f}x"),
                       fmt(r.get("sample_gbps_alone"), "{:.2f}"), fmt(r.get("sample_gbps_during"), "{:.2f}"),
                       (f"{100 * r['sample_ratio']:.0f}% ({100 * r['sample_ratio_min']:.0f}-"
                        f"{100 * r['sample_ratio_max']:.0f})") if samp else "-", str(r["reps"])])
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(head)]
    left = {0, 1, 2}
    line = lambda vals: "  ".join(v.ljust(w) if i in left else v.rjust(w)  # noqa: E731
                                  for i, (v, w) in enumerate(zip(vals, widths)))
    print("#" + line(head))
    for c in cells:
        print(" " + line(c))
    for f in failures:
        print(f"# FAILED {f.get('system', f.get('peer'))} {f.get('workload', '')} {f.get('mode', '')} "
              f"K={f.get('K', '-')}: {f.get('reason')}")
    sys.stdout.flush()


def main(argv=None) -> int:
    if argv is None and len(sys.argv) >= 2 and sys.argv[1] in ("--writer", "--owner"):
        if sys.argv[1] == "--writer":
            writer_main()
        else:
            owner_main(json.loads(sys.argv[2]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a short run (~1 min): 1 repetition, 0.4 s per case, sampling with K = 1, 4 only")
    ap.add_argument("--reps", type=int, default=None, help="repetitions, systems alternating (default 3; 1 quick)")
    ap.add_argument("--seconds", type=float, default=None, help="seconds each case writes (default 2; 0.4 quick)")
    ap.add_argument("--warmup", type=float, default=None, help="sampling warm-up seconds (default 0.3; 0.2 quick)")
    ap.add_argument("--ks", default="1,2,4", help="actor processes per rank (default 1,2,4)")
    ap.add_argument("--sampling-ks", default=None, help="K per rank of the sampling cases (default: --ks; quick: its least and largest)")
    ap.add_argument("--workloads", default="hopper,image", help="hopper, image (default both)")
    ap.add_argument("--modes", default="alone,sampling", help="alone, sampling (default both)")
    ap.add_argument("--items", type=int, default=None, help="sampling: hopper trajectories prefilled per rank "
                                                              "(default 64; 16 quick)")
    ap.add_argument("--capacity-episodes", type=int, default=256,
                    help="replay capacity per rank / Reverb table size, in episodes (default 256)")
    ap.add_argument("--staging-steps", type=int, default=None, help="gm.Writer staging_steps (default: its own)")
    ap.add_argument("--drain-sleep", type=float, default=0.0002,
                    help="alone: seconds the owner sleeps when replay.ingest() found nothing (default 0.0002)")
    ap.add_argument("--actor-rates", default="0,20000",
                    help="sampling: steps/s cap per actor (0: none, flat out); default 0,20000")
    ap.add_argument("--no-peers", action="store_true", help="gear_mpi only (no Reverb)")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "gear_mpi_peers",
                    help="the peers' environments (compare_peers --setup-only makes them)")
    ap.add_argument("--no-setup", action="store_true", help="use an existing Reverb environment only")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for each worker process")
    ap.add_argument("--json", action="store_true", help="JSON lines on stdout instead of the table")
    ap.add_argument("--save", type=Path, help="also write the JSON lines (with every repetition's rows) to this file")
    args = ap.parse_args(argv)
    q = args.quick
    args.reps = args.reps or (1 if q else 3)
    args.seconds = args.seconds or (0.4 if q else 2.0)
    args.warmup = args.warmup if args.warmup is not None else (0.2 if q else 0.3)
    args.items = args.items or (16 if q else 64)
    args.ks = [int(k) for k in args.ks.split(",")]
    args.sampling_ks = ([int(k) for k in args.sampling_ks.split(",")] if args.sampling_ks else
                        sorted({min(args.ks), max(args.ks)}) if q else args.ks)
    args.actor_rates = [float(x) for x in args.actor_rates.split(",")]
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    def log(msg: str) -> None:
        print(f"# {msg}", file=sys.stderr if args.json else sys.stdout, flush=True)

    systems = [GEAR + ":" + m for m in modes]
    reverb = None
    if not args.no_peers and "alone" in modes:
        st = setup_peer("reverb", args.cache, not args.no_setup, 3600.0, log)
        if st["status"] == "ok":
            ok, why = netns_available()
            if not ok:
                st = {"status": "unavailable", "reason": f"no private network namespace for its server ({why})"}
        log(f"reverb: {st['status']}: {st.get('versions') or st.get('reason')}")
        if st["status"] == "ok":
            reverb = st["python"]
            systems.append("reverb")
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    meta = {"kind": "meta", "host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "commit": commit,
            "load_average_start": os.getloadavg(), "busiest_others_start": busiest_others(), "reps": args.reps,
            "seconds": args.seconds, "quick": q, "ks": args.ks, "workloads": args.workloads,
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    others = ", ".join(f"{n} {u}%" for n, u in meta["busiest_others_start"]) or "none over 5%"
    log(f"{meta['cpus']} CPUs; load average {' '.join(f'{x:.2f}' for x in meta['load_average_start'])}; "
        f"busiest other processes (0.5 s): {others}")
    runs, failures = [], []
    for rep in range(args.reps):
        order = systems[rep % len(systems):] + systems[:rep % len(systems)]
        for system in order:
            if system == "reverb":
                cmd, env = reverb_command(reverb, args), _clean_env()
            else:
                cmd, env = gear_command(system.split(":")[1], args), _clean_env({"NUMBA_NUM_THREADS": "1"})
                env["PYTHONPATH"] = str(ROOT)
            t0 = time.perf_counter()
            rows, err = run_worker(cmd, args.timeout, env)
            log(f"rep {rep + 1}/{args.reps} {system}: {len(rows)} rows in {time.perf_counter() - t0:.0f} s, "
                f"load average {os.getloadavg()[0]:.2f}" + (f"; ERROR {err}" if err else ""))
            for r in rows:
                r["rep"] = rep
                (runs if r.get("status") == "ok" else failures).append(r)
            if err:
                failures.append({"system": system, "reason": err, "rep": rep})
    rows = summarize(runs)
    meta.update(load_average_end=os.getloadavg(), finished=time.strftime("%Y-%m-%d %H:%M:%S"))
    targets = []
    for r in rows:
        if r.get("ratio") is not None:
            targets.append({"kind": "target", "target": f"{r['workload']} K={r['K']}: gear_mpi >= 20x Reverb "
                            f"per-step writer steps/s", "value": r["ratio"], "met": r["ratio"] >= 20})
        if r["mode"] == "sampling":
            cap = f", each capped at {r['rate']:,.0f} steps/s" if r["rate"] else ", flat out"
            targets.append({"kind": "target", "target": f"sampling while K={r['K']} writers/rank{cap} ingest "
                            f">= 70% of sampling alone", "value": r["sample_ratio"], "met": r["sample_ratio"] >= 0.7})
    lines = [json.dumps(x) for x in [meta] + [{"kind": "result", **r} for r in rows] + targets +
             [{"kind": "failed", **f} for f in failures]]
    if args.save:
        args.save.write_text("\n".join(lines + [json.dumps({"kind": "run", **r}) for r in runs]) + "\n")
    if args.json:
        print("\n".join(lines), flush=True)
        return 1 if failures else 0
    print(f"# writer ingest on {meta['host']}: {meta['cpus']} CPUs, Python {meta['python']}, commit {commit}; "
          f"{args.reps} repetition(s) of {args.seconds:g} s per case, systems alternating; medians over repetitions; "
          f"{meta['started']} - {meta['finished']}")
    print(f"# load average start {meta['load_average_start'][0]:.2f}, end {meta['load_average_end'][0]:.2f}; "
          f"busiest other processes at the start: {others}")
    print_table(rows, failures)
    print("# steps/s, GB/s: steps appended by all writer processes of the case (K per rank x ranks) per second, "
          "from the start until all had entered the replay/table; us/step: a writer's own time per step (median over "
          "writers; pacing sleep excluded); actor cores: CPU time of all actor processes / wall time")
    print("# gear/reverb: steps/s ratio of the medians (same workload, K); ratio: sampling GB/s while the writers "
          "stream / alone (the same replay, just before)")
    for t in targets:
        print(f"# target {t['target']}: {t['value']:.2f} -> {'met' if t['met'] else 'NOT met'}")
    for v in sorted({r["version"] for r in rows if r.get("version")}):
        print(f"# {v}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
