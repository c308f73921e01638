#!/usr/bin/env python
"""gear_mpi worker for scripts/bench/compare_peers.py (runs in the project's environment).

    mpiexec -n K python -m mpi4py gear_worker.py '{"workload": "W1", "items": 256, "seconds": 3, ...}'
    python gear_worker.py '{"workload": "W2", "N": 100000, "batches": [256], "seconds": 2}'
    python gear_worker.py '{"workload": "W3", "Ns": [100000, 10000000], "B": 65536, "seconds": 2}'

W1 (under mpiexec, K ranks = K clients): gm.Replay holding ``items`` hopper trajectories in
all (items / K per rank), insert_many, then every rank calls replay.sample(32, 1000, "head",
out=batch) for ``seconds`` (one batch filled again by every call: nothing allocated per call);
modes decentralized (shared-memory window path, and the forced alltoallv path that inter-node
windows take) and local; uniform and prioritized (0.6, 0.4).
Delivered GB/s = K * (32 x 1000 x 61 bytes) * calls / elapsed wall time (rank 0 prints).
W2: gm.Shard(Prioritized) with N length-1 items; one step = sample(B, 1, out=batch) +
update_priorities(batch.keys, new priorities).
W3: through the public API, as W2 with one float32 per item: gm.Shard(Prioritized) holding N
length-1 items, one step = sample(B, 1, out=batch) + update_priorities(batch.keys, new priorities)
("Shard(Prioritized) sample+update", the row compare_peers' ratios use); and, for information,
the shard's internal priority index alone (gear_mpi.selection.priority_index.PriorityIndex): draw B + set B
per step ("draw+set"), and the same plus probabilities and importance weights ("+IS weights"),
as scripts/bench/bench_shard.py does.
"""
from __future__ import annotations

import ctypes
import gc
import time

import numpy as np

import gear_mpi as gm
from scripts.peers._common import (
    ALPHA, BETA, HOPPER, HOPPER_T, TRANSITION, W1_BATCH, W2_FLOOR, available_bytes, emit, fail, hopper_priorities,
    hopper_trajectory, initial_priorities, parse_config, step_bytes, steady_loop, transitions)

PEER = "gear_mpi"


def version() -> str:
    import numba
    return f"gear_mpi {gm.__version__}, numba {numba.__version__} ({numba.config.NUMBA_NUM_THREADS} threads), " \
           f"numpy {np.__version__}"


def w1(cfg: dict) -> None:
    import numba
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    k, rank = comm.size, comm.rank
    total = int(cfg["items"])
    mine = total // k + (1 if rank < total % k else 0)
    spec = gm.TrajectorySpec(HOPPER, max_length=HOPPER_T)
    traj = [hopper_trajectory(rank * 100_000 + i) for i in range(min(mine, 16))]
    trajs = [traj[i % len(traj)] for i in range(mine)]  # at most 16 distinct arrays per rank (memory)
    prio = hopper_priorities(total)[rank::k][:mine]
    data_bytes = W1_BATCH * HOPPER_T * step_bytes(HOPPER)
    cases = [(m, f) for m in cfg.get("modes", ["decentralized", "local"]) for f in
             ([False, True] if m == "decentralized" and k > 1 and cfg.get("alltoallv", True) else [False])]
    for sampler_name in cfg.get("samplers", ["uniform", "prioritized"]):
        for mode, force in cases:
            sampler = gm.Prioritized(ALPHA, BETA) if sampler_name == "prioritized" else gm.Uniform()
            replay = gm.Replay(spec, mine * HOPPER_T, sampler, mode=mode, comm=comm, seed=0, force_alltoallv=force,
                               timeout=300)
            comm.Barrier()
            t0 = time.perf_counter()
            replay.insert_many(trajs, prio)
            fill_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            t_start = time.perf_counter()
            t_end = t_start + cfg.get("warmup_s", 0.5)
            n = 0
            batch = None  # filled again by every call (out=): the loop allocates nothing per call
            while True:  # warm-up: compile paths, fault pages in (at least 2 calls and warmup_s seconds)
                batch = replay.sample(W1_BATCH, HOPPER_T, "head", out=batch)
                n += 1
                if comm.allreduce(n >= 2 and time.perf_counter() > t_end, op=MPI.LOR):
                    break
            # the timed calls, in chunks of about 0.1 s (sized from the warm-up rate) with one allreduce
            # after each deciding whether to stop: between calls the loop runs no collective of its own
            # (sample is the only one timed, as a training loop would run it)
            rate = comm.allreduce(n / (time.perf_counter() - t_start), op=MPI.MIN)
            chunk = max(1, int(rate * 0.1))
            times = []
            comm.Barrier()
            t_start = time.perf_counter()
            while True:
                for _ in range(chunk):
                    t0 = time.perf_counter()
                    replay.sample(W1_BATCH, HOPPER_T, "head", out=batch)
                    times.append(time.perf_counter() - t0)
                if comm.allreduce(time.perf_counter() - t_start >= cfg["seconds"] and len(times) >= 3, op=MPI.LOR):
                    break
            elapsed = comm.allreduce(time.perf_counter() - t_start, op=MPI.MAX)
            comm.Barrier()
            med = comm.allreduce(float(np.median(times)), op=MPI.MAX)
            best = comm.allreduce(float(np.min(times)), op=MPI.MAX)
            stats = replay.stats()
            replay.close()
            if rank == 0:
                variant = mode + (" (alltoallv)" if force else "")
                emit({"workload": "W1", "peer": PEER, "variant": variant, "sampler": sampler_name, "clients": k,
                      "threads": numba.config.NUMBA_NUM_THREADS,
                      "B": W1_BATCH, "W": HOPPER_T, "N": total, "step_bytes": step_bytes(HOPPER), "calls": len(times),
                      "elapsed_s": elapsed, "median_call_s": med, "best_call_s": best,
                      "bytes_per_call": k * data_bytes, "items_per_call": k * W1_BATCH,
                      "bytes_total": len(times) * k * data_bytes, "items_total": len(times) * k * W1_BATCH,
                      "fill_s": fill_s,
                      "windows_shared": stats["total"]["windows_shared"], "windows_mpi": stats["total"]["windows_mpi"],
                      "version": version()})
            del replay
            gc.collect()


def w2(cfg: dict) -> None:
    n = int(cfg["N"])
    spec = gm.TrajectorySpec(TRANSITION, max_length=1)
    data = transitions(n)
    p0 = initial_priorities(n)
    t0 = time.perf_counter()
    shard = gm.Shard(spec, n, gm.Prioritized(ALPHA, BETA), seed=0)
    chunk = 10_000
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        shard.insert_many([{"obs": data["obs"][i:i + 1], "action": data["action"][i:i + 1],
                            "reward": data["reward"][i:i + 1]} for i in range(lo, hi)], p0[lo:hi])
    fill_s = time.perf_counter() - t0
    del data
    assert len(shard) == n
    rng = np.random.default_rng(3)
    for b in cfg["batches"]:
        new_p = rng.random(b) + 0.01
        batch = shard.sample(b, 1)

        def step():
            shard.sample(b, 1, out=batch)
            shard.update_priorities(batch.keys, new_p)

        r = steady_loop(step, cfg["seconds"], warmup_s=cfg.get("warmup_s", 0.5))
        emit({"workload": "W2", "peer": PEER, "variant": "Shard(Prioritized) sample+update",
              "sampler": "prioritized", "threads": cfg.get("threads"), "clients": 1, "B": b, "N": n,
              "step_bytes": step_bytes(TRANSITION), **r,
              "bytes_per_call": b * step_bytes(TRANSITION), "fill_s": fill_s, "version": version()})
        w2_copy_floor(shard, batch, b, n, cfg)
    shard.close()


def w2_copy_floor(shard, batch, b: int, n: int, cfg: dict) -> None:
    """Information row: the shard's ring rows of B uniformly random items copied into the batch by the
    gather kernel alone (no draw, no keys, no weights, no Python layer between calls): the memory traffic
    that every system returning these rows pays, whatever its sampler. A peer's W2 step can be at most
    (its own step time / this) times slower than any gear_mpi step."""
    from gear_mpi.kernels import gather

    cap = shard.store.capacity
    addrs = shard.column_addresses()[0]
    sizes = shard.spec.step_bytes_array
    rows = np.arange(b, dtype=np.int64)
    one, zero = np.ones(b, np.int64), np.zeros(b, np.int64)
    outs = batch.byte_views()
    # one ring view per column, over the shard's own memory (addresses valid while the shard is open)
    rings = tuple(np.frombuffer((ctypes.c_uint8 * int(cap * sz)).from_address(int(a)), np.uint8)
                  for a, sz in zip(addrs, sizes))
    pool = np.random.default_rng(4).integers(0, n, (400, b))  # 400 x B rows: far more than any last-level cache
    turn = [0]
    no_mask = np.zeros((0, 1), np.bool_)

    def step():
        turn[0] = (turn[0] + 1) % len(pool)
        gather.gather_columns(rings, sizes, cap, pool[turn[0]], one, zero, rows, outs, 1, no_mask)

    r = steady_loop(step, cfg["seconds"], warmup_s=cfg.get("warmup_s", 0.5))
    emit({"workload": "W2", "peer": PEER, "variant": W2_FLOOR, "sampler": "uniform", "threads": cfg.get("threads"),
          "clients": 1, "B": b, "N": n, "step_bytes": step_bytes(TRANSITION), **r,
          "bytes_per_call": b * step_bytes(TRANSITION), "version": version()})


W3_SHARD = "Shard(Prioritized) sample+update"


def w3_shard(n: int, b: int, cfg: dict) -> None:
    """W3 through the public API: a Shard of ``n`` one-float items, sample(B, 1, out=) + update_priorities."""
    spec = gm.TrajectorySpec({"x": ((), "float32")}, max_length=1)
    t0 = time.perf_counter()
    shard = gm.Shard(spec, n, gm.Prioritized(ALPHA, BETA), seed=0)
    chunk = 10_000_000
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        shard.insert_packed({"x": np.arange(lo, hi, dtype=np.float32)}, np.ones(hi - lo, np.int64),
                            initial_priorities(n)[lo:hi])
    fill_s = time.perf_counter() - t0
    rng = np.random.default_rng(3)
    new_p = rng.random(b) + 0.01
    batch = shard.sample(b, 1)

    def step():
        shard.sample(b, 1, out=batch)
        shard.update_priorities(batch.keys, new_p)

    r = steady_loop(step, cfg["seconds"], min_calls=3, warmup=2, warmup_s=cfg.get("warmup_s", 0.5))
    emit({"workload": "W3", "peer": PEER, "variant": W3_SHARD, "sampler": "prioritized",
          "threads": cfg.get("threads"), "clients": 1, "B": b, "N": n, "step_bytes": 4, **r, "bytes_per_call": 4 * b,
          "fill_s": fill_s, "version": version()})
    shard.close()


def w3(cfg: dict) -> None:
    from gear_mpi.selection import PriorityIndex

    b = int(cfg["B"])
    sel = gm.Prioritized(ALPHA, BETA)
    for n in cfg["Ns"]:
        # shard: ring 4 B, table ~65 B, index ~9.3 B an item, plus the fill's priorities; index alone: less
        need = 80 * n + 16 * min(n, 10_000_000)
        if available_bytes() and need * 1.5 > available_bytes():
            fail("W3", PEER, f"skipped: needs about {need / 2**30:.1f} GiB", B=b, N=n, variant=W3_SHARD)
            continue
        w3_shard(n, b, cfg)
        gc.collect()
        t0 = time.perf_counter()
        idx = PriorityIndex(n)
        p0 = initial_priorities(n)
        chunk = 10_000_000
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            idx.set(np.arange(lo, hi, dtype=np.int64), sel.weights(p0[lo:hi]))
        fill_s = time.perf_counter() - t0
        del p0
        rng = np.random.default_rng(3)
        new_p = rng.random(b) + 0.01
        out = np.empty(b, np.int64)

        def draw_set():
            slots = idx.draw(rng.random(b), out)
            idx.set(slots, sel.weights(new_p))

        def full():  # + what a replay hands back besides the data: probabilities and importance weights
            slots = idx.draw(rng.random(b), out)
            w = idx.leaves[slots]
            _ = w / idx.total
            _ = sel.importance_weights(w, idx.min_positive)
            idx.set(slots, sel.weights(new_p))

        for label, fn in (("PriorityIndex draw+set", draw_set), ("PriorityIndex draw+set +IS weights", full)):
            r = steady_loop(fn, cfg["seconds"], min_calls=3, warmup=2, warmup_s=cfg.get("warmup_s", 0.5))
            emit({"workload": "W3", "peer": PEER, "variant": label, "sampler": "prioritized",
                  "threads": cfg.get("threads"), "clients": 1, "B": b,
                  "N": n, "step_bytes": 4, **r, "bytes_per_call": 4 * b, "fill_s": fill_s, "version": version()})
        idx = None  # free before the next N
        gc.collect()


def main() -> None:
    cfg = parse_config()
    {"W1": w1, "W2": w2, "W3": w3}[cfg["workload"]](cfg)


if __name__ == "__main__":
    main()
