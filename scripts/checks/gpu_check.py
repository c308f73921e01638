#!/usr/bin/env python3
"""Check gear_mpi's CUDA kernels on a machine with an NVIDIA GPU (about 1-3 minutes, under 5).

Prints one table (``--json``: one JSON object instead), one row per case:

- ``match``      each CUDA kernel against its CPU kernel at full size (draws, leaf updates
                 with duplicates, full rebuild, window gather at every vector width, mask):
                 ``yes`` only when the results are identical, bit for bit;
- ``bandwidth``  the zero-copy window gather reading pinned, mapped host memory
                 (``gear_mpi.storage.pinned``), beside a host-to-device copy of the same number of
                 bytes (from pinned and from pageable memory), a gather from device memory
                 and the CPU gather -- all measured in this run;
- ``selection``  B=1e6 prioritized draws over N=1e8 and N=1e9 leaves (N=1e9 when device
                 memory allows), batched updates and rebuilds, beside ``torch.multinomial``
                 on the same priorities. ``torch.multinomial`` accepts at most 2**24
                 categories: for larger N the table says so, and both are also timed at
                 N=2**24, the largest size it accepts;
- ``sample``     one rank's sample on the GPU: ``gear_mpi.Replay(..., device="cuda")`` where
                 this gear_mpi has it, otherwise a ``Shard`` selection followed by the CUDA
                 gather from the shard's mapped arena, checked against ``Shard``'s CPU gather.

Times are medians of ``--reps`` runs after a warm-up (host clock around a device
synchronisation; kernel compilation excluded). GB/s counts delivered batch bytes.

Without a GPU it prints why and exits 0. ``--sim`` runs the same logic on the numba CUDA
simulator at tiny sizes (timings then mean nothing); the test suite does that.
Exit status: 0 when every check matched, 1 on a mismatch or an error.

    python -m scripts.checks.gpu_check            # on a GPU node
    python -m scripts.checks.gpu_check --json > gpu_check.json
    python -m scripts.checks.gpu_check --sim      # anywhere
"""
from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
import traceback
import warnings

import numpy as np

TORCH_MAX_CATEGORIES = 2 ** 24
SECTIONS = ("match", "bandwidth", "selection", "sample")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--sim", action="store_true", help="run on the numba CUDA simulator at tiny sizes")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--n", type=float, nargs="+", default=None,
                   help="leaf counts for the selection timing (default: 1e8 1e9)")
    p.add_argument("--batch", type=float, default=None, help="draws per selection (default 1e6)")
    p.add_argument("--parity-n", type=float, default=None, help="leaves for the match checks (default 1e8)")
    p.add_argument("--gather-mib", type=float, default=None,
                   help="delivered MiB per gather in the bandwidth rows (default 256)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS),
                   help="which sections to run (default: all)")
    return p.parse_args(argv)


class Sizes:
    def __init__(self, args):
        sim = args.sim
        self.sim = sim
        self.threads = 32 if sim else 256
        self.parity_n = int(args.parity_n or (5000 if sim else 1e8))
        self.parity_b = 200 if sim else 1_000_000
        self.sel_n = [int(x) for x in (args.n or ([3000, 9000] if sim else [1e8, 1e9]))]
        self.sel_b = int(args.batch or (200 if sim else 1e6))
        self.torch_n = 4000 if sim else TORCH_MAX_CATEGORIES
        self.reps = args.reps or (2 if sim else 10)
        # gather: ring of `cap` steps of `sb` bytes; `gb` windows of `gw` steps
        self.gw = 4 if sim else 64
        self.sb = 1024 if not sim else 32
        out_bytes = int((args.gather_mib or 256) * 2 ** 20) if not sim else 8 * 4 * 32
        self.gb = max(1, out_bytes // (self.gw * self.sb))
        self.cap = 48 if sim else max(4 * self.gb * self.gw, 2 ** 30 // self.sb)  # >= 1 GiB ring on a GPU
        self.sample_b = 8 if sim else 4096
        self.sample_w = 4 if sim else 64
        self.sample_cap = 300 if sim else 1_000_000
        self.sample_len = 20 if sim else 1000


class Report:
    def __init__(self):
        self.rows: list[dict] = []
        self.notes: list[str] = []

    def add(self, section, case, size="", value=None, unit="", match=None, note="", error=None):
        row = {"section": section, "case": case, "size": size, "value": value, "unit": unit,
               "match": None if match is None else ("yes" if match else "no"), "note": note}
        if error:
            row["error"] = error
        self.rows.append(row)
        return row

    @property
    def ok(self) -> bool:
        return all(r["match"] != "no" and not r.get("error") for r in self.rows)

    def table(self) -> str:
        head = ("section", "case", "size", "value", "unit", "match", "note")
        lines = []
        for r in self.rows:
            v = r["value"]
            v = "" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))
            note = r["note"] if not r.get("error") else f"ERROR: {r['error']}"
            lines.append((r["section"], r["case"], str(r["size"]), v, r["unit"], r["match"] or "", note))
        w = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{k}}}" if i != 3 else f"{{:>{k}}}" for i, k in enumerate(w[:-1])) + "  {}"
        out = [fmt.format(*head), fmt.format(*("-" * k for k in w[:-1]), "-" * 4)]
        out += [fmt.format(*x) for x in lines]
        return "\n".join(out)


def human(n: int) -> str:
    for e, s in ((9, "e9"), (8, "e8"), (7, "e7"), (6, "e6")):
        if n >= 10 ** e and n % 10 ** e == 0:
            return f"{n // 10 ** e}{s}"
    if n >= 1024 and n & (n - 1) == 0:
        return f"2**{n.bit_length() - 1}"
    return str(n)


def section(report, name):
    """Run a section; an exception becomes an error row instead of ending the script."""
    def wrap(fn):
        def run(*a, **k):
            try:
                return fn(*a, **k)
            except Exception as exc:  # noqa: BLE001 - reported, and the exit status says so
                traceback.print_exc(file=sys.stderr)
                first = str(exc).splitlines()[0] if str(exc) else ""
                report.add(name, fn.__name__, error=f"{type(exc).__name__}: {first}")
        return run
    return wrap


class Checker:
    def __init__(self, args, sizes: Sizes, report: Report):
        from numba import cuda
        from gear_mpi.kernels import cuda_gather as cg
        from gear_mpi.kernels import cuda_priority as cp
        self.cuda, self.cg, self.cp = cuda, cg, cp
        self.args, self.z, self.report = args, sizes, report
        self.rng = np.random.default_rng(args.seed)
        self.random_weights = _make_random_weights_kernel()

    # ---- helpers ---------------------------------------------------------------------------
    def sync(self):
        self.cuda.synchronize()

    def time(self, fn, reps=None) -> float:
        """Median seconds of ``fn()`` (device work synchronised), after one warm-up call."""
        fn()
        self.sync()
        ts = []
        for _ in range(reps or self.z.reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            ts.append(time.perf_counter() - t0)
        return float(np.median(ts))

    def free_device_bytes(self) -> float:
        try:
            free, _ = self.cuda.current_context().get_memory_info()
            return float(free)
        except Exception:  # noqa: BLE001
            return math.inf

    def release(self):
        """Free device memory of dropped arrays now (numba defers deallocation)."""
        import gc
        gc.collect()
        try:
            self.cuda.current_context().deallocations.clear()
        except Exception:  # noqa: BLE001
            pass

    def host_weights(self, n):
        w = self.rng.random(n)
        w *= w
        w[self.rng.random(n) < 0.2] = 0.0
        return w

    # ---- match: each kernel against the CPU kernel ---------------------------------------------
    def match_priority(self):
        from gear_mpi.selection import DevicePriorityIndex, PriorityIndex
        z, cp, rep = self.z, self.cp, self.report
        n, b = z.parity_n, z.parity_b
        size = f"N={human(n)} B={human(b)}"
        from gear_mpi.kernels import leaf_values
        w = leaf_values(self.host_weights(n))  # float32 values: what the host index's leaves hold
        idx = PriorityIndex(n)
        idx.leaves[:] = w
        idx.rebuild()
        dev = DevicePriorityIndex.from_host(idx, threads=z.threads)
        u = self.rng.random(b)
        u[:2] = [0.0, np.nextafter(1.0, 0.0)]
        cpu = idx.draw(u)
        cpu_out = np.empty(b, np.int64)
        t_cpu = self.time(lambda: idx.draw(u, cpu_out), reps=3)
        gpu = dev.draw(u).copy_to_host()
        rep.add("match", "draw (prioritized)", size, match=np.array_equal(cpu, gpu) and bool((w[gpu] > 0).all()),
                note=f"{int((cpu != gpu).sum())} of {b} draws differ" if not np.array_equal(cpu, gpu) else "")
        self.cpu_draw = (n, b, t_cpu)
        # rebuild from leaves on the device
        d2 = DevicePriorityIndex(n, threads=z.threads)
        d2.leaves.copy_to_device(w)
        d2.rebuild()
        rep.add("match", "rebuild (all levels + prefix)", f"N={human(n)}", match=self.same(d2, idx))
        del d2
        self.release()
        # batched updates with duplicates (a quarter of the batch hits 1/16 as many slots)
        slots = self.rng.integers(0, n, b)
        q = b // 4
        slots[:q] = self.rng.choice(slots[q:2 * q], q) if q else slots[:q]
        values = self.rng.random(b) * (self.rng.random(b) > 0.1)
        idx.set(slots, values)
        dev.set(slots, values)
        rep.add("match", "set_leaves (duplicates: last wins)", size, match=self.same(dev, idx))
        rep.add("match", "total / min_positive", f"N={human(n)}",
                match=dev.total == idx.total and dev.min_positive == idx.min_positive,
                note=f"total {dev.total:.17g} vs {idx.total:.17g}")
        u = self.rng.random(b)
        rep.add("match", "draw after updates", size,
                match=np.array_equal(dev.draw(u).copy_to_host(), idx.draw(u)))
        del dev, idx
        self.release()

    def same(self, dev, idx) -> bool:
        h = dev.to_host()
        return all(np.array_equal(h[k], getattr(idx, k)) for k in h)

    def match_gather(self):
        from gear_mpi.storage import pinned
        from gear_mpi.kernels import gather as g
        z, cg, cuda, rep = self.z, self.cg, self.cuda, self.report
        window, b = z.gw, z.gb
        for sb in (z.sb, z.sb + 4, z.sb + 3):
            cap = max(2 * window, min(z.cap, (2 ** 30 if not z.sim else 10 ** 9) // sb))
            ring = self.rng.integers(0, 256, cap * sb, dtype=np.uint8)
            starts, n_valid, pad_front, rows = self.windows(cap, window, b)
            ref = np.full(b * window * sb, 0xAB, np.uint8)
            g.gather_windows(ring, cap, sb, starts, n_valid, pad_front, rows, ref, window)
            mask_ref = np.ones((b, window), np.bool_)
            g.fill_mask(n_valid, pad_front, rows, mask_ref)
            with pinned.map_host(ring) as m:
                d_idx = [cuda.to_device(a) for a in (starts, n_valid, pad_front, rows)]
                out = cuda.device_array(b * window * sb, np.uint8)
                for vec in (16, 8, 0) if sb == z.sb else (16,):
                    self.cp.fill(out, 0xAB, z.threads)
                    cg.gather_windows(m.device, cap, sb, *d_idx, out, window, threads=z.threads, vec=vec)
                    got = out.copy_to_host()
                    rep.add("match", f"gather zero-copy vec={vec} step={sb}B", f"B={b} W={window}",
                            match=np.array_equal(got, ref),
                            note="wrap, head/tail padding" + ("" if sb % 16 == 0 else "; rows mostly unaligned"))
                mask = cuda.to_device(np.ones((b, window), np.bool_))
                cg.fill_mask(*d_idx[1:], mask, threads=z.threads)
            if sb == z.sb:
                rep.add("match", "fill_mask", f"B={b} W={window}", match=np.array_equal(mask.copy_to_host(), mask_ref))
            del ring, ref, out, mask
            self.release()

    def windows(self, cap, window, b):
        rng = self.rng
        starts = rng.integers(0, cap, b)
        starts[: min(b, 2)] = [cap - 1, cap - window // 2][: min(b, 2)]   # wrap around the ring end
        n_valid = np.where(rng.random(b) < 0.7, window, rng.integers(1, window + 1, b))
        pad_front = np.where(rng.random(b) < 0.5, window - n_valid, 0)
        rows = rng.permutation(b)
        return [np.ascontiguousarray(a, np.int64) for a in (starts, n_valid, pad_front, rows)]

    # ---- bandwidth -------------------------------------------------------------------------------
    def bandwidth(self):
        from gear_mpi.storage import pinned
        from gear_mpi.kernels import gather as g
        z, cg, cuda, rep = self.z, self.cg, self.cuda, self.report
        window, b, sb, cap = z.gw, z.gb, z.sb, z.cap
        ring = np.empty(cap * sb, np.uint8)
        ring[:] = 7  # commit the pages
        starts = self.rng.integers(0, cap, b).astype(np.int64)
        full = np.full(b, window, np.int64)
        zero = np.zeros(b, np.int64)
        rows = np.arange(b, dtype=np.int64)
        nbytes = b * window * sb
        size = f"B={b} W={window} {sb}B/step"
        t0 = time.perf_counter()
        m = pinned.map_host(ring)
        t_map = time.perf_counter() - t0
        try:
            out = cuda.device_array(nbytes, np.uint8)
            d_idx = [cuda.to_device(a) for a in (starts, full, zero, rows)]
            for vec in (16, 8, 0):
                t = self.time(lambda: cg.gather_windows(m.device, cap, sb, *d_idx, out, window, z.threads, vec))
                rep.add("bandwidth", f"gather zero-copy (pinned host) vec={vec}", size, nbytes / t / 1e9, "GB/s",
                        note=f"{nbytes / 2 ** 20:.0f} MiB in {t * 1e3:.2f} ms")
            src = ring[:nbytes] if nbytes <= ring.nbytes else ring
            t = self.time(lambda: out[:src.nbytes].copy_to_device(src))
            rep.add("bandwidth", "host-to-device copy (pinned)", f"{src.nbytes / 2 ** 20:.0f} MiB",
                    src.nbytes / t / 1e9, "GB/s", note="same bytes, one contiguous copy")
            # the target (zero-copy gather >= 90% of a host-to-device copy): both, alternating, in rounds, since
            # the copy's rate differs between machines and moments (35 and 54 GB/s on two H100 machines)
            # at the threads the other kernels use and at the gather's own (DeviceContext.gather_threads)
            rounds = 2 if z.sim else 7
            counts = (z.threads,) if z.sim else (z.threads, 512)
            ratios = {t: [] for t in counts}
            for _ in range(rounds):
                t_gather = {t: self.time(lambda: cg.gather_windows(m.device, cap, sb, *d_idx, out, window, t, 16))
                            for t in counts}
                t_copy = self.time(lambda: out[:src.nbytes].copy_to_device(src))
                for t in counts:
                    ratios[t].append((nbytes / t_gather[t]) / (src.nbytes / t_copy))
            for t in counts:
                rep.add("bandwidth", f"zero-copy gather vec=16 / pinned copy, {t} threads",
                        f"{rounds} rounds alternating",
                        100 * float(np.median(ratios[t])), "%",
                        note=f"median; min {100 * min(ratios[t]):.1f}%, max {100 * max(ratios[t]):.1f}%")
            pageable = np.full(src.nbytes, 3, np.uint8)
            t = self.time(lambda: out[:src.nbytes].copy_to_device(pageable))
            rep.add("bandwidth", "host-to-device copy (pageable)", f"{src.nbytes / 2 ** 20:.0f} MiB",
                    src.nbytes / t / 1e9, "GB/s")
            del pageable
            if self.free_device_bytes() > 1.2 * (ring.nbytes + nbytes):
                d_ring = cuda.to_device(ring)
                t = self.time(lambda: cg.gather_windows(d_ring, cap, sb, *d_idx, out, window, z.threads, 16))
                rep.add("bandwidth", "gather from device memory vec=16", size, nbytes / t / 1e9, "GB/s",
                        note="the ring copied to the GPU first: an upper bound")
                del d_ring
            host_out = np.empty(nbytes, np.uint8)
            t = self.time(lambda: g.gather_windows(ring, cap, sb, starts, full, zero, rows, host_out, window))
            rep.add("bandwidth", "CPU gather (numba, host memory)", size, nbytes / t / 1e9, "GB/s")
            rep.add("bandwidth", "pin + map the ring (cuMemHostRegister)", f"{ring.nbytes / 2 ** 20:.0f} MiB",
                    t_map, "s", note=f"mode={m.mode}")
        finally:
            m.close()
        del ring, out
        self.release()

    # ---- selection -------------------------------------------------------------------------------
    def selection(self):
        z, cp, cuda, rep = self.z, self.cp, self.cuda, self.report
        b = z.sel_b
        u = cuda.to_device(self.rng.random(b))
        out = cuda.device_array(b, np.int64)
        upd_slots_host = None
        if getattr(self, "cpu_draw", None):
            n, bb, t = self.cpu_draw
            rep.add("selection", "CPU numba draw (reference)", f"N={human(n)} B={human(bb)}", t * 1e3, "ms",
                    note="numba parallel CPU kernel, host memory")
        sizes = list(z.sel_n)
        torch_done = False
        for n in sizes:
            need = 8.3 * n + 40 * b
            free = self.free_device_bytes()
            size = f"N={human(n)} B={human(b)}"
            if need > 0.9 * free:
                rep.add("selection", "gear draw", size, note=f"skipped: needs {need / 2 ** 30:.1f} GiB, "
                                                               f"{free / 2 ** 30:.1f} GiB free")
                continue
            dev = self.random_index(n)
            t = self.time(lambda: dev.draw(u, out))
            rep.add("selection", "gear draw (CUDA)", size, t * 1e3, "ms", note=f"{b / t / 1e6:.1f} M draws/s")
            upd_slots_host = self.rng.integers(0, n, b)
            s_d = cuda.to_device(upd_slots_host)
            v_d = cuda.to_device(self.rng.random(b))
            t = self.time(lambda: dev.set(s_d, v_d))
            rep.add("selection", "gear set (batched update)", size, t * 1e3, "ms", note="5 launches, prefix included")
            t = self.time(lambda: dev.rebuild())
            rep.add("selection", "gear rebuild (all levels)", f"N={human(n)}", t * 1e3, "ms")
            if n <= TORCH_MAX_CATEGORIES:
                self.torch_row(dev, n, b)
                torch_done = True
            else:
                rep.add("selection", "torch.multinomial", size,
                        note=f"not supported: torch.multinomial takes at most 2**24 = {TORCH_MAX_CATEGORIES} "
                             f"categories; compared at N=2**24 below")
            del dev
            self.release()
        if not torch_done:
            n = z.torch_n
            dev = self.random_index(n)
            t = self.time(lambda: dev.draw(u, out))
            rep.add("selection", "gear draw (CUDA)", f"N={human(n)} B={human(b)}", t * 1e3, "ms",
                    note=f"{b / t / 1e6:.1f} M draws/s; the largest N torch.multinomial accepts")
            self.torch_row(dev, n, b)
            del dev
            self.release()

    def random_index(self, n):
        from gear_mpi.selection import DevicePriorityIndex
        dev = DevicePriorityIndex(n, threads=self.z.threads, _fill=False)
        grid = min(self.cp.blocks_for(n, self.z.threads), 2 if self.z.sim else 65535)
        from gear_mpi.kernels import cuda_support
        cuda_support.launch(self.random_weights, grid, self.z.threads)(dev.leaves, float(self.args.seed + 1), 0.1)
        dev.rebuild()
        return dev

    def torch_row(self, dev, n, b):
        rep = self.report
        size = f"N={human(n)} B={human(b)}"
        try:
            import torch
        except ImportError:
            rep.add("selection", "torch.multinomial", size, note="torch is not installed")
            return
        if torch.cuda.is_available() and not self.z.sim:
            probs = torch.as_tensor(dev.leaves, device="cuda")   # the same device memory, no copy
            where, sync = "CUDA", torch.cuda.synchronize
        elif self.z.sim:
            probs = torch.from_numpy(dev.leaves.copy_to_host())
            where, sync = "CPU (simulator run)", (lambda: None)
        else:
            rep.add("selection", "torch.multinomial", size, note="this torch has no CUDA")
            return

        def run():
            torch.multinomial(probs, b, replacement=True)
            sync()
        t = self.time(run)
        rep.add("selection", f"torch.multinomial ({where})", size, t * 1e3, "ms", note=f"{b / t / 1e6:.1f} M draws/s")

    # ---- sample ---------------------------------------------------------------------------------
    def sample(self):
        import gear_mpi as gm
        z, rep = self.z, self.report
        spec = gm.TrajectorySpec({"obs": ((64,), "float32"), "action": ((6,), "float32"), "reward": ((), "float32"),
                                  "t": ((), "int64")}, max_length=z.sample_len)
        replay_cls = getattr(gm, "Replay", None)
        if replay_cls is not None and "device" in inspect.signature(replay_cls).parameters:
            if self.replay_sample(gm, spec):
                return
        else:
            rep.add("sample", "Replay(device='cuda')", note="not available in this gear_mpi: measuring Shard.select + "
                                                            "the CUDA gather instead")
        self.shard_sample(gm, spec)

    def fill_shard(self, target, spec):
        z = self.z
        n = z.sample_cap // z.sample_len
        rng = self.rng
        trajs = []
        for i in range(n):
            ln = int(rng.integers(z.sample_len // 2, z.sample_len + 1))
            trajs.append({"obs": rng.standard_normal((ln, 64), dtype=np.float32),
                          "action": rng.standard_normal((ln, 6), dtype=np.float32),
                          "reward": rng.standard_normal(ln, dtype=np.float32),
                          "t": np.arange(ln, dtype=np.int64) + i * 10 ** 6})
        pr = rng.random(n) + 0.01
        for lo in range(0, n, 256):
            target.insert_many(trajs[lo:lo + 256], pr[lo:lo + 256])

    def replay_sample(self, gm, spec) -> bool:
        z, rep = self.z, self.report
        try:
            from mpi4py import MPI
            replay = gm.Replay(spec, z.sample_cap, gm.Prioritized(0.6, 0.4), mode="local", comm=MPI.COMM_SELF,
                               device="cuda", seed=self.args.seed)
        except Exception as exc:  # noqa: BLE001
            rep.add("sample", "Replay(device='cuda')", note=f"could not be built ({type(exc).__name__}: {exc}); "
                                                            "measuring the Shard path instead")
            return False
        try:
            self.fill_shard(replay, spec)
            t = self.time(lambda: replay.sample(z.sample_b, z.sample_w))
            batch = replay.sample(z.sample_b, z.sample_w)
            obs = batch["obs"]
            on_gpu = getattr(getattr(obs, "device", None), "type", None) == "cuda"
            rep.add("sample", "Replay.sample (1 rank, device='cuda')", f"B={z.sample_b} W={z.sample_w}", t * 1e3, "ms",
                    note=f"{batch.nbytes / t / 1e9:.2f} GB/s delivered; tensors on {'cuda' if on_gpu else 'host'}")
            rep.add("match", "Replay.sample returns device tensors", f"B={z.sample_b}", match=on_gpu or z.sim)
        finally:
            close = getattr(replay, "close", None)
            if close:
                close()
        return True

    def shard_sample(self, gm, spec):
        from gear_mpi.storage import pinned
        from gear_mpi.batch import Batch
        from gear_mpi.storage import gather_into
        z, cg, cuda, rep = self.z, self.cg, self.cuda, self.report
        b, w = z.sample_b, z.sample_w
        size = f"B={b} W={w}"
        with gm.Shard(spec, z.sample_cap, gm.Prioritized(0.6, 0.4), seed=self.args.seed) as shard:
            self.fill_shard(shard, spec)
            st = shard.store
            mapping, views = pinned.map_byte_views(st.arena.buffer, st.byte_views())
            try:
                cols = {c.name: cuda.device_array((b, w) + c.shape, c.dtype) for c in spec.columns}
                mask = cuda.device_array((b, w), np.bool_)
                state = {}

                def select():
                    slots = shard.select(b)
                    state["p"] = (slots,) + shard.place(slots, w, 0)

                def gather():
                    _, ws, nv, pf = state["p"]
                    cg.gather_into(views, spec, st.capacity, ws, nv, pf, np.arange(b, dtype=np.int64), cols, mask,
                                   threads=z.threads)

                def both():
                    select()
                    gather()
                t_sel = self.time(select)
                t_gather = self.time(gather)
                t_all = self.time(both)
                nbytes = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in cols.values()) + b * w
                rep.add("sample", "Shard.select + place (CPU)", size, t_sel * 1e3, "ms")
                rep.add("sample", "CUDA gather_into (zero-copy from the arena)", size, t_gather * 1e3, "ms",
                        note=f"{nbytes / t_gather / 1e9:.2f} GB/s delivered")
                rep.add("sample", "select + CUDA gather (1 rank)", size, t_all * 1e3, "ms",
                        note=f"{nbytes / t_all / 1e9:.2f} GB/s delivered")
                t_cpu = self.time(lambda: shard.sample(b, w))
                rep.add("sample", "Shard.sample (CPU gather, reference)", size, t_cpu * 1e3, "ms")
                # the same windows through the CPU gather
                select()
                gather()
                _, ws, nv, pf = state["p"]
                ref = Batch.empty(spec, b, w)
                gather_into(st.byte_views(), spec, st.capacity, ws, nv, pf, np.arange(b, dtype=np.int64), ref)
                same = all(np.array_equal(cols[c.name].copy_to_host(), ref.numpy()[c.name]) for c in spec.columns)
                same = same and np.array_equal(mask.copy_to_host(), ref._mask_np)
                rep.add("match", "CUDA gather_into vs Shard gather_into", size, match=same)
            finally:
                mapping.close()


def _make_random_weights_kernel():
    """A device kernel that fills weights from a cheap hash of the index (not a RNG: benchmark data)."""
    global cuda  # the simulator swaps a kernel's *global* ``cuda`` for its fake module
    from numba import cuda

    @cuda.jit
    def random_weights(leaves, seed, zero_frac):
        start = cuda.grid(1)
        stride = cuda.gridsize(1)
        for i in range(start, leaves.shape[0], stride):
            x = math.sin(i * 12.9898 + seed * 78.233) * 43758.5453
            u = x - math.floor(x)
            leaves[i] = 0.0 if u < zero_frac else u * u
    return random_weights


def device_name(cuda, sim: bool) -> str:
    if sim:
        return "numba CUDA simulator"
    try:
        d = cuda.get_current_device()
        name = d.name.decode() if isinstance(d.name, bytes) else str(d.name)
        return f"{name} (cc {d.compute_capability[0]}.{d.compute_capability[1]})"
    except Exception:  # noqa: BLE001
        return "unknown CUDA device"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.sim:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before numba.cuda is imported
        warnings.filterwarnings("ignore", category=RuntimeWarning)
    try:
        from numba import cuda
    except ImportError as exc:
        print(f"gpu_check: numba-cuda is not installed ({exc}); no CUDA GPU check possible. "
              "Install gear-mpi[cuda12] (or [cuda13]) on a GPU node.")
        return 0
    if not args.sim and not cuda.is_available():
        print("gpu_check: no CUDA GPU found (numba.cuda.is_available() is False): nothing to check here. "
              "Run it on a GPU node, or with --sim to exercise its logic on the numba CUDA simulator.")
        return 0
    sizes = Sizes(args)
    report = Report()
    t0 = time.perf_counter()
    checker = Checker(args, sizes, report)
    for name in ("match_priority", "match_gather", "bandwidth", "selection", "sample"):
        sec = {"match_priority": "match", "match_gather": "match"}.get(name, name)
        if sec in args.sections:
            section(report, sec)(getattr(checker, name))()
    elapsed = time.perf_counter() - t0
    mode = "simulator" if args.sim else "gpu"
    if args.sim:
        report.notes.append("simulator run: tiny sizes; the timings are not GPU figures")
    report.notes.append(f"device: {device_name(cuda, args.sim)}; {elapsed:.0f} s")
    if args.json:
        print(json.dumps({"mode": mode, "device": device_name(cuda, args.sim), "ok": report.ok,
                          "seconds": round(elapsed, 1), "rows": report.rows, "notes": report.notes}, indent=1))
    else:
        print(f"gear_mpi gpu_check ({mode})")
        print(report.table())
        for n in report.notes:
            print("# " + n)
        print("# all checks matched" if report.ok else "# SOME CHECKS FAILED (match=no or ERROR rows)")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
