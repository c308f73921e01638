#!/usr/bin/env python
"""Offline replay on files: sampling from a file-backed replay against TorchRL, and mapped reopen.

    python -m scripts.bench.bench_mmap --size-gb 1.5                 # both parts, TorchRL beside gear_mpi
    python -m scripts.bench.bench_mmap --size-gb 40 --dir /nvme/x    # larger than RAM (manual; disk space!)
    python -m scripts.bench.bench_mmap --parts c --size-gb 10        # only the reopen timings
    python -m scripts.bench.bench_mmap --json                        # one JSON object per case

Manual, not CI (issue 13, parts (b) and (c) of its bench_offline).

Data: ``--size-gb`` of image trajectories (obs uint8[84, 84, 4], action, reward, done:
28,237 bytes a step; ``--T`` steps each; scripts/peers/_offline.py makes the same bytes in
both processes), written into each system's files under ``--dir`` (default: a new directory
under /var/tmp, a disk, not tmpfs; removed at the end unless ``--keep``).

(b) Sampling ``--batch`` windows of ``--window`` steps, uniformly:
  gear_mpi  ``Replay(memory="file", path=dir, mode="local")`` (one rank): the columns are a
            memory-mapped file (MADV_RANDOM, ``--advice normal`` to compare), each sampled
            window's pages asked for at once (MADV_WILLNEED, ``--prefetch off`` to compare),
            then copied straight from the mapping into the batch.
  torchrl   ``ReplayBuffer(LazyMemmapStorage(N, scratch_dir=dir), SliceSampler(slice_len=W,
            traj_key="episode", cache_values=True), batch_size=B*W)``, in TorchRL's venv
            (``python -m scripts.bench.compare_peers --peers torchrl --setup-only`` makes it).
  cold: every page of the store written back and dropped from RAM (msync + MADV_PAGEOUT; the
  row's ``resident_after_evict`` shows it worked), then one sample, ``--cold-reps`` times (median and
  quartiles; ``disk_bytes_per_call``: what /proc/self/io says the sample had read from the disk);
  floor (``--floor on``, the default): after each cold call, the store evicted again and 64 other
  random windows' pages (every column, page-rounded, as the library's MADV_WILLNEED asks) read
  straight from the columns file with O_DIRECT from ``--floor-depth`` threads, no copy: what the disk
  alone takes for the bytes a cold call must read, the least any read path could take here (other
  windows than the call's, so the host's cache of what the call read does not help);
  warm: every page read once, then samples for ``--seconds``. GB/s = B * W * step bytes per
  call / the median call time. With ``--size-gb`` above RAM the warm case cannot be warm:
  it measures the steady state of a larger-than-RAM replay instead.
(c) Reopen: the gear_mpi replay of (b) saved, then ``Replay.load(cp)`` (plain: reads every byte),
  ``load(cp, mmap=True)`` (maps columns.bin) and ``load(cp, mmap=True, verify=True)`` (maps, and
  hashes every step), each from a cold page cache (the checkpoint's files dropped with
  POSIX_FADV_DONTNEED first) and warm; plus the first sample after a cold mapped reopen.

Figures move with the disk and the machine's other load: run under ``flock`` on shared machines
and say what else ran.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from scripts.peers._common import steady_loop
from scripts.peers._offline import IMAGE, evict, image_step_bytes, image_trajectory, read_bytes, resident

ROOT = Path(__file__).resolve().parents[2]


def log(*a) -> None:
    print("#", *a, file=sys.stderr, flush=True)


def available_memory() -> int:
    """MemAvailable of /proc/meminfo, in bytes."""
    with open("/proc/meminfo") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:"))


def drop_files(directory: str) -> None:
    """Drop every file under ``directory`` from the page cache (files nobody maps)."""
    for root, _, names in os.walk(directory):
        for n in names:
            fd = os.open(os.path.join(root, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def build_gear(args, directory: str):
    import mmap

    import gear_mpi as gm
    spec = gm.TrajectorySpec(IMAGE, max_length=args.T)
    t0 = time.perf_counter()
    replay = gm.Replay(spec, args.items * args.T, gm.Uniform(), mode="local", memory="file", path=directory, seed=0)
    for i in range(args.items):
        replay.insert(image_trajectory(i, args.T))
    fill_s = time.perf_counter() - t0
    arena = replay.shard.store.arena
    if args.advice == "normal":
        arena._mmap.madvise(mmap.MADV_NORMAL)
    replay.shard.store.prefetch_windows = args.prefetch == "on"
    return replay, fill_s


def _mapped_file(address: int) -> tuple[str, int]:
    """The /proc/self/map_files entry of the mapping holding ``address`` (the file may be unlinked;
    opening it needs root or CAP_SYS_ADMIN) and the mapping's start address."""
    with open("/proc/self/maps") as f:
        for line in f:
            span = line.split()[0]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= address < hi:
                if int(line.split()[2], 16) != 0:
                    raise OSError("the columns mapping does not start at offset 0 of its file")
                return f"/proc/self/map_files/{span}", lo
    raise OSError(f"no mapping holds {address:#x}")


class DirectFloor:
    """O_DIRECT reads of random windows' page ranges of a file-backed store's columns file, from a
    thread pool (``os.preadv`` releases the GIL), each thread into its own page-aligned buffer."""

    def __init__(self, store, window: int, depth: int):
        import mmap
        import threading
        from concurrent.futures import ThreadPoolExecutor
        path, lo = _mapped_file(store.arena.buffer.ctypes.data)
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.skew = store.arena.buffer.ctypes.data - lo
        self.store, self.window, self.page = store, window, mmap.PAGESIZE
        self.pool = ThreadPoolExecutor(depth)
        self.local = threading.local()
        self.biggest = max(c.step_bytes for c in store.spec.columns) * window + 2 * self.page

    def _read(self, span) -> int:
        import mmap
        buf = getattr(self.local, "buf", None)
        if buf is None:
            buf = self.local.buf = mmap.mmap(-1, self.biggest)
        a, b = span
        return os.preadv(self.fd, [memoryview(buf)[:b - a]], a)

    def spans(self, rng, batch: int) -> list:
        st, page = self.store, self.page
        starts = rng.integers(0, st.capacity - self.window + 1, batch)
        out = []
        for c in st.spec.columns:
            for s in starts.tolist():
                lo = self.skew + st.offsets[c.name] + s * c.step_bytes
                hi = lo + self.window * c.step_bytes
                out.append((lo - lo % page, -(-hi // page) * page))
        return out

    def read(self, spans: list) -> int:
        return sum(self.pool.map(self._read, spans))

    def close(self) -> None:
        self.pool.shutdown()
        os.close(self.fd)


def part_b_gear(args, directory: str, rows: list) -> "object":
    replay, fill_s = build_gear(args, directory)
    base = {"workload": "offline", "peer": "gear_mpi", "B": args.batch, "W": args.window, "T": args.T,
            "items": args.items, "step_bytes": image_step_bytes(), "advice": args.advice, "prefetch": args.prefetch,
            "bytes_per_call": args.batch * args.window * image_step_bytes()}
    rows.append({**base, "case": "fill", "seconds": fill_s, "gbps": args.items * args.T * image_step_bytes() / fill_s / 1e9})
    buf = replay.shard.store.arena.buffer
    b = replay.sample(args.batch, args.window)
    act = b["action"].numpy()
    i = int(act[0, 0]) // args.T
    assert np.array_equal(b["obs"].numpy()[0], image_trajectory(i, args.T)["obs"][int(act[0, 0]) % args.T:][:args.window])
    cold, disk, floor, floor_disk = [], [], [], []
    direct = None
    if args.floor == "on":
        try:
            direct = DirectFloor(replay.shard.store, args.window, args.floor_depth)
        except OSError as e:
            rows.append({"workload": "offline", "peer": "disk", "status": "failed",
                         "reason": f"no O_DIRECT floor: {e}"})
    rng = np.random.default_rng(7)
    for _ in range(args.cold_reps):
        evict(buf.ctypes.data, buf.nbytes)
        left = resident(buf.ctypes.data, buf.nbytes)
        d0 = read_bytes()
        t0 = time.perf_counter()
        replay.sample(args.batch, args.window)
        cold.append(time.perf_counter() - t0)
        disk.append(read_bytes() - d0)
        if direct is not None:
            spans = direct.spans(rng, args.batch)
            evict(buf.ctypes.data, buf.nbytes)
            d0 = read_bytes()
            t0 = time.perf_counter()
            direct.read(spans)
            floor.append(time.perf_counter() - t0)
            floor_disk.append(read_bytes() - d0)
    med = float(np.median(cold))
    rows.append({**base, "case": "cold", "median_call_s": med, "best_call_s": float(np.min(cold)), "calls": len(cold),
                 "q25_call_s": float(np.percentile(cold, 25)), "q75_call_s": float(np.percentile(cold, 75)),
                 "disk_bytes_per_call": float(np.median(disk)), "resident_after_evict": left,
                 "gbps": base["bytes_per_call"] / med / 1e9})
    if direct is not None:
        direct.close()
        fm = float(np.median(floor))
        rows.append({**base, "peer": "disk", "case": "cold floor", "median_call_s": fm, "best_call_s": float(np.min(floor)),
                     "calls": len(floor), "q25_call_s": float(np.percentile(floor, 25)),
                     "q75_call_s": float(np.percentile(floor, 75)), "depth": args.floor_depth,
                     "disk_bytes_per_call": float(np.median(floor_disk)), "gbps": base["bytes_per_call"] / fm / 1e9})
    store = replay.shard.store
    steady = buf.nbytes > 0.8 * available_memory()  # larger than RAM: no pass can make it warm
    for a in range(0, 0 if steady else buf.nbytes, 1 << 26):  # warm: every page in (MADV_RANDOM turns read-ahead
        store.will_read(buf[a:a + (1 << 26)])  # off: ask for each 64 MiB at once)
        int(buf[a:a + (1 << 26)].max())
    r = steady_loop(lambda: replay.sample(args.batch, args.window), args.seconds, warmup_s=0.3)
    rows.append({**base, "case": "warm", **r, "steady_state": steady,
                 "gbps": base["bytes_per_call"] / r["median_call_s"] / 1e9})
    return replay


def part_b_torchrl(args, directory: str, rows: list) -> None:
    py = args.cache / "torchrl" / "venv" / "bin" / "python"
    if not py.exists():
        rows.append({"workload": "offline", "peer": "torchrl", "status": "failed",
                     "reason": f"no TorchRL venv at {py} (python -m scripts.bench.compare_peers --peers torchrl "
                               f"--setup-only)"})
        return
    cfg = {"dir": directory, "items": args.items, "T": args.T, "B": args.batch, "W": args.window,
           "cold_reps": args.cold_reps, "seconds": args.seconds, "threads": args.threads}
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    try:
        p = subprocess.run([str(py), "-m", "scripts.peers.torchrl_mmap_worker", json.dumps(cfg)], cwd=str(ROOT),
                           capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        rows.append({"workload": "offline", "peer": "torchrl", "status": "failed",
                     "reason": f"timed out after {args.timeout:.0f} s"})
        return
    got = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    rows.extend(got)
    if p.returncode != 0:
        rows.append({"workload": "offline", "peer": "torchrl", "status": "failed",
                     "reason": f"exit {p.returncode}: {' '.join(p.stderr.split())[-600:]}"})


def part_c(args, replay, directory: str, rows: list) -> None:
    import gear_mpi as gm
    cp = os.path.join(directory, "checkpoint")
    t0 = time.perf_counter()
    replay.save(cp, progress=False)
    size = replay.stats()["total"]["live_steps"] * image_step_bytes()
    rows.append({"workload": "reopen", "case": "save", "seconds": time.perf_counter() - t0, "bytes": size})
    replay.close()
    for name, kw in (("plain", {}), ("mmap", {"mmap": True}), ("mmap+verify", {"mmap": True, "verify": True})):
        for cache in ("cold", "warm"):
            if cache == "cold":
                drop_files(cp)
            t0 = time.perf_counter()
            loaded, _ = gm.Replay.load(cp, progress=False, **kw)
            took = time.perf_counter() - t0
            row = {"workload": "reopen", "case": f"load {name}", "cache": cache, "seconds": took, "bytes": size,
                   "gbps": size / took / 1e9}
            if name == "mmap" and cache == "cold":
                t0 = time.perf_counter()
                loaded.sample(args.batch, args.window)
                row["first_sample_s"] = time.perf_counter() - t0
            rows.append(row)
            loaded.close()
            del loaded


class _Rows(list):
    """The result rows, each also logged (stderr) as it comes: a long run cut short keeps what it measured."""

    def append(self, row) -> None:
        log(json.dumps(row))
        super().append(row)

    def extend(self, rows) -> None:
        for r in rows:
            self.append(r)


def table(rows: list) -> None:
    print(f"{'part':>7} {'system':>9} {'case':>18} {'cache':>5} {'ms/call or s':>13} {'GB/s':>7}  notes")
    for r in rows:
        if r.get("status") == "failed":
            print(f"{r['workload']:>7} {r.get('peer', ''):>9} {'FAILED':>18} {'':>5} {'':>13} {'':>7}  {r['reason']}")
            continue
        if r["workload"] == "offline":
            if r["case"] == "fill":
                t, notes = f"{r['seconds']:.2f} s", ""
            else:
                t = f"{1e3 * r['median_call_s']:.2f} ms"
                notes = f"{r['calls']} calls, best {1e3 * r['best_call_s']:.2f} ms"
                if "q25_call_s" in r:
                    notes += f", quartiles {1e3 * r['q25_call_s']:.1f}-{1e3 * r['q75_call_s']:.1f} ms"
                if "resident_after_evict" in r:
                    notes += f", {r['resident_after_evict'] / 2**20:.1f} MiB resident after eviction"
                if r.get("disk_bytes_per_call", -1) >= 0:
                    notes += f", {r['disk_bytes_per_call'] / 1e6:.1f} MB read from disk a call"
                if r["peer"] == "disk":
                    notes += f"; O_DIRECT, {r['depth']} threads, no copy"
                elif "advice" in r:
                    notes += f"; MADV_{r['advice'].upper()}, prefetch {r['prefetch']}"
            print(f"{'(b)':>7} {r['peer']:>9} {r['case']:>18} {'':>5} {t:>13} {r['gbps']:7.2f}  {notes}")
        else:
            notes = f"{r['bytes'] / 1e9:.2f} GB of steps"
            if "first_sample_s" in r:
                notes += f"; first sample after it {1e3 * r['first_sample_s']:.1f} ms"
            gb = f"{r['gbps']:7.2f}" if "gbps" in r else f"{'':>7}"
            print(f"{'(c)':>7} {'gear_mpi':>9} {r['case']:>18} {r.get('cache', ''):>5} {r['seconds']:>11.3f} s "
                  f"{gb}  {notes}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=1.5, help="GB of steps in each system's store (default 1.5)")
    ap.add_argument("--T", type=int, default=500, help="steps per trajectory (default 500)")
    ap.add_argument("--batch", type=int, default=64, help="windows per sample (default 64)")
    ap.add_argument("--window", type=int, default=32, help="steps per window (default 32)")
    ap.add_argument("--cold-reps", type=int, default=8, help="cold samples, each after evicting the store (default 8)")
    ap.add_argument("--seconds", type=float, default=3.0, help="warm sampling time per system (default 3)")
    ap.add_argument("--parts", default="b,c", help="b (sampling), c (reopen), or both (default)")
    ap.add_argument("--peers", default="torchrl", help="'torchrl' or '' (gear_mpi alone)")
    ap.add_argument("--advice", default="random", choices=["random", "normal"],
                    help="gear_mpi's madvise on the columns (default random, the library's)")
    ap.add_argument("--prefetch", default="on", choices=["on", "off"],
                    help="gear_mpi's MADV_WILLNEED of each sampled window (store.prefetch_windows; default on)")
    ap.add_argument("--floor", default="on", choices=["on", "off"],
                    help="also time O_DIRECT reads of other random windows' pages after each cold call (default on)")
    ap.add_argument("--floor-depth", type=int, default=16, help="threads of the O_DIRECT floor (default 16)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads of the TorchRL worker")
    ap.add_argument("--dir", default=None, help="where the stores go (default: a new directory under /var/tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "gear_mpi_peers",
                    help="compare_peers' venv cache")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds allowed for the TorchRL worker")
    ap.add_argument("--json", action="store_true", help="JSON lines instead of the table")
    args = ap.parse_args()
    args.items = max(1, int(args.size_gb * 1e9 / (args.T * image_step_bytes())))
    parts = set(args.parts.split(","))
    directory = args.dir or tempfile.mkdtemp(prefix="gear_bench_mmap_", dir="/var/tmp")
    os.makedirs(directory, exist_ok=True)
    free = shutil.disk_usage(directory).free
    need = args.items * args.T * image_step_bytes() * (1 + ("torchrl" in args.peers) + ("c" in parts))
    log(f"{args.items} trajectories of {args.T} steps ({args.items * args.T * image_step_bytes() / 1e9:.2f} GB) per "
        f"system under {directory}; needs about {need / 1e9:.1f} GB of disk, {free / 1e9:.1f} GB free")
    if need > free:
        raise SystemExit("not enough disk for this --size-gb under --dir")
    rows: list = _Rows()
    try:
        gear_dir = os.path.join(directory, "gear")
        os.makedirs(gear_dir, exist_ok=True)
        replay = part_b_gear(args, gear_dir, rows) if "b" in parts else build_gear(args, gear_dir)[0]
        if "b" in parts and "torchrl" in args.peers:
            part_b_torchrl(args, os.path.join(directory, "torchrl"), rows)
        if "c" in parts:
            part_c(args, replay, gear_dir, rows)
        else:
            replay.close()
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        table(rows)
        g = {r["case"]: r for r in rows if r.get("peer") == "gear_mpi"}
        t = {r["case"]: r for r in rows if r.get("peer") == "torchrl" and "gbps" in r}
        for case in ("cold", "warm"):
            if case in g and case in t:
                print(f"# {case}: gear_mpi / TorchRL = {g[case]['gbps'] / t[case]['gbps']:.1f}x")
        if "cold" in g and "cold" in t and g["cold"].get("disk_bytes_per_call", -1) > 0:
            print(f"# cold disk reads a call: gear_mpi {g['cold']['disk_bytes_per_call'] / 1e6:.1f} MB, TorchRL "
                  f"{t['cold'].get('disk_bytes_per_call', -1) / 1e6:.1f} MB, for "
                  f"{g['cold']['bytes_per_call'] / 1e6:.1f} MB of windows")
        f = next((r for r in rows if r.get("peer") == "disk" and "gbps" in r), None)
        if f is not None and "cold" in g:
            line = (f"# cold floor (O_DIRECT, the same bytes, no copy): {1e3 * f['median_call_s']:.1f} ms; "
                    f"gear_mpi cold / floor = {g['cold']['median_call_s'] / f['median_call_s']:.2f}")
            if "cold" in t:
                line += f"; TorchRL cold / floor = {t['cold']['median_call_s'] / f['median_call_s']:.1f}x"
            print(line)


if __name__ == "__main__":
    main()
