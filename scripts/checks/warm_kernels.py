"""Fill numba's on-disk cache with gear_mpi's CPU kernels, once, in one process.

    python -m scripts.checks.warm_kernels [--quiet]

gear_mpi's kernels are compiled with ``cache=True``: the first process that calls a kernel
for a new argument type compiles it (seconds each, about a minute for the set here) and
writes it under ``gear_mpi/kernels/__pycache__``; later processes load it in milliseconds.
On a fresh checkout, though, the first multi-rank job has every rank compile the same
kernels at once (4 ranks on 2 cores: four times the work, twice the wall time), and so does
every later job that reaches a type not compiled yet. This script pays the compilation once,
serially, before any such job: it runs every selector through a one-rank ``Replay`` in each
sampling mode (insert, insert_many, insert_packed, sample at every alignment and at windows
of one and several steps, update_priorities, the prefetching iterator, a checkpoint save and
load) and a ``Shard`` on file-backed memory, for two specs (two columns; mixed columns of odd
sizes), and the decentralized mode alone for a one-step and a 1000-step spec.
``scripts/dev_env.sh`` runs it as its last step.

Cost: about a minute on a cold cache (2 cores here), 5-10 s when everything is cached. Local:
no collective beyond the one-rank communicator; needs mpi4py. Prints one line per stage
(``[k/N]``, with its seconds: ``dev_env.sh`` shows them, so a slow machine is seen working)
unless ``--quiet``, and the number of kernels compiled (new cache files) at the end.
"""
from __future__ import annotations

import argparse
import os
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
        replay.update_priorities(batch.keys.numpy(), np.linspace(0.5, 2.0, len(batch)))
        with replay.batches(4, window=min(2, length), prefetch=1, limit=3) as it:
            for batch in it:
                it.update_priorities(batch.keys.numpy(), np.ones(len(batch)))
        if mode == "decentralized" and selector in ("Uniform", "Prioritized"):
            path = os.path.join(folder, f"ckpt-{selector}-{spec.max_length}")
            replay.save(path, progress=False)
            again, _ = gm.Replay.load(path, MPI.COMM_SELF)
            again.close()


def _exercise_file_shard(spec, rng, folder: str) -> None:
    import gear_mpi as gm
    path = os.path.join(folder, f"file-shard-{spec.max_length}")
    os.makedirs(path)
    shard = gm.Shard(spec, 32 * spec.max_length, gm.Prioritized(0.6, 0.4), max_items=32, memory="file", path=path)
    try:
        shard.insert_many([_trajectory(spec, spec.max_length, rng) for _ in range(4)], [1.0, 2.0, 3.0, 4.0])
        batch = shard.sample(8, 2)
        shard.update_priorities(batch.keys.numpy(), np.ones(len(batch)))
    finally:
        shard.close()


def _cache_files() -> int:
    import gear_mpi
    root = Path(gear_mpi.__file__).parent
    return sum(1 for _ in root.rglob("*.nbc"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quiet", action="store_true", help="only the summary line")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    before = _cache_files()
    rng = np.random.default_rng(0)

    def say(what: str, since: float) -> None:
        if not args.quiet:
            print(f"warm_kernels: {what} ({time.perf_counter() - since:.1f} s)", flush=True)

    specs = _specs()
    stages = sum((len(SELECTORS) if everything else 3) + 1 for _, _, everything in specs)
    done = 0
    if not args.quiet:
        print(f"warm_kernels: compiling gear_mpi's CPU kernels into numba's cache in {stages} stages "
              f"(about a minute on 2 idle cores when nothing is cached; seconds when everything is)", flush=True)
    with tempfile.TemporaryDirectory(prefix="gear_mpi_warm_") as folder:
        for label, spec, everything in specs:
            for selector in (SELECTORS if everything else ("Uniform", "Prioritized", "Fifo")):
                t = time.perf_counter()
                for mode in (MODES if everything else MODES[:1]):
                    _exercise_replay(spec, selector, mode, rng, folder)
                done += 1
                say(f"[{done}/{stages}] {label}, {selector}, {'every mode' if everything else MODES[0]}", t)
            t = time.perf_counter()
            _exercise_file_shard(spec, rng, folder)
            done += 1
            say(f"[{done}/{stages}] {label}, file-backed shard", t)
    print(f"warm_kernels: {_cache_files() - before} kernels compiled into numba's cache, "
          f"{time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
