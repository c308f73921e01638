"""Fill numba's on-disk cache with gear_mpi's CPU kernels, once, in one process.

    python -m scripts.checks.warm_kernels [--quiet]

gear_mpi's kernels are compiled with ``cache=True``: the first process that calls a kernel
for a new argument type compiles it (seconds each, about a minute for the set here) and
writes it under ``gear_mpi/kernels/__pycache__``; later processes load it in milliseconds.
On a fresh checkout, though, the first multi-rank job has every rank compile the same
kernels at once (4 ranks on 2 cores: four times the work, twice the wall time), and so does
every later job that reaches a type not compiled yet. This script pays the compilation once,
before any such job: it runs every selector through a one-rank ``Replay`` in each
sampling mode (insert, insert_many, insert_packed, sample at every alignment and at windows
of one and several steps, update_priorities, the prefetching iterator, a checkpoint save and
load) and a ``Shard`` on file-backed memory, for two specs (two columns; mixed columns of odd
sizes), and the decentralized mode alone for a one-step and a 1000-step spec; then the table
layouts that other options give (``max_times_sampled``, single-step appends, lengths from
read-only memory), frame stacks and compressed columns (when python-blosc2 is installed).
``scripts/dev_env.sh`` runs it as its last step.

The stages run in ``--jobs`` worker processes (default: 2, or 1 on a one-core machine), each
taking the next stage not yet taken (worker 0 from the first, worker 1 from the last, so that
they start on different kernels); a kernel another worker has cached is loaded, not compiled.

Cost: about a minute on a cold cache (2 cores here), 5-10 s when everything is cached. Local:
no collective beyond the one-rank communicator; needs mpi4py. Prints one line per stage
(``[k/N]``, numbered as they finish, with its seconds: ``dev_env.sh`` shows them, so a slow
machine is seen working) unless ``--quiet``, and the number of kernels compiled (new cache
files) at the end.
"""
from __future__ import annotations

import argparse
import os
import selectors
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SELECTORS = ("Uniform", "Prioritized", "Fifo", "Lifo", "MaxPriority", "MinPriority")
MODES = ("decentralized", "centralized", "local")


def _specs():
    """(label, spec, every selector and mode?): kernels are compiled per type of the table's rows, whose
    integer widths follow ``max_length`` (uint8 up to 255 steps, uint16 above; one-step specs keep no
    length row), so the specs cover each of those; the column count does not matter (columns are passed
    by address)."""
    import gear_mpi as gm
    f32 = np.float32
    return [
        ("one float, 8 steps", gm.TrajectorySpec({"obs": ((4,), f32), "action": ((), np.int64)}, max_length=8), True),
        ("mixed columns, 16 steps", gm.TrajectorySpec({"t": ((), "int64"), "obs": ((3, 2), "float32"),
                                                       "act": ((2,), "int16"), "done": ((), "bool"),
                                                       "img": ((5,), "uint8")}, max_length=16), True),
        ("one column, one step", gm.TrajectorySpec({"x": ((), f32)}, max_length=1), False),
        ("4 columns, 1000 steps", gm.TrajectorySpec({"obs": ((11,), f32), "action": ((3,), f32), "reward": ((), f32),
                                                     "done": ((), np.bool_)}, max_length=1000), False),
    ]


def _trajectory(spec, length: int, rng) -> dict:
    return {c.name: (rng.random((length,) + c.shape) * 100).astype(c.dtype) for c in spec.columns}


def _selector(name: str):
    import gear_mpi as gm
    return gm.Prioritized(0.6, 0.4) if name == "Prioritized" else getattr(gm, name)()


def _exercise_replay(spec, selector: str, mode: str, rng, folder: str) -> None:
    """One one-rank Replay through every public hot path."""
    from mpi4py import MPI
    import gear_mpi as gm
    length = spec.max_length
    with gm.Replay(spec, 64 * length, _selector(selector), mode=mode, comm=MPI.COMM_SELF, max_items=64,
                   timeout=60) as replay:
        replay.insert(_trajectory(spec, length, rng), 1.0)
        replay.insert_many([_trajectory(spec, n, rng) for n in (1, max(1, length // 2), length)], [1.0, 2.0, 0.5])
        lengths = np.array([1, min(3, length), length], np.int64)
        replay.insert_packed(_trajectory(spec, int(lengths.sum()), rng), lengths, np.array([1.0, 0.25, 3.0]))
        for window in sorted({1, min(2, length), length}):
            for align in ("random", "head", "tail"):
                batch = replay.sample(8, window, align)
        replay.update_priorities(batch.meta_numpy()[0], np.linspace(0.5, 2.0, len(batch)))
        with replay.batches(4, window=min(2, length), prefetch=1, limit=3) as it:
            for batch in it:
                it.update_priorities(batch.meta_numpy()[0], np.ones(len(batch)))
        if mode == "decentralized" and selector in ("Uniform", "Prioritized"):
            path = os.path.join(folder, f"ckpt-{selector}-{spec.max_length}")
            replay.save(path, progress=False)
            again, _ = gm.Replay.load(path, MPI.COMM_SELF)
            again.close()
        replay.clear()


def _exercise_file_shard(spec, rng, folder: str) -> None:
    import gear_mpi as gm
    path = os.path.join(folder, f"file-shard-{spec.max_length}")
    os.makedirs(path)
    shard = gm.Shard(spec, 32 * spec.max_length, gm.Prioritized(0.6, 0.4), max_items=32, memory="file", path=path)
    try:
        shard.insert_many([_trajectory(spec, spec.max_length, rng) for _ in range(4)], [1.0, 2.0, 3.0, 4.0])
        batch = shard.sample(8, 2)
        shard.update_priorities(batch.meta_numpy()[0], np.ones(len(batch)))
    finally:
        shard.close()


def _exercise_options(spec, rng) -> None:
    """The table layouts that options give a Shard: counted uses (``max_times_sampled``: a times row) or not,
    lengths from read-only memory (a dataset's file), single-step appends (one-step specs), a clear."""
    import gear_mpi as gm
    for max_times in (None, 2):
        for selector in ("Uniform", "Prioritized", "Fifo"):
            shard = gm.Shard(spec, 32 * spec.max_length, _selector(selector), max_items=32,
                             max_times_sampled=max_times)
            try:
                shard.insert_many([_trajectory(spec, spec.max_length, rng) for _ in range(6)], [1.0] * 6)
                lengths = np.full(3, spec.max_length, np.int64)
                lengths.flags.writeable = False
                shard.insert_packed(_trajectory(spec, 3 * spec.max_length, rng), lengths)
                if spec.max_length == 1:
                    shard.append_step({name: v[0] for name, v in _trajectory(spec, 1, rng).items()})
                for _ in range(3):
                    batch = shard.sample(8, 1)
                shard.update_priorities(batch.meta_numpy()[0], np.ones(len(batch)))
                shard.clear()
            finally:
                shard.close()


def _exercise_derived(rng, folder: str) -> None:
    """Frame stacks and next observations (rebuilt at sample time), and a compressed column where python-blosc2
    is installed."""
    import gear_mpi as gm
    specs = [gm.TrajectorySpec({"frame": ((6, 6), "uint8"), "obs": gm.FrameStack("frame", 4),
                                "next_obs": gm.NextStep("obs"), "action": ((), "int64")}, max_length=16)]
    try:
        import blosc2  # noqa: F401
        specs.append(gm.TrajectorySpec({"frame": ((6, 6), "uint8", gm.Compressed(level=1)),
                                        "action": ((), "int64")}, max_length=16))
    except ImportError:
        pass
    for spec in specs:
        for selector in ("Uniform", "Prioritized"):
            shard = gm.Shard(spec, 256, _selector(selector), max_items=32)
            try:
                shard.insert_many([_trajectory(spec, n, rng) for n in (3, 9, 16)], [1.0, 2.0, 3.0])
                for window in (1, 4):
                    batch = shard.sample(8, window)
                shard.update_priorities(batch.meta_numpy()[0], np.ones(len(batch)))
            finally:
                shard.close()


def _stages() -> list[tuple[str, object]]:
    """The warm-up's stages, in order: (label, a function of (rng, folder)). The same list in every process."""
    stages = []
    for label, spec, everything in _specs():
        for selector in (SELECTORS if everything else ("Uniform", "Prioritized", "Fifo")):
            modes = MODES if everything else MODES[:1]

            def run(rng, folder, spec=spec, selector=selector, modes=modes):
                for mode in modes:
                    _exercise_replay(spec, selector, mode, rng, folder)
            stages.append((f"{label}, {selector}, {'every mode' if everything else MODES[0]}", run))
        stages.append((f"{label}, file-backed shard", lambda rng, folder, spec=spec: _exercise_file_shard(spec, rng, folder)))
    for label, spec, _ in _specs()[::2]:  # the 8-step and the one-step spec
        stages.append((f"{label}, counted uses, appends, read-only lengths",
                       lambda rng, folder, spec=spec: _exercise_options(spec, rng)))
    stages.append(("frame stacks, compressed columns", _exercise_derived))
    return stages


def _cache_files() -> int:
    import gear_mpi
    root = Path(gear_mpi.__file__).parent
    return sum(1 for _ in root.rglob("*.nbc"))


def _claim(folder: str, index: int) -> bool:
    """Whether this process takes stage ``index`` (the first to create its claim file does)."""
    try:
        os.close(os.open(os.path.join(folder, f"stage-{index}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _work(worker: int, claims: str) -> int:
    """A worker: take the stages not yet claimed in ``claims``, worker 0 from the first, the others from the
    last, and print ``stage <index> <seconds>`` for each as it finishes."""
    stages = _stages()
    order = range(len(stages)) if worker == 0 else range(len(stages) - 1, -1, -1)
    rng = np.random.default_rng(worker)
    with tempfile.TemporaryDirectory(prefix="gear_mpi_warm_") as folder:
        for i in order:
            if _claim(claims, i):
                t = time.perf_counter()
                stages[i][1](rng, folder)
                print(f"stage {i} {time.perf_counter() - t:.1f}", flush=True)
    return 0


def _default_jobs() -> int:
    return max(1, min(2, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quiet", action="store_true", help="only the summary line")
    p.add_argument("--jobs", type=int, default=None,
                   help="worker processes (default: 2, or 1 on a one-core machine)")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--claims", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return _work(args.worker, args.claims)
    jobs = _default_jobs() if args.jobs is None else args.jobs
    if jobs < 1:
        p.error(f"--jobs must be at least 1, got {jobs}")
    t0 = time.perf_counter()
    before = _cache_files()
    labels = [label for label, _ in _stages()]
    n = len(labels)
    if not args.quiet:
        print(f"warm_kernels: compiling gear_mpi's CPU kernels into numba's cache in {n} stages "
              f"(about a minute on 2 idle cores when nothing is cached; seconds when everything is)", flush=True)
    root = Path(__file__).resolve().parents[2]
    failed = []
    with tempfile.TemporaryDirectory(prefix="gear_mpi_warm_claims_") as claims:
        procs = [subprocess.Popen([sys.executable, "-m", "scripts.checks.warm_kernels", "--worker", str(k),
                                   "--claims", claims], cwd=root, stdout=subprocess.PIPE, text=True)
                 for k in range(min(jobs, n))]
        done = 0
        # the workers' lines, as they come: the stage index and its seconds
        sel = selectors.DefaultSelector()
        for proc in procs:
            sel.register(proc.stdout, selectors.EVENT_READ, proc)
        while sel.get_map():
            for key, _ in sel.select():
                line = key.fileobj.readline()
                if not line:
                    sel.unregister(key.fileobj)
                    continue
                parts = line.split()
                if len(parts) == 3 and parts[0] == "stage":
                    done += 1
                    if not args.quiet:
                        print(f"warm_kernels: [{done}/{n}] {labels[int(parts[1])]} ({float(parts[2]):.1f} s)",
                              flush=True)
                else:
                    print(line, end="", flush=True)
        for k, proc in enumerate(procs):
            if proc.wait() != 0:
                failed.append(f"worker {k} exited with {proc.returncode}")
    if failed or done != n:
        print(f"warm_kernels: {'; '.join(failed) or 'stages left'}: {done} of {n} stages done", file=sys.stderr,
              flush=True)
        return 1
    print(f"warm_kernels: {_cache_files() - before} kernels compiled into numba's cache, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
