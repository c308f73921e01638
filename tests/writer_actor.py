"""An actor process for the writer tests: ``python tests/writer_actor.py ADDRESS [options]``.

It never imports mpi4py (a writer must work in any process of the node). It writes
``--episodes`` deterministic episodes (:func:`episode`, so a test can check every byte),
alternating ``append``/``end_episode`` and ``insert``, then flushes and prints ``DONE``.
``--then-open K``: afterwards append K steps of one more episode, print ``READY`` and
sleep (a test kills it there). ``--step-sleep S``: sleep S seconds after each step.
``--no-flush``: do not wait for the owner to ingest before DONE (the episodes stay staged).
``--hold-timeout S``: the writer's ``hold_timeout`` (the rate limiter's hold).
Errors are printed as ``ERROR <class>: <message>`` with exit status 3, after a line ``ERROR_AT <time.monotonic()>``.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

SPEC_COLUMNS = {"x": ((3,), "float32"), "img": ((4, 4), "uint8"), "r": ((), "float64")}
MAX_LENGTH = 16


def episode(seed: int, index: int) -> tuple[dict, float]:
    """Episode ``index`` of writer ``seed``: its columns and priority (the same in every process)."""
    rng = np.random.default_rng([seed, index])
    n = int(rng.integers(1, MAX_LENGTH + 1))
    t = np.arange(n)
    cols = {"x": np.stack([np.full(n, seed), np.full(n, index), t], 1).astype(np.float32),
            "img": rng.integers(0, 256, (n, 4, 4)).astype(np.uint8),
            "r": rng.standard_normal(n)}
    return cols, float(rng.uniform(0.5, 2.0))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("address")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--episodes", type=int, default=10)
    ap.add_argument("--then-open", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=30.0)
    ap.add_argument("--staging-steps", type=int, default=None)
    ap.add_argument("--no-flush", action="store_true")
    ap.add_argument("--hold-timeout", type=float, default=None)
    a = ap.parse_args()
    import gear_mpi as gm
    assert "mpi4py.MPI" not in sys.modules
    try:
        with gm.Writer(a.address, timeout=a.timeout, staging_steps=a.staging_steps,
                       hold_timeout=a.hold_timeout) as w:
            for e in range(a.episodes):
                cols, p = episode(a.seed, e)
                if e % 2:
                    w.insert(cols, p)
                else:
                    for i in range(len(cols["r"])):
                        w.append({k: v[i] for k, v in cols.items()})
                        if a.step_sleep:
                            time.sleep(a.step_sleep)
                    w.end_episode(p)
            if not a.no_flush:
                w.flush()
            print("DONE", flush=True)
            print(f"TORCH {'imported' if 'torch' in sys.modules else 'not imported'}", file=sys.stderr, flush=True)
            if a.then_open:
                cols, _ = episode(a.seed, a.episodes)
                for i in range(min(a.then_open, len(cols["r"]))):
                    w.append({k: v[i] for k, v in cols.items()})
                print("READY", flush=True)
                time.sleep(600)
    except gm.GearError as e:
        # when the error was raised (CLOCK_MONOTONIC is system-wide): tests time the error itself, not the
        # interpreter's exit after it, which a loaded machine can delay by seconds
        print(f"ERROR_AT {time.monotonic():.6f}", flush=True)
        print(f"ERROR {type(e).__name__}: {e}", flush=True)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
