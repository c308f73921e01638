#!/usr/bin/env python
"""Single-shard benchmarks of gear_mpi, each comparison measured side by side in one run.

Sections (one table each, one row per case: sizes and counts first, then time and
bandwidth, in the style of nccl-tests / the OSU micro-benchmarks):

  memcpy     this machine's copy rate: np.copyto of a 1 GiB buffer, best of several
  window     Shard.sample(B=256, W=64): delivered bytes (Batch.nbytes) per second, for a
             4 KiB-per-step column and for small hopper-like columns, beside memcpy
  priority   prioritized selection + priority update: PriorityIndex draw of B uniforms,
             then set of B new priorities; also a whole Shard with a Prioritized sampler
             (length-1 items) where filling one is feasible
  cpprb      the same cases on cpprb.PrioritizedReplayBuffer (sample + update_priorities),
             interleaved with the gear_mpi runs; ratio = cpprb time / gear_mpi time
  storage    stored bytes (Shard.stored_bytes) against raw bytes (Shard.raw_bytes)
  percall    small batches of one-step transitions, per call: sample(B, window=1) (+ update_priorities)
             for B = 32, 64, 256 beside SB3's ReplayBuffer.sample, gear_mpi's SB3 adapter and cpprb; one
             step's insert beside SB3's add (scripts/bench/bench_percall.py)

Times are the best of the repetitions (the median is printed too): on a shared
machine the best is the figure least disturbed by other work. --json prints one
JSON object per case, on its own line, instead of the tables.

    python -m scripts.bench.bench_shard            # full sizes (needs about 6 GiB free memory for N=1e8)
    python -m scripts.bench.bench_shard --quick    # small sizes, a few seconds
    python -m scripts.bench.bench_shard --json > shard.jsonl
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time

import numpy as np

import gear_mpi as gm
from gear_mpi.selection import PriorityIndex
from scripts.bench import bench_percall

GB = 1e9
MIB = 1 << 20
ALPHA, BETA = 0.6, 0.4

HOPPER = {"obs": ((11,), "float32"), "action": ((3,), "float32"), "reward": ((), "float32"), "done": ((), "bool")}


# ---- helpers --------------------------------------------------------------------------
def available_bytes() -> int:
    """MemAvailable from /proc/meminfo (the whole machine, not a cgroup limit), else 0."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
            else:
                return 0
    except OSError:
        return 0
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
            if raw != "max":
                limit = int(raw)
                used_path = path.replace("memory.max", "memory.current").replace("limit_in_bytes", "usage_in_bytes")
                with open(used_path) as f:
                    avail = min(avail, limit - int(f.read()))
        except (OSError, ValueError):
            pass
    return avail


def timed(fn, reps: int) -> list[float]:
    """Run ``fn`` once to warm up, then ``reps`` times; return the times in seconds."""
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def interleaved(fns: dict, reps: int, burst: int = 1) -> dict[str, list[float]]:
    """Time several functions in turn, so that they share the machine's noise.

    Each round runs every function ``burst`` times in a row (a burst keeps a function's
    caches and thread pool warm, as in a loop that calls it again and again); about
    ``reps`` timings per function in all.
    """
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(max(1, -(-reps // burst))):
        for k, fn in fns.items():
            for _ in range(burst):
                t = time.perf_counter()
                fn()
                times[k].append(time.perf_counter() - t)
    return times


def best(ts) -> float:
    return float(np.min(ts))


def med(ts) -> float:
    return float(np.median(ts))


class Report:
    """Collect rows; print tables (or JSON lines) as sections end."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def comment(self, text: str) -> None:
        if not self.as_json:
            print(f"# {text}", flush=True)

    def table(self, section: str, columns: list[tuple[str, str, str]], rows: list[dict]) -> None:
        """``columns``: (key, header, format); every row is also printed as JSON in --json mode."""
        if self.as_json:
            for r in rows:
                print(json.dumps({"section": section, **r}), flush=True)
            return
        cells = [[("-" if r.get(k) is None else (fmt.format(r[k]) if fmt else str(r[k]))) for k, _, fmt in columns]
                 for r in rows]
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
        print("#" + "  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths)), flush=True)
        for c in cells:
            print(" " + "  ".join(v.rjust(w) for v, w in zip(c, widths)), flush=True)
        for r in rows:
            if r.get("note"):
                print(f"#   {r['case']}: {r['note']}", flush=True)
        print(flush=True)


# ---- (0) memcpy -----------------------------------------------------------------------
class Memcpy:
    """np.copyto between two ``nbytes`` buffers; every copy timed in this run counts (best of all)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.src = np.ones(nbytes, np.uint8)
        self.dst = np.zeros(nbytes, np.uint8)
        np.copyto(self.dst, self.src)  # touch every page before timing
        self.times: list[float] = []

    def __call__(self) -> None:
        t = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.times.append(time.perf_counter() - t)

    @property
    def rate(self) -> float:
        return self.nbytes / best(self.times) / GB

    def report(self, rep: Report) -> None:
        rep.table("memcpy", [("case", "case", ""), ("bytes", "bytes", "{:d}"), ("time_ms", "time_ms", "{:.2f}"),
                             ("med_ms", "med_ms", "{:.2f}"), ("GBps", "GB/s", "{:.2f}")],
                  [{"case": "np.copyto (1 thread)", "bytes": self.nbytes, "time_ms": 1e3 * best(self.times),
                    "med_ms": 1e3 * med(self.times), "GBps": self.rate, "reps": len(self.times)}])
        rep.comment("memcpy: best of 5 copies before the window cases and one copy between the rounds of the 4 KiB "
                    "case (the same machine state as the gather it is compared with)")

    def free(self) -> None:
        del self.src, self.dst
        gc.collect()


# ---- (a) window sampling ----------------------------------------------------------------
def fill_fixed(shard: gm.Shard, columns: dict, length: int, steps: int, rng) -> None:
    """Insert trajectories of ``length`` steps until ``steps`` steps are stored (cheap contents)."""
    spec = shard.spec
    n = steps // length
    for i in range(n):
        traj = {}
        for c in spec.columns:
            if c.dtype == np.uint8:
                traj[c.name] = np.full((length,) + c.shape, i % 251, np.uint8)
            elif c.dtype == np.bool_:
                traj[c.name] = np.zeros((length,) + c.shape, np.bool_)
                traj[c.name][-1] = True
            else:
                traj[c.name] = rng.standard_normal((length,) + c.shape).astype(c.dtype)
        shard.insert(traj, priority=1.0)


def bench_window(rep: Report, memcpy: Memcpy, quick: bool, reps: int) -> list[dict]:
    from gear_mpi.kernels import gather as gk  # the kernel alone, to separate it from Shard overhead

    B, W = 256, 64
    rows = []
    cases = [("4KiB obs", {"obs": ((4096,), "uint8")}, (32 if quick else 256) * 1024, 1000),
             ("hopper", HOPPER, (100 if quick else 1000) * 1000, 1000)]
    for name, cols, steps, length in cases:
        spec = gm.TrajectorySpec(cols, max_length=length)
        rng = np.random.default_rng(0)
        shard = gm.Shard(spec, steps, seed=0)
        fill_fixed(shard, cols, length, steps, rng)
        batch = shard.sample(B, W)
        nbytes = batch.nbytes
        small = spec.step_bytes * W * B < 16 * MIB
        n = reps * (20 if small else 2) + 2
        # the gather kernels alone (no selection, no Batch, no metadata), cycling through 64 placements
        # drawn beforehand so that, like sample(), each call reads other windows
        placements = [shard.place(shard.select(B), W, 0) for _ in range(64)]
        views = shard.store.byte_views()
        rows_ = np.arange(B, dtype=np.int64)
        dsts = {c.name: batch.numpy()[c.name].reshape(-1).view(np.uint8) for c in spec.columns}
        mask = batch.mask.numpy()  # shares memory with the tensor
        turn = [0]

        def kernel_only():
            win_start, n_valid, pad_front = placements[turn[0] % 64]
            turn[0] += 1
            for c in spec.columns:
                gk.gather_windows(views[c.name], steps, c.step_bytes, win_start, n_valid, pad_front, rows_,
                                  dsts[c.name], W)
            gk.fill_mask(n_valid, pad_front, rows_, mask)

        # all in turn, round after round, so that they share the machine's state
        held = [None]  # a training loop's "batch = shard.sample(B, W)": the last batch lives until the call returns

        def new_held():
            held[0] = shard.sample(B, W)

        fns = {"new": lambda: shard.sample(B, W), "held": new_held, "out": lambda: shard.sample(B, W, out=batch),
               "kernel": kernel_only}
        if not small:
            fns["memcpy"] = memcpy  # records its own times
        times = interleaved(fns, n)
        held[0] = None
        t_new, t_held, t_out, t_k = times["new"], times["held"], times["out"], times["kernel"]
        base = {"B": B, "W": W, "step_bytes": spec.step_bytes, "columns": len(spec.columns),
                "ring_steps": steps, "batch_bytes": nbytes, "reps": n}
        for label, ts in [("Shard.sample, new Batch", t_new), ("Shard.sample, new Batch, last held", t_held),
                          ("Shard.sample, out=batch", t_out),
                          ("gather kernels only", t_k)]:
            rows.append({**base, "case": f"{name}: {label}", "time_us": 1e6 * best(ts), "med_us": 1e6 * med(ts),
                         "GBps": nbytes / best(ts) / GB})
        shard.close()
        del shard, batch
        gc.collect()
    memcpy.report(rep)
    for r in rows:
        r["memcpy_GBps"] = memcpy.rate
        r["pct_memcpy"] = 100 * r["GBps"] / memcpy.rate
    rep.table("window", [("case", "case", ""), ("B", "B", "{:d}"), ("W", "W", "{:d}"),
                         ("step_bytes", "step_B", "{:d}"), ("ring_steps", "ring_steps", "{:d}"),
                         ("batch_bytes", "batch_bytes", "{:d}"), ("time_us", "time_us", "{:.1f}"),
                         ("med_us", "med_us", "{:.1f}"), ("GBps", "GB/s", "{:.2f}"),
                         ("pct_memcpy", "%memcpy", "{:.0f}")], rows)
    rep.comment("new Batch: a new Batch per call, dropped at once (from 32 MiB its memory is a dropped batch's, "
                "gear_mpi.batch_memory; below, numpy's allocation); last held: the same, the previous batch held "
                "until the call returns (batch = shard.sample(B, W) in a loop); out=batch: one Batch reused across "
                "calls; gather kernels only: "
                "gather_windows per column + fill_mask on windows placed beforehand, no selection or metadata "
                "(the difference to out=batch is Shard-level overhead). The cases run in turn, round after round.")
    return rows


# ---- (b, c) prioritized selection + update -------------------------------------------------
def gear_bytes(n: int) -> int:
    return int(8.3 * n) + 16 * min(n, 10_000_000)  # index + fill temporaries (filled in chunks)


def cpprb_bytes(n: int) -> int:
    return 4 * n + 16 * (1 << max(0, int(n - 1).bit_length()))  # obs + sum and min trees (float32, 2 * 2^k nodes)


def bench_priority(rep: Report, quick: bool, reps: int, use_cpprb: bool) -> list[dict]:
    try:
        import cpprb
    except ImportError:
        cpprb = None
        rep.comment("cpprb is not importable: no cpprb comparison (pip install cpprb)")
    if not use_cpprb:
        cpprb = None
    # (256, 1e7): an SB3-size batch over a large index, consecutive sorted draws some ten level-2 blocks apart
    cases = [(256, 100_000), (8192, 1_000_000)] if quick else [(256, 100_000), (256, 10_000_000),
                                                                (65536, 10_000_000), (1_000_000, 100_000_000)]
    rows = []
    for B, N in cases:
        base = {"B": B, "N": N}
        need = gear_bytes(N)
        avail = available_bytes()
        if avail and need * 1.5 > avail:
            rows.append({**base, "case": "PriorityIndex draw+set", "note": f"skipped: needs about {need / 2**30:.1f} "
                         f"GiB (x1.5 margin), {avail / 2**30:.1f} GiB available"})
            continue
        n_reps = max(3, reps // 2) if B > 100_000 else reps * max(1, min(15, 20_000 // B))
        n_reps = max(n_reps, 9) if B <= 100_000 else n_reps
        rng = np.random.default_rng(0)
        idx = PriorityIndex(N)
        p0 = rng.random(N) + 0.01
        chunk = 10_000_000
        for lo in range(0, N, chunk):
            hi = min(N, lo + chunk)
            idx.set(np.arange(lo, hi, dtype=np.int64), np.power(p0[lo:hi], ALPHA))
        new_p = rng.random(B) + 0.01
        out = np.empty(B, np.int64)
        sel = gm.Prioritized(ALPHA, BETA)

        def gear_draw_set():
            slots = idx.draw(rng.random(B), out)
            idx.set(slots, np.power(new_p, ALPHA))

        def gear_full():  # what a replay does besides the data copy: + probabilities and importance weights
            slots = idx.draw(rng.random(B), out)
            w = idx.leaves[slots]
            _ = w / idx.total
            _ = sel.importance_weights(w, idx.min_positive)
            idx.set(slots, sel.weights(new_p))

        fns = {"gear": gear_draw_set, "gear_full": gear_full}
        # the two halves alone, for the table
        u = rng.random(B)
        fns_parts = {"draw": lambda: idx.draw(u, out), "set": lambda: idx.set(out, np.power(new_p, ALPHA))}
        rb = None
        note = None
        if cpprb is not None:
            need_c = cpprb_bytes(N)
            avail = available_bytes()
            if avail and (need_c * 1.3 > avail):
                note = (f"cpprb skipped: its buffer needs about {need_c / 2**30:.1f} GiB, "
                        f"{avail / 2**30:.1f} GiB available")
            else:
                t0 = time.perf_counter()
                rb = cpprb.PrioritizedReplayBuffer(N, {"obs": {"shape": 1}}, alpha=ALPHA)
                for lo in range(0, N, 1_000_000):
                    hi = min(N, lo + 1_000_000)
                    rb.add(obs=np.zeros((hi - lo, 1), np.float32), priorities=p0[lo:hi])
                fill_s = time.perf_counter() - t0
                assert rb.get_stored_size() == N

                def cpprb_step():
                    s = rb.sample(B, beta=BETA)
                    rb.update_priorities(s["indexes"], new_p)

                fns["cpprb"] = cpprb_step
                note = f"cpprb filled to N in {fill_s:.1f} s"
        del p0
        burst = 3 if n_reps >= 9 else 1
        times = interleaved(fns, n_reps, burst)
        parts = interleaved(fns_parts, n_reps, burst)
        row = {**base, "case": "PriorityIndex draw+set", "reps": n_reps,
               "draw_ms": 1e3 * best(parts["draw"]), "set_ms": 1e3 * best(parts["set"]),
               "time_ms": 1e3 * best(times["gear"]), "med_ms": 1e3 * med(times["gear"]),
               "full_ms": 1e3 * best(times["gear_full"]),
               "Mdraws_per_s": B / best(times["gear"]) / 1e6}
        if "cpprb" in times:
            row["cpprb_ms"] = 1e3 * best(times["cpprb"])
            row["cpprb_med_ms"] = 1e3 * med(times["cpprb"])
            row["ratio"] = best(times["cpprb"]) / best(times["gear"])
            row["ratio_full"] = best(times["cpprb"]) / best(times["gear_full"])
        row["note"] = note
        rows.append(row)
        del idx, rb, fns, times, parts
        gc.collect()
        # a whole Shard with a Prioritized sampler, length-1 items: the small case only (insert_many
        # validates each trajectory in Python, so filling 1e7 items would take minutes)
        if N <= 100_000:
            rows.append(bench_shard_prioritized(B, N, n_reps, cpprb))
    rep.table("priority", [("case", "case", ""), ("B", "B", "{:d}"), ("N", "N", "{:d}"),
                           ("draw_ms", "draw_ms", "{:.3f}"), ("set_ms", "set_ms", "{:.3f}"),
                           ("time_ms", "gear_ms", "{:.3f}"), ("med_ms", "gear_med", "{:.3f}"),
                           ("full_ms", "gear+w_ms", "{:.3f}"), ("cpprb_ms", "cpprb_ms", "{:.3f}"),
                           ("ratio", "cpprb/gear", "{:.2f}"), ("ratio_full", "cpprb/gear+w", "{:.2f}")], rows)
    return rows


def bench_shard_prioritized(B: int, N: int, n_reps: int, cpprb) -> dict:
    spec = gm.TrajectorySpec({"obs": ((1,), "float32")}, max_length=1)
    rng = np.random.default_rng(1)
    p0 = rng.random(N) + 0.01
    obs = np.zeros((N, 1), np.float32)
    shard = gm.Shard(spec, N, gm.Prioritized(ALPHA, BETA), seed=0)
    t0 = time.perf_counter()
    chunk = 10_000
    for lo in range(0, N, chunk):
        shard.insert_many([{"obs": obs[i:i + 1]} for i in range(lo, min(N, lo + chunk))], p0[lo:lo + chunk])
    fill_s = time.perf_counter() - t0
    new_p = rng.random(B) + 0.01
    batch = shard.sample(B, 1)

    def shard_step():
        shard.sample(B, 1, out=batch)
        shard.update_priorities(batch.keys, new_p)

    fns = {"gear": shard_step}
    if cpprb is not None:
        rb = cpprb.PrioritizedReplayBuffer(N, {"obs": {"shape": 1}}, alpha=ALPHA)
        rb.add(obs=obs, priorities=p0)

        def cpprb_step():
            s = rb.sample(B, beta=BETA)
            rb.update_priorities(s["indexes"], new_p)

        fns["cpprb"] = cpprb_step
    times = interleaved(fns, n_reps, 3)
    row = {"case": "Shard(Prioritized) sample+update", "B": B, "N": N, "reps": n_reps,
           "time_ms": 1e3 * best(times["gear"]), "med_ms": 1e3 * med(times["gear"]),
           "Mdraws_per_s": B / best(times["gear"]) / 1e6,
           "note": f"window=1, out= batch reused, keys/priorities/weights/probabilities included; "
                   f"filled with insert_many in {fill_s:.1f} s"}
    if "cpprb" in times:
        row["cpprb_ms"] = 1e3 * best(times["cpprb"])
        row["cpprb_med_ms"] = 1e3 * med(times["cpprb"])
        row["ratio"] = best(times["cpprb"]) / best(times["gear"])
    shard.close()
    return row


# ---- (d) storage -------------------------------------------------------------------------
def bench_storage(rep: Report, quick: bool) -> list[dict]:
    rows = []
    steps = (100 if quick else 1000) * 1000
    for label, lengths in [("hopper, T=1000", None), ("hopper, T~U[100,1000], wrapped", (100, 1000))]:
        spec = gm.TrajectorySpec(HOPPER, max_length=1000)
        rng = np.random.default_rng(2)
        shard = gm.Shard(spec, steps, gm.Prioritized(ALPHA, BETA), seed=0)
        if lengths is None:
            fill_fixed(shard, HOPPER, 1000, steps, rng)
        else:
            inserted = 0
            while inserted < 2 * steps:  # go round the ring twice: eviction, wrap-around
                t = int(rng.integers(lengths[0], lengths[1] + 1))
                shard.insert({"obs": rng.standard_normal((t, 11)).astype(np.float32),
                              "action": rng.standard_normal((t, 3)).astype(np.float32),
                              "reward": rng.standard_normal(t).astype(np.float32),
                              "done": np.arange(t) == t - 1}, priority=float(rng.random() + 0.01))
                inserted += t
        stored, raw = shard.stored_bytes(), shard.raw_bytes()
        rows.append({"case": label, "items": len(shard), "step_bytes": spec.step_bytes,
                     "ring_steps": steps, "raw_bytes": raw, "stored_bytes": stored,
                     "overhead_pct": 100 * (stored - raw) / raw,
                     "ring_fill_pct": 100 * shard.stats()["steps_used"] / steps})
        shard.close()
    rep.table("storage", [("case", "case", ""), ("items", "items", "{:d}"), ("step_bytes", "step_B", "{:d}"),
                          ("ring_steps", "ring_steps", "{:d}"), ("raw_bytes", "raw_bytes", "{:d}"),
                          ("stored_bytes", "stored_bytes", "{:d}"), ("overhead_pct", "stored/raw-1 %", "{:.2f}"),
                          ("ring_fill_pct", "ring_used %", "{:.1f}")], rows)
    rep.comment("stored = ring steps in use + one table row and one index leaf per live item (Shard.stored_bytes)")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes (256 MiB memcpy, N up to 1e6), a few seconds")
    ap.add_argument("--json", action="store_true", help="one JSON object per case, on its own line")
    ap.add_argument("--reps", type=int, default=None,
                    help="repetitions per timing, scaled up for small cases (default 20; 5 with --quick)")
    ap.add_argument("--sections", default="memcpy,window,priority,storage,percall",
                    help="comma-separated subset of memcpy,window,priority,storage,percall (window measures memcpy "
                         "too)")
    ap.add_argument("--no-cpprb", action="store_true", help="do not run the cpprb comparison")
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 5 if args.quick else 20
    if args.reps < 1:
        ap.error("--reps must be at least 1")
    sections = set(args.sections.split(","))
    rep = Report(args.json)
    import numba
    rep.comment(f"gear_mpi {gm.__version__} bench_shard: {platform.node()}, {os.cpu_count()} CPUs, "
                f"numba {numba.__version__} ({numba.config.NUMBA_NUM_THREADS} threads), numpy {np.__version__}, "
                f"load average {os.getloadavg()[0]:.2f}, {available_bytes() / 2**30:.1f} GiB available")
    rep.comment("times: best of the repetitions (med = median); GB/s = 1e9 bytes per second")
    window = priority = storage = []
    if "memcpy" in sections or "window" in sections:
        memcpy = Memcpy((256 if args.quick else 1024) * MIB)
        for _ in range(5):
            memcpy()
        if "window" in sections:
            window = bench_window(rep, memcpy, args.quick, args.reps)
        else:
            memcpy.report(rep)
        memcpy.free()
    if "priority" in sections:
        priority = bench_priority(rep, args.quick, args.reps, not args.no_cpprb)
    if "storage" in sections:
        storage = bench_storage(rep, args.quick)
    percall = []
    if "percall" in sections:
        percall = bench_percall.bench_percall(10_000 if args.quick else 100_000, rounds=max(3, args.reps),
                                              use_cpprb=not args.no_cpprb)
        rep.table("percall", [("case", "case", ""), ("B", "B", "{:d}"), ("N", "N", "{:d}"), ("us", "us/call", "{:.1f}"),
                              ("med_us", "med_us", "{:.1f}")], percall)
        rep.comment(f"percall: one-step transitions; best of rounds of {bench_percall.CALLS} consecutive calls, "
                    "the cases interleaved round by round")
        for text, value in bench_percall.torch_ratios(percall):
            rep.comment(f"information: {text}: {value:.2f}")
    report_targets(rep, window, priority, storage, percall)
    return 0


def report_targets(rep: Report, window: list[dict], priority: list[dict], storage: list[dict],
                   percall: list[dict] = ()) -> None:
    """The issue's targets, checked on this run's figures."""
    rows = []

    def add(target, value, ok, unit=""):
        rows.append({"case": target, "value": value, "unit": unit, "met": "yes" if ok else "NO"})

    for r in window:
        if r["case"].startswith("4KiB obs: Shard.sample"):
            add(f"{r['case']} >= 60% of memcpy", r["pct_memcpy"], r["pct_memcpy"] >= 60, "%")
    for r in priority:
        if r["case"] == "PriorityIndex draw+set" and r.get("ratio") is not None:
            if (r["B"], r["N"]) == (65536, 10_000_000):
                add("cpprb/gear at B=65536, N=1e7 >= 3 (draw+set)", r["ratio"], r["ratio"] >= 3, "x")
                add("cpprb/gear at B=65536, N=1e7 >= 3 (+IS weights)", r["ratio_full"], r["ratio_full"] >= 3, "x")
            if (r["B"], r["N"]) == (256, 100_000):
                add("cpprb/gear at B=256, N=1e5 >= 1 (draw+set)", r["ratio"], r["ratio"] >= 1, "x")
        if r["case"].startswith("Shard(") and r.get("ratio") is not None:
            add(f"cpprb/Shard at B={r['B']}, N={r['N']} >= 1 (whole sample+update)", r["ratio"], r["ratio"] >= 1, "x")
    for r in storage:
        if r["case"] == "hopper, T=1000":
            add("stored bytes within 5% of raw (hopper, T=1000)", r["overhead_pct"], abs(r["overhead_pct"]) <= 5, "%")
    if percall:
        for target, value, ok in bench_percall.targets(list(percall)):
            add(target, value, ok, "x")
    if rows:
        rep.table("targets", [("case", "target", ""), ("value", "value", "{:.2f}"), ("unit", "", ""),
                              ("met", "met", "")], rows)


if __name__ == "__main__":
    sys.exit(main())
