#!/usr/bin/env python
"""Reverb worker for scripts/bench/compare_peers.py (runs in Reverb's own virtual environment).

    python reverb_worker.py '{"workload": "W1", "items": 256, "clients": [1, 2, 4], "seconds": 3}'
    python reverb_worker.py '{"workload": "W2", "N": 100000, "batches": [256], "seconds": 2}'

This process is the Reverb server (reverb.Server, in process) and the writer that fills
it over gRPC; the samplers are separate client processes (``--client``), a pool of the
largest client count, driven over their stdin/stdout: each case tells K of them to build
a ``reverb.TrajectoryDataset`` over the case's table, batched, warm it up, report ready,
then all start together and sample for ``seconds``; the rows aggregate their counts.

Network: Reverb's server listens on ``[::]:port``, every interface, and 0.14 has no
option for the address. So this worker refuses to start a server unless its network
namespace has the loopback interface only (the driver runs it under ``unshare --net``);
clients connect to 127.0.0.1.

W1 tables (hopper-like, T=1000, whole trajectories, batch 32 per client), fed three ways:
  per-step        -- one TrajectoryWriter.append per step, then create_item over the last T
                     steps (how RL actors write; the writer's default auto-tuned chunk length);
  per-step-chunkT -- the same appends with the writer configured to chunks of T steps
                     (TrajectoryWriter.configure(max_chunk_length=T)): an actor that tunes it;
  per-traj        -- one append holding the whole [T, ...] trajectory, create_item over that
                     one step (one chunk per item: the most favourable feeding for sampling);
each with a Uniform and a Prioritized(0.6) table (FIFO remover, MinSize(1) limiter).
W2: a Prioritized(0.6) table of N transitions (one chunk each); one client samples batches
of B and sends one mutate_priorities per batch with B new priorities.
Datasets: max_in_flight_samples_per_worker = 2 B, batched (drop_remainder), prefetch(2); the
client turns each batch into numpy arrays (as the other systems deliver them).
Prints one JSON object per case.
"""
from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from scripts.peers._common import (  # noqa: E402
    ALPHA, HOPPER, HOPPER_T, TRANSITION, W1_BATCH, emit, fail, hopper_priorities, hopper_trajectory,
    initial_priorities, parse_config, quit_workers, step_bytes, transitions)

PEER = "reverb"
HANDSHAKE_TIMEOUT = 300.0
FEEDS = ["per-step", "per-step-chunkT", "per-traj"]


def version() -> str:
    from importlib.metadata import version as v
    return f"dm-reverb {v('dm-reverb')}, tensorflow {v('tensorflow')}, numpy {np.__version__}"


def loopback_only() -> tuple[bool, list[str]]:
    names = [n for _, n in socket.if_nameindex()]
    return names == ["lo"], names


# ---- client processes ---------------------------------------------------------------------
def client_main(addr: str) -> None:
    """Serve commands from stdin: prepare (build + warm a dataset), go (measure), quit."""
    import reverb
    import tensorflow as tf

    client = reverb.Client(addr)
    it = None
    cmd = {}
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "prepare":
            cmd = msg
            ds = reverb.TrajectoryDataset.from_table_signature(
                addr, msg["table"], max_in_flight_samples_per_worker=msg["in_flight"],
                num_workers_per_iterator=msg.get("workers", -1))
            ds = ds.batch(msg["batch"], drop_remainder=True)
            if msg.get("prefetch"):
                ds = ds.prefetch(msg["prefetch"])
            it = iter(ds)
            t_end = time.perf_counter() + msg.get("warmup_s", 0.5)
            n = 0
            while n < msg.get("warmup", 3) or time.perf_counter() < t_end:
                sample = next(it)
                n += 1
            data = tf.nest.flatten(sample.data)
            nbytes = int(sum(t.numpy().nbytes for t in data))
            shapes = [list(t.shape) for t in data]
            print(json.dumps({"ready": True, "bytes_per_batch": nbytes, "shapes": shapes}), flush=True)
        elif msg["cmd"] == "go":
            rng = np.random.default_rng(os.getpid())
            times = []
            batches = 0
            t_start = time.perf_counter()
            deadline = t_start + msg["seconds"]
            while True:
                t0 = time.perf_counter()
                sample = next(it)
                arrays = [t.numpy() for t in tf.nest.flatten(sample.data)]  # delivered to the caller as numpy
                if cmd.get("update"):
                    keys = sample.info.key.numpy().tolist()
                    client.mutate_priorities(cmd["table"], updates=dict(zip(keys, (rng.random(len(keys)) + 0.01)
                                                                             .tolist())))
                t1 = time.perf_counter()
                del arrays
                times.append(t1 - t0)
                batches += 1
                if t1 > deadline and batches >= 3:
                    break
            elapsed = time.perf_counter() - t_start
            print(json.dumps({"batches": batches, "elapsed_s": elapsed, "median_call_s": float(np.median(times)),
                              "best_call_s": float(np.min(times))}), flush=True)
            it = None


class ClientPool:
    """K client processes; lines over pipes; every read bounded by a deadline."""

    def __init__(self, k: int, addr: str):
        self.procs = [subprocess.Popen([sys.executable, "-m", "scripts.peers.reverb_worker", "--client", addr],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
                      for _ in range(k)]

    def send(self, procs, msg: dict) -> None:
        for p in procs:
            p.stdin.write(json.dumps(msg) + "\n")
            p.stdin.flush()

    def read(self, procs, timeout: float) -> list[dict]:
        out = []
        deadline = time.monotonic() + timeout
        for p in procs:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"a Reverb client did not answer within {timeout:.0f} s")
                r, _, _ = select.select([p.stdout], [], [], left)
                if not r:
                    continue
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"a Reverb client exited (code {p.poll()})")
                if line.startswith("{"):
                    out.append(json.loads(line))
                    break
        return out

    def run_case(self, k: int, prepare: dict, seconds: float) -> dict:
        procs = self.procs[:k]
        self.send(procs, {"cmd": "prepare", **prepare})
        ready = self.read(procs, HANDSHAKE_TIMEOUT)
        self.send(procs, {"cmd": "go", "seconds": seconds})
        res = self.read(procs, seconds + HANDSHAKE_TIMEOUT)
        bpb = ready[0]["bytes_per_batch"]
        elapsed = max(r["elapsed_s"] for r in res)
        batches = sum(r["batches"] for r in res)
        return {"calls": batches, "elapsed_s": elapsed, "bytes_total": batches * bpb,
                "items_total": batches * prepare["batch"],
                "median_call_s": max(r["median_call_s"] for r in res),
                "best_call_s": max(r["best_call_s"] for r in res),
                "bytes_per_call": bpb * k, "items_per_call": prepare["batch"] * k,
                "sustained_by_client": [r["batches"] * bpb / r["elapsed_s"] / 1e9 for r in res],
                "shapes": ready[0]["shapes"]}

    def close(self) -> None:
        quit_workers(self.procs)


# ---- server + writer ----------------------------------------------------------------------------
def tf_signature(columns: dict, length: int | None):
    import tensorflow as tf
    lead = [length] if length else []
    return {name: tf.TensorSpec(lead + list(shape), tf.dtypes.as_dtype(np.dtype(dt)))
            for name, (shape, dt) in columns.items()}


def table(name: str, sampler: str, size: int, signature):
    import reverb
    sel = reverb.selectors.Prioritized(ALPHA) if sampler == "prioritized" else reverb.selectors.Uniform()
    return reverb.Table(name=name, sampler=sel, remover=reverb.selectors.Fifo(), max_size=size,
                        rate_limiter=reverb.rate_limiters.MinSize(1), signature=signature)


def fill_w1(client, items: int, samplers: list[str], feed: str) -> float:
    """Write ``items`` trajectories, each as one item in every sampler's table for this feed."""
    trajs = [hopper_trajectory(i) for i in range(min(items, 16))]
    prio = hopper_priorities(items)
    t0 = time.perf_counter()
    if feed.startswith("per-step"):
        with client.trajectory_writer(num_keep_alive_refs=HOPPER_T) as w:
            if feed == "per-step-chunkT":  # chunks of T steps: each item is one chunk per column
                for k in HOPPER:
                    w.configure((k,), num_keep_alive_refs=HOPPER_T, max_chunk_length=HOPPER_T)
            for i in range(items):
                tr = trajs[i % len(trajs)]
                for t in range(HOPPER_T):
                    w.append({k: v[t] for k, v in tr.items()})
                item = {k: w.history[k][-HOPPER_T:] for k in HOPPER}
                for s in samplers:
                    w.create_item(f"w1_{s}_{feed}", float(prio[i]), item)
                w.end_episode(timeout_ms=600_000)
    else:
        with client.trajectory_writer(num_keep_alive_refs=1) as w:
            for i in range(items):
                w.append(trajs[i % len(trajs)])
                item = {k: w.history[k][-1] for k in HOPPER}
                for s in samplers:
                    w.create_item(f"w1_{s}_{feed}", float(prio[i]), item)
                if i % 16 == 15:
                    w.flush()
            w.end_episode(timeout_ms=600_000)
    return time.perf_counter() - t0


def n_items(cfg: dict, feed: str) -> int:
    """Trajectories in a feed's tables: per-step feeds may hold fewer (``step_items``: 1000 appends each)."""
    return int(cfg.get("step_items") or cfg["items"]) if feed.startswith("per-step") else int(cfg["items"])


def w1(cfg: dict, addr: str, client, pool: ClientPool) -> None:
    samplers = cfg.get("samplers", ["uniform", "prioritized"])
    feeds = cfg.get("feeds", FEEDS)
    fills = {}
    for feed in feeds:
        fills[feed] = fill_w1(client, n_items(cfg, feed), samplers, feed)
    info = client.server_info()
    for feed in feeds:
        for s in samplers:
            size = info[f"w1_{s}_{feed}"].current_size
            if size != n_items(cfg, feed):
                raise RuntimeError(f"table w1_{s}_{feed} holds {size} items, expected {n_items(cfg, feed)}")
    for feed in feeds:
        for s in samplers:
            for k in cfg["clients"]:
                prepare = {"table": f"w1_{s}_{feed}", "batch": W1_BATCH,
                           "in_flight": cfg.get("in_flight", 2 * W1_BATCH),
                           "prefetch": cfg.get("prefetch", 2), "warmup": 3,
                           "warmup_s": cfg.get("warmup_s", 0.5)}
                try:
                    r = pool.run_case(k, prepare, cfg["seconds"])
                except Exception as e:
                    fail("W1", PEER, f"{type(e).__name__}: {e}", variant=f"TrajectoryDataset, {feed}", sampler=s,
                         clients=k)
                    continue
                emit({"workload": "W1", "peer": PEER, "variant": f"TrajectoryDataset, {feed}", "sampler": s,
                      "clients": k, "B": W1_BATCH, "W": HOPPER_T, "N": n_items(cfg, feed),
                      "step_bytes": step_bytes(HOPPER), **r,
                      "fill_s": fills[feed], "version": version()})


def w2(cfg: dict, addr: str, client, pool: ClientPool) -> None:
    n = int(cfg["N"])
    data = transitions(n)
    p0 = initial_priorities(n)
    t0 = time.perf_counter()
    with client.trajectory_writer(num_keep_alive_refs=1) as w:
        for i in range(n):
            w.append({k: v[i] for k, v in data.items()})
            w.create_item("w2", float(p0[i]), {k: w.history[k][-1] for k in TRANSITION})
            if i % 256 == 255:
                w.flush()
        w.end_episode(timeout_ms=600_000)
    fill_s = time.perf_counter() - t0
    del data
    size = client.server_info()["w2"].current_size
    if size != n:
        raise RuntimeError(f"table w2 holds {size} items, expected {n}")
    for b in cfg["batches"]:
        prepare = {"table": "w2", "batch": b, "in_flight": cfg.get("in_flight", 2 * b), "update": True,
                   "prefetch": cfg.get("prefetch", 2), "warmup": 3, "warmup_s": cfg.get("warmup_s", 0.5)}
        try:
            r = pool.run_case(1, prepare, cfg["seconds"])
        except Exception as e:
            fail("W2", PEER, f"{type(e).__name__}: {e}", variant="TrajectoryDataset + mutate_priorities", B=b, N=n)
            continue
        emit({"workload": "W2", "peer": PEER, "variant": "TrajectoryDataset + mutate_priorities",
              "sampler": "prioritized", "clients": 1, "B": b, "N": n, "step_bytes": step_bytes(TRANSITION), **r,
              "fill_s": fill_s, "version": version()})


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--client":
        client_main(sys.argv[2])
        return
    cfg = parse_config()
    wl = cfg["workload"]
    ok, names = loopback_only()
    if not ok and not cfg.get("allow_any_interface"):
        fail(wl, PEER, f"not run: Reverb's server listens on every interface ([::]:port) and this network "
                       f"namespace has {names}; run it under 'unshare --net' (compare_peers.py does)")
        return
    import reverb

    if wl == "W1":
        samplers = cfg.get("samplers", ["uniform", "prioritized"])
        sig = tf_signature(HOPPER, HOPPER_T)
        tables = [table(f"w1_{s}_{f}", s, n_items(cfg, f), sig) for f in cfg.get("feeds", FEEDS) for s in samplers]
        k_max = max(cfg["clients"])
    else:
        tables = [table("w2", "prioritized", int(cfg["N"]), tf_signature(TRANSITION, None))]
        k_max = 1
    server = reverb.Server(tables, port=None)
    addr = f"127.0.0.1:{server.port}"
    client = reverb.Client(addr)
    pool = ClientPool(k_max, addr)
    try:
        (w1 if wl == "W1" else w2)(cfg, addr, client, pool)
    finally:
        pool.close()
        server.stop()


if __name__ == "__main__":
    main()
