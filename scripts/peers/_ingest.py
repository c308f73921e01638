"""What the writer-ingest benchmark (scripts/bench/bench_ingest.py) shares between gear_mpi and Reverb.

stdlib + numpy only: it is imported by the gear_mpi side (the project's environment) and by
scripts/peers/reverb_ingest.py (Reverb's own venv, numpy<2).

Workloads: per-step ``append`` of
  hopper -- W1's steps (scripts/peers/_common.HOPPER: obs float32[11], action float32[3],
            reward float32, done bool; 61 bytes), episodes of 1000 steps;
  image  -- 4 KiB image steps (_common.TRANSITION: obs uint8[4096], action float32, reward
            float32; 4104 bytes), episodes of 100 steps.
An actor process appends the steps of one pre-built episode (a list of per-step dicts of numpy
views, built before the clock starts, the same for both systems), then ends the episode
(one trajectory / item per episode), again and again.

Writer processes are driven over stdin/stdout with one JSON object per line
(:func:`serve_writer` on the writer's side, :class:`LinePool` on the driver's):
  {"cmd": "open", ...}   open a writer (the system's own fields), write ``warmup`` episodes, answer
  {"cmd": "go", "seconds": s, "rate": r}   write whole episodes for at least s seconds (at most r
                         steps/s if r > 0), wait until they are in, answer with the counts
  {"cmd": "close"}       close the writer, answer
  {"cmd": "quit"}        exit
"""
from __future__ import annotations

import json
import select
import subprocess
import sys
import time

import numpy as np

from scripts.peers._common import HOPPER, TRANSITION, hopper_trajectory, quit_workers, step_bytes, transitions

WORKLOADS = {
    "hopper": {"columns": HOPPER, "length": 1000},
    "image": {"columns": TRANSITION, "length": 100},
}
HANDSHAKE_TIMEOUT = 300.0


def workload_bytes(workload: str) -> int:
    """Bytes of one step of ``workload``."""
    return step_bytes(WORKLOADS[workload]["columns"])


def episode_steps(workload: str, length: int, seed: int) -> list[dict]:
    """One episode of ``workload`` as ``length`` per-step dicts (numpy views into the episode's arrays)."""
    cols = WORKLOADS[workload]["columns"]
    arrays = hopper_trajectory(seed, length) if workload == "hopper" else transitions(length, seed)
    arrays = {k: np.ascontiguousarray(arrays[k]) for k in cols}
    return [{k: arrays[k][t] for k in cols} for t in range(length)]


def write_episodes(append, end_episode, finish, steps: list[dict], seconds: float, min_episodes: int = 1,
                   rate: float = 0.0) -> dict:
    """Append ``steps`` one by one and end the episode, repeatedly, until ``seconds`` have passed
    (whole episodes only; at least ``min_episodes``), then ``finish()`` (wait until the data is in).
    ``rate`` > 0: at most that many steps per second (an actor whose environment takes time: after
    each episode it sleeps until the episode's share of time has passed). Returns episodes, steps, the
    elapsed time (``finish`` included), the part of it not spent in that sleep, and this process's CPU time."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    deadline = t0 + seconds
    episodes = 0
    slept = 0.0
    while True:
        for s in steps:
            append(s)
        end_episode()
        episodes += 1
        now = time.perf_counter()
        if episodes >= min_episodes and now >= deadline:
            break
        if rate > 0:
            nap = t0 + episodes * len(steps) / rate - now
            if nap > 0:
                time.sleep(nap)
                slept += time.perf_counter() - now
    finish()
    elapsed = time.perf_counter() - t0
    return {"episodes": episodes, "steps": episodes * len(steps), "elapsed_s": elapsed, "busy_s": elapsed - slept,
            "cpu_s": time.process_time() - cpu0}


def serve_writer(open_writer) -> None:
    """The writer process's command loop (module docstring). ``open_writer(msg)`` returns
    ``(append, end_episode, finish, close)`` for the ``open`` message ``msg``: ``finish()`` returns
    once every ended episode is in the replay / table."""
    writer = steps = None
    for line in sys.stdin:
        msg = json.loads(line)
        cmd = msg["cmd"]
        if cmd == "quit":
            break
        try:
            if cmd == "open":
                steps = episode_steps(msg["workload"], int(msg["length"]), int(msg.get("seed", 0)))
                writer = open_writer(msg)
                warm = write_episodes(*writer[:3], steps, 0.0, int(msg.get("warmup", 1)))
                reply = {"ready": True, "warmup_episodes": warm["episodes"]}
            elif cmd == "go":
                reply = write_episodes(*writer[:3], steps, float(msg["seconds"]), rate=float(msg.get("rate", 0)))
            elif cmd == "close":
                writer, close = None, writer[3]
                close()
                reply = {"closed": True}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as e:  # reported to the driver, which fails the case (never a hang)
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    if writer is not None:
        writer[3]()


class LinePool:
    """Worker processes driven by JSON lines over pipes; every read is bounded by a deadline."""

    def __init__(self, cmds: list[list[str]], env: dict | None = None, cwd: str | None = None):
        self.procs = [subprocess.Popen(c, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1,
                                       env=env, cwd=cwd) for c in cmds]

    def send(self, procs, msg: dict) -> None:
        line = json.dumps(msg) + "\n"
        for p in procs:
            p.stdin.write(line)
            p.stdin.flush()

    def poll_line(self, p, timeout: float):
        """The next JSON line of ``p`` within ``timeout`` seconds, or None if none came in time."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            r, _, _ = select.select([p.stdout], [], [], max(0.0, left))
            if not r:
                return None
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"a worker process exited (code {p.wait()})")
            if line.startswith("{"):
                out = json.loads(line)
                if "error" in out:
                    raise RuntimeError(f"a worker process failed: {out['error']}")
                return out

    def read(self, procs, timeout: float) -> list[dict]:
        deadline = time.monotonic() + timeout
        out = []
        for p in procs:
            got = self.poll_line(p, deadline - time.monotonic())
            if got is None:
                raise TimeoutError(f"a worker process did not answer within {timeout:.0f} s")
            out.append(got)
        return out

    def close(self) -> None:
        quit_workers(self.procs)


def summarize_writers(results: list[dict], workload: str) -> dict:
    """Counts summed over the writer processes of one case (each wrote for its own elapsed time); us_per_step:
    the median over writers of their time per step outside the pacing sleep (waits for room included)."""
    steps = sum(r["steps"] for r in results)
    return {"episodes": sum(r["episodes"] for r in results), "steps": steps,
            "writer_elapsed_s": max(r["elapsed_s"] for r in results),
            "us_per_step": float(np.median([1e6 * r["busy_s"] / r["steps"] for r in results])),
            "writer_cpu_s": sum(r["cpu_s"] for r in results), "step_bytes": workload_bytes(workload)}
