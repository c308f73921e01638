"""A torch training loop beside the replay: CPU seconds and wall time under each thread setting.

The loop is a small DQN's (CartPole-sized): every environment step appends one one-step transition to a
one-rank ``Replay``; every ``--train-every`` steps it samples ``--batch`` transitions and takes one Adam
step of a 2x64 MLP on them (torch's intra-op threads at their default). Each setting runs in a fresh
process (OpenMP reads its settings once), the settings taking turns ``--reps`` times; the process's user +
system CPU seconds and its wall time are printed per run, then the medians.

Settings: ``default`` (what ``import gear_mpi`` chooses: see ``gear_mpi.threads``), ``active``
(``OMP_WAIT_POLICY=ACTIVE``: numba's workers spin when idle), ``one-thread`` (``NUMBA_NUM_THREADS=1``, as
``GEAR_MPI_THREADS=1``), ``workqueue`` (``NUMBA_THREADING_LAYER=workqueue``) and ``spin1000``
(``GOMP_SPINCOUNT=1000``: GNU OpenMP's idle threads, numba's and torch's, spin about 25 us before they
sleep). Run the same script against an older checkout to compare versions:
``PYTHONPATH=/old/checkout python scripts/bench/bench_threads.py``.

    python -m scripts.bench.bench_threads [--steps 3000] [--reps 3] [--settings default,active]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = {"default": {}, "active": {"OMP_WAIT_POLICY": "ACTIVE"}, "one-thread": {"NUMBA_NUM_THREADS": "1"},
            "workqueue": {"NUMBA_THREADING_LAYER": "workqueue"}, "spin1000": {"GOMP_SPINCOUNT": "1000"}}
CLEARED = ("OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER", "NUMBA_NUM_THREADS", "GEAR_MPI_THREADS", "GOMP_SPINCOUNT")


def loop(steps: int, batch: int, train_every: int, capacity: int) -> dict:
    """One run in this process: returns cpu_s, wall_s (of the loop, after warm-up) and the thread layer."""
    import numpy as np
    import torch

    import gear_mpi as gm
    import numba

    spec = gm.TrajectorySpec({"obs": ((4,), "float32"), "next_obs": ((4,), "float32"), "action": ((1,), "int64"),
                              "reward": ((1,), "float32"), "done": ((1,), "float32")}, max_length=1)
    replay = gm.Replay(spec, capacity, gm.Uniform(), seed=0)
    shard = replay.shard
    rng = np.random.default_rng(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 2))
    target = torch.nn.Sequential(*[torch.nn.Linear(4, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                   torch.nn.ReLU(), torch.nn.Linear(64, 2)])
    target.load_state_dict(net.state_dict())
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    append = getattr(shard, "append_step", None)
    ones = np.ones(1, np.int64)

    def add(i: int) -> None:
        o = rng.standard_normal(4).astype(np.float32)
        step = {"obs": o, "next_obs": o, "action": np.array([i & 1]), "reward": np.ones(1, np.float32),
                "done": np.zeros(1, np.float32)}
        if append is not None:
            append(step)
        else:  # an older gear_mpi
            shard.insert_packed({k: v[None] for k, v in step.items()}, ones)

    def train() -> None:
        b = replay.sample(batch, 1)
        obs, nxt = b["obs"][:, 0], b["next_obs"][:, 0]
        with torch.no_grad():
            y = b["reward"][:, 0, 0] + 0.99 * (1 - b["done"][:, 0, 0]) * target(nxt).max(1).values
        q = net(obs).gather(1, b["action"][:, 0]).squeeze(1)
        loss = torch.nn.functional.smooth_l1_loss(q, y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    for i in range(max(batch, 500)):  # warm-up: fill, compile, first steps
        add(i)
    for _ in range(20):
        train()
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(steps):
        add(i)
        if i % train_every == 0:
            train()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    time.sleep(0.5)  # what idle workers burn once the calls stop
    idle = time.process_time() - c0 - cpu
    replay.close()
    return {"cpu_s": cpu, "wall_s": wall, "idle_cpu_s": idle, "layer": numba.threading_layer(),
            "numba_threads": numba.get_num_threads(), "torch_threads": torch.get_num_threads(),
            "wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--train-every", type=int, default=1)
    ap.add_argument("--capacity", type=int, default=100_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--settings", default="default,active,one-thread")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        print(json.dumps(loop(a.steps, a.batch, a.train_every, a.capacity)))
        return
    names = a.settings.split(",")
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for rep in range(a.reps):
        for name in names:
            env = {k: v for k, v in os.environ.items() if k not in CLEARED}
            env.update(SETTINGS[name])
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--steps", str(a.steps),
                   "--batch", str(a.batch), "--train-every", str(a.train_every), "--capacity", str(a.capacity)]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                raise SystemExit(f"{name}: {out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs[name].append(row)
            print(json.dumps({"setting": name, "rep": rep, **row}), flush=True)
    print(f"\n{a.steps} steps, sample({a.batch}) + one Adam step every {a.train_every} step(s); medians of {a.reps}:")
    for name, rows in runs.items():
        med = {k: sorted(r[k] for r in rows)[len(rows) // 2] for k in ("cpu_s", "wall_s", "idle_cpu_s")}
        lo_hi = {k: (min(r[k] for r in rows), max(r[k] for r in rows)) for k in ("cpu_s", "wall_s")}
        print(f"  {name:<11} cpu {med['cpu_s']:.2f} s ({lo_hi['cpu_s'][0]:.2f}-{lo_hi['cpu_s'][1]:.2f})  "
              f"wall {med['wall_s']:.2f} s ({lo_hi['wall_s'][0]:.2f}-{lo_hi['wall_s'][1]:.2f})  "
              f"idle 0.5 s after: {med['idle_cpu_s']:.2f} s cpu  [{rows[0]['layer']}, "
              f"{rows[0]['numba_threads']} numba / {rows[0]['torch_threads']} torch threads, "
              f"OMP_WAIT_POLICY={rows[0]['wait_policy']}]")


if __name__ == "__main__":
    main()
