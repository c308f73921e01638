#!/usr/bin/env python
"""bench_offline part (a): how fast data gets into a replay -- packed inserts and dataset ingest.

    python -m scripts.bench.offline_ingest            # the whole part (a), a table
    python -m scripts.bench.offline_ingest --quick    # small sizes (1e6 items), a minute
    python -m scripts.bench.offline_ingest --json out.jsonl

Cases, all in one run, with this machine's memcpy rate measured in the same run (np.copyto
of 256 MiB, best of 5: the ceiling):
  packed-1step  N one-step hopper items (obs float32[11], action float32[3], reward float32,
                done bool: 61 B) into a gear_mpi Shard with ``insert_packed``: the first
                insert into a new shard (cold: the ring and table pages are committed by it;
                "new+cold": the Shard's construction too) and then --reps inserts into the full
                one (warm: each evicts all N).
  torchrl       TorchRL's ``ReplayBuffer(LazyTensorStorage(N)).extend`` of the very same
                arrays (scripts/peers/torchrl_ingest_worker.py, in TorchRL's own venv made by
                ``python -m scripts.bench.compare_peers --setup-only --peers torchrl``): cold
                (the storage allocated by the first extend; "new+cold": the ReplayBuffer's
                construction too, the fair cold comparison), then warm.
  insert_many   the same items as a list of dicts through ``insert_many`` (1e5 of them: the
                old way, for scale).
  packed-T1000  trajectories of T=1000 hopper steps, N steps in all, and of T=1000 wide steps
                (obs uint8[4096]), warm: GB/s of step data against memcpy.
  ingest-hdf5 / ingest-npz  ``gm.datasets.from_d4rl`` / ``from_npz_dir`` on 2 ranks (mpiexec) of a
                D4RL-layout dataset written first (hopper-sized: observations and
                next_observations float32[11], actions float32[3], rewards, terminals, timeouts;
                episodes of 1000 steps), read from the page cache (the files were just
                written): bytes of step data per second of the collective load, construction
                of the replay included, the slowest rank's time.
Times are wall-clock medians of --reps (the cold cases: one each). The machine is shared:
take the flock (/tmp/gear_tests.lock) and note what else ran.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.bench.bench_replay import memcpy_gbps
from scripts.peers.torchrl_ingest_worker import HOPPER_STEP, ingest_columns, step_bytes

ROOT = Path(__file__).resolve().parents[2]
TORCHRL_PY = Path.home() / ".cache" / "gear_mpi_peers" / "torchrl" / "venv" / "bin" / "python"


def hopper_spec(max_length: int):
    import gear_mpi as gm
    return gm.TrajectorySpec({k: (s, d) for k, (s, d) in HOPPER_STEP.items()}, max_length=max_length)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def packed_case(name: str, spec, cols: dict, lengths: np.ndarray, reps: int, capacity: int) -> dict:
    """Cold (first insert into a new shard) and warm (--reps inserts into the full one) packed inserts."""
    import gear_mpi as gm
    rows = int(lengths.sum())
    nbytes = rows * spec.step_bytes
    small = gm.Shard(spec, spec.max_length)  # compile/load the kernels before the clock runs
    small.insert_packed({k: v[:int(lengths[0])] for k, v in cols.items()}, lengths[:1])
    small.close()
    t0 = time.perf_counter()
    shard = gm.Shard(spec, capacity, max_items=max(len(lengths), 1))
    cold = timed(lambda: shard.insert_packed(cols, lengths))
    made_cold = time.perf_counter() - t0
    warm = [timed(lambda: shard.insert_packed(cols, lengths)) for _ in range(reps)]
    assert len(shard) == len(lengths)
    shard.close()
    w = statistics.median(warm)
    return {"case": name, "items": len(lengths), "steps": rows, "bytes": nbytes, "cold_s": cold, "made_cold_s": made_cold,
            "warm_s": w,
            "warm_all_s": warm, "warm_GBps": nbytes / w / 1e9, "items_per_s": len(lengths) / w}


def torchrl_case(n: int, reps: int, timeout: float) -> dict:
    if not TORCHRL_PY.exists():
        return {"case": "torchrl", "status": "unavailable",
                "reason": f"{TORCHRL_PY} missing: python -m scripts.bench.compare_peers --setup-only --peers torchrl"}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([str(TORCHRL_PY), "-m", "scripts.peers.torchrl_ingest_worker", json.dumps({"N": n, "reps": reps})],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
    rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not rows:
        return {"case": "torchrl", "status": "failed", "reason": r.stderr[-800:]}
    row = rows[-1]
    w = statistics.median(row["warm_s"])
    return {"case": "torchrl extend", "items": n, "bytes": n * row["step_bytes"], "cold_s": row["cold_s"],
            "made_cold_s": row.get("made_cold_s", float("nan")), "warm_s": w, "warm_all_s": row["warm_s"], "warm_GBps": n * row["step_bytes"] / w / 1e9,
            "items_per_s": n / w, "version": row["version"], "threads": row["threads"]}


def insert_many_case(n: int) -> dict:
    import gear_mpi as gm
    spec = hopper_spec(1)
    cols = ingest_columns(n)
    trajs = [{k: v[i:i + 1] for k, v in cols.items()} for i in range(n)]
    shard = gm.Shard(spec, n)
    shard.insert_many(trajs[:10])
    t = timed(lambda: shard.insert_many(trajs))
    shard.close()
    return {"case": "insert_many (list of dicts)", "items": n, "bytes": n * spec.step_bytes, "warm_s": t,
            "items_per_s": n / t, "warm_GBps": n * spec.step_bytes / t / 1e9}


def write_dataset(root: Path, steps: int, episode: int = 1000) -> dict:
    """A hopper-sized D4RL file and the same episodes as an npz directory."""
    import h5py
    rng = np.random.default_rng(0)
    n = steps
    timeouts = (np.arange(n) % episode) == episode - 1
    table = {"observations": rng.standard_normal((n, 11), dtype=np.float32),
             "actions": rng.standard_normal((n, 3), dtype=np.float32),
             "rewards": rng.standard_normal(n, dtype=np.float32),
             "terminals": np.zeros(n, np.bool_), "timeouts": timeouts,
             "next_observations": rng.standard_normal((n, 11), dtype=np.float32)}
    with h5py.File(root / "data.hdf5", "w") as f:
        for k, v in table.items():
            f.create_dataset(k, data=v)
    npz = root / "npz"
    npz.mkdir()
    for e, a in enumerate(range(0, n, episode)):
        np.savez(npz / f"ep_{e:06d}.npz", **{k: v[a:a + episode] for k, v in table.items()})
    return {"steps": n, "bytes": sum(v.nbytes for v in table.values())}


def ingest_worker(args) -> None:
    """Under mpiexec: time from_d4rl and from_npz_dir (collective), print one JSON line on rank 0."""
    from mpi4py import MPI
    import gear_mpi as gm
    comm = MPI.COMM_WORLD
    root = Path(args.ingest_worker)
    out = {}
    for name, load in (("ingest-hdf5", lambda: gm.datasets.from_d4rl(root / "data.hdf5", comm, progress=False)),
                       ("ingest-npz", lambda: gm.datasets.from_npz_dir(root / "npz", comm, progress=False))):
        times = []
        for _ in range(args.reps):
            comm.Barrier()
            t0 = time.perf_counter()
            replay = load()
            comm.Barrier()
            times.append(time.perf_counter() - t0)
            steps = comm.allreduce(replay.shard.store.live_steps)
            step_b = replay.spec.step_bytes
            replay.close()
        out[name] = {"times": times, "steps": steps, "bytes": steps * step_b}
    if comm.rank == 0:
        print(json.dumps(out), flush=True)


def ingest_cases(steps: int, reps: int, timeout: float) -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="gear_bench_ingest_"))
    try:
        write_dataset(tmp, steps)
        mpiexec = Path(sys.executable).parent / "mpiexec"
        cmd = [str(mpiexec if mpiexec.exists() else "mpiexec"), "-n", "2", sys.executable, "-m", "mpi4py", "-m",
               "scripts.bench.offline_ingest", "--ingest-worker", str(tmp), "--reps", str(reps)]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "NUMBA_NUM_THREADS": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)
        rows = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
        if r.returncode != 0 or not rows:
            return [{"case": "ingest", "status": "failed", "reason": (r.stdout + r.stderr)[-1500:]}]
        out = []
        for name, row in rows[-1].items():
            t = statistics.median(row["times"])
            out.append({"case": f"{name} (2 ranks)", "steps": row["steps"], "bytes": row["bytes"], "warm_s": t,
                        "warm_all_s": row["times"], "warm_GBps": row["bytes"] / t / 1e9})
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=float, default=None, help="one-step items and T=1000 steps (default 1e7; 1e6 quick)")
    ap.add_argument("--ingest-steps", type=float, default=None, help="dataset steps (default 4e6; 5e5 quick)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-torchrl", action="store_true")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON lines here")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--ingest-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ingest_worker:
        return ingest_worker(args)
    n = int(args.items or (1e6 if args.quick else 1e7))
    ingest_steps = int(args.ingest_steps or (5e5 if args.quick else 4e6))
    rows = [{"case": "memcpy (np.copyto 256 MiB, best of 5)", "warm_GBps": memcpy_gbps()}]
    cols = ingest_columns(n)
    rows.append(packed_case("packed-1step insert_packed", hopper_spec(1), cols, np.ones(n, np.int64), args.reps, n))
    if not args.no_torchrl:
        rows.append(torchrl_case(n, args.reps, args.timeout))
    rows.append(insert_many_case(min(n, 100_000)))
    t = 1000
    lengths = np.full(n // t, t, np.int64)
    rows.append(packed_case("packed-T1000 hopper", hopper_spec(t), {k: v[:len(lengths) * t] for k, v in cols.items()},
                            lengths, args.reps, int(lengths.sum())))
    del cols
    import gear_mpi as gm
    wide = gm.TrajectorySpec({"obs": ((4096,), np.uint8), "reward": ((), np.float32)}, max_length=t)
    wn = max(t, (n * 61 // 4100) // t * t)  # about the same bytes as the hopper case
    wcols = {"obs": np.random.default_rng(1).integers(0, 256, (wn, 4096), dtype=np.uint8),
             "reward": np.zeros(wn, np.float32)}
    rows.append(packed_case("packed-T1000 4 KiB steps", wide, wcols, np.full(wn // t, t, np.int64), args.reps, wn))
    del wcols
    rows.append({"case": "memcpy again", "warm_GBps": memcpy_gbps()})
    rows += ingest_cases(ingest_steps, args.reps, args.timeout)
    mem = statistics.mean([r["warm_GBps"] for r in rows if r["case"].startswith("memcpy")])
    print(f"{'case':40s} {'items':>10s} {'MB':>8s} {'cold s':>8s} {'new+cold':>8s} {'warm s':>8s} {'GB/s':>7s} "
          f"{'% memcpy':>8s}")
    for r in rows:
        if r.get("status"):
            print(f"{r['case']:40s} {r['status']}: {r['reason'][-300:]}")
            continue
        pct = 100 * r["warm_GBps"] / mem if "bytes" in r else 100.0
        print(f"{r['case']:40s} {r.get('items', r.get('steps', '')):>10} {r.get('bytes', 0) / 1e6:8.0f} "
              f"{r.get('cold_s', float('nan')):8.3f} {r.get('made_cold_s', float('nan')):8.3f} "
              f"{r.get('warm_s', float('nan')):8.3f} {r['warm_GBps']:7.2f} "
              f"{pct:7.0f}%")
    gear = next(r for r in rows if r["case"].startswith("packed-1step"))
    peer = next((r for r in rows if r["case"] == "torchrl extend"), None)
    if peer:
        print(f"packed-1step vs TorchRL extend: warm {peer['warm_s'] / gear['warm_s']:.2f}x, "
              f"cold {peer['cold_s'] / gear['cold_s']:.2f}x, construction + cold "
              f"{peer['made_cold_s'] / gear['made_cold_s']:.2f}x (>1: gear_mpi faster)")
    if args.json:
        with open(args.json, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
