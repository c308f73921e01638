#!/usr/bin/env python
"""Reverb's side of scripts/bench/bench_ingest.py: per-step writer ingest (runs in Reverb's own venv).

    python -m scripts.peers.reverb_ingest '{"workloads": ["hopper", "image"], "ks": [1, 2, 4], "seconds": 3}'

This process is the Reverb server (``reverb.Server``, in process: one table per workload,
Uniform sampler, FIFO remover, ``MinSize(1)`` limiter, the table signature of the workload's
episode). The writers are separate processes of this venv (``--writer ADDR``), a pool of the
largest K; each has its own ``reverb.Client`` to 127.0.0.1 and one ``TrajectoryWriter``
(``num_keep_alive_refs`` = episode length, the default auto-tuned chunk length) and, per
step, calls ``append(step)``; at the end of each episode ``create_item(table, 1.0, history
of the last L steps)`` and ``end_episode()`` (which returns once the server has confirmed
the episode's item): how a Reverb actor writes. A case tells K writers to open a writer and
write one warm-up episode, then all to write whole episodes for ``seconds``; its time runs
from the ``go`` until the last writer's last ``end_episode`` has returned, and the table's
completed inserts must have grown by exactly the episodes the writers counted.

Network: the server listens on every interface, so the worker refuses to start one unless
its network namespace holds only the loopback interface (the driver runs it under
``unshare --net``, as compare_peers does). Prints one JSON object per case.
"""
from __future__ import annotations

import os
import socket
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

from scripts.peers._common import emit, fail, parse_config  # noqa: E402
from scripts.peers._ingest import HANDSHAKE_TIMEOUT, WORKLOADS, LinePool, serve_writer, summarize_writers  # noqa: E402

PEER = "reverb"


def version() -> str:
    from importlib.metadata import version as v
    return f"dm-reverb {v('dm-reverb')}, tensorflow {v('tensorflow')}, numpy {np.__version__}"


def writer_main(addr: str) -> None:
    """A writer process: one reverb.Client, a TrajectoryWriter per ``open``."""
    import reverb

    client = reverb.Client(addr)

    def open_writer(msg: dict):
        table, length = msg["table"], int(msg["length"])
        cols = list(WORKLOADS[msg["workload"]]["columns"])
        w = client.trajectory_writer(num_keep_alive_refs=length)

        def end_episode():
            w.create_item(table, 1.0, {k: w.history[k][-length:] for k in cols})
            w.end_episode(timeout_ms=int(HANDSHAKE_TIMEOUT * 1000))

        return w.append, end_episode, w.flush, w.close

    serve_writer(open_writer)


def signature(workload: str):
    import tensorflow as tf
    wl = WORKLOADS[workload]
    return {k: tf.TensorSpec([wl["length"], *shape], tf.dtypes.as_dtype(np.dtype(dt)))
            for k, (shape, dt) in wl["columns"].items()}


def inserts(client, table: str) -> int:
    return int(client.server_info()[table].rate_limiter_info.insert_stats.completed)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--writer":
        writer_main(sys.argv[2])
        return
    cfg = parse_config()
    names = [n for _, n in socket.if_nameindex()]
    if names != ["lo"] and not cfg.get("allow_any_interface"):
        fail("ingest", PEER, f"not run: Reverb's server listens on every interface ([::]:port) and this network "
                             f"namespace has {names}; run it under 'unshare --net' (bench_ingest does)")
        return
    import reverb

    workloads = cfg["workloads"]
    tables = [reverb.Table(name=wl, sampler=reverb.selectors.Uniform(), remover=reverb.selectors.Fifo(),
                           max_size=int(cfg.get("table_items", 256)),
                           rate_limiter=reverb.rate_limiters.MinSize(1), signature=signature(wl))
              for wl in workloads]
    server = reverb.Server(tables, port=None)
    addr = f"127.0.0.1:{server.port}"
    client = reverb.Client(addr)
    kmax = max(cfg["ks"])
    pool = LinePool([[sys.executable, "-m", "scripts.peers.reverb_ingest", "--writer", addr] for _ in range(kmax)])
    try:
        for wl in workloads:
            length = WORKLOADS[wl]["length"]
            for k in cfg["ks"]:
                procs = pool.procs[:k]
                case = {"workload": wl, "system": PEER, "variant": "TrajectoryWriter per-step append",
                        "mode": "alone", "K": k, "rate": 0, "ranks": 1, "length": length}
                try:
                    for i, p in enumerate(procs):  # distinct data per writer
                        pool.send([p], {"cmd": "open", "table": wl, "workload": wl, "length": length,
                                        "seed": i, "warmup": 1})
                    pool.read(procs, HANDSHAKE_TIMEOUT)
                    before = inserts(client, wl)
                    t0 = time.perf_counter()
                    pool.send(procs, {"cmd": "go", "seconds": cfg["seconds"]})
                    res = pool.read(procs, cfg["seconds"] + HANDSHAKE_TIMEOUT)
                    elapsed = time.perf_counter() - t0
                    got = inserts(client, wl) - before
                    pool.send(procs, {"cmd": "close"})
                    pool.read(procs, HANDSHAKE_TIMEOUT)
                except Exception as e:
                    fail("ingest", PEER, f"{type(e).__name__}: {e}", **case)
                    continue
                row = {**case, **summarize_writers(res, wl), "elapsed_s": elapsed, "inserted": got,
                       "version": version()}
                if got != row["episodes"]:
                    fail("ingest", PEER, f"the table gained {got} items, the writers ended {row['episodes']}",
                         **case)
                    continue
                emit({"status": "ok", **row})
    finally:
        pool.close()
        server.stop()


if __name__ == "__main__":
    main()
