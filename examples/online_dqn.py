"""Online DQN on CartPole-v1: actor processes write into gear_mpi shards, learners train with DDP.

    mpiexec -n 2 python -m mpi4py examples/online_dqn.py            # until solved or the step budget
    mpiexec -n 2 python -m mpi4py examples/online_dqn.py --quick    # about a minute (the CI test)

SCAFFOLD (temporary): transitions travel actor -> learner through a multiprocessing Queue and the
learner calls replay.insert_many; this is replaced by gm.Writer + gm.SampleToInsertRatio.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: many small processes share few cores

import argparse
import math
import multiprocessing as mp
import queue as queue_mod
import sys
import time
from dataclasses import dataclass, asdict
from multiprocessing import shared_memory

import numpy as np

OBS_DIM, N_ACTIONS = 4, 2
SOLVED = 475.0


# ---- configuration --------------------------------------------------------------------------------

@dataclass
class Config:
    actors: int = 2                 # actor processes per learner rank
    hidden: int = 128
    lr: float = 1e-3
    gamma: float = 0.99
    batch: int = 64                 # windows sampled per learner rank per update
    capacity: int = 50_000          # transitions per rank
    samples_per_insert: float = 16.0
    min_size: int = 1000            # transitions in the whole replay before the first sample
    error_buffer: float = 4000.0
    target_every: int = 100         # updates between target-network copies
    publish_every: int = 10         # updates between weight publications to the actors
    eps_start: float = 1.0
    eps_end: float = 0.02
    eps_decay_steps: int = 20_000   # env steps (whole job) of the linear epsilon decay
    alpha: float = 0.6
    beta: float = 0.4
    max_steps: int = 300_000        # env-step budget (whole job)
    max_seconds: float = 1200.0
    target_return: float = SOLVED
    log_every: float = 2.0          # seconds between curve lines
    seed: int = 0
    plot: str | None = None
    quick: bool = False


def parse_config(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the CI version: a small step budget, about a minute")
    p.add_argument("--actors", type=int, help="actor processes per learner rank (default 2)")
    p.add_argument("--max-steps", type=int, help="env-step budget of the whole job")
    p.add_argument("--max-seconds", type=float, help="wall-time budget")
    p.add_argument("--seed", type=int)
    p.add_argument("--plot", help="save return vs env steps here (full run default: docs/img/online_dqn.png)")
    args = p.parse_args(argv)
    cfg = Config()
    if args.quick:
        cfg.quick, cfg.max_steps, cfg.max_seconds = True, 20_000, 50.0
        cfg.eps_decay_steps = 8_000
    else:
        cfg.plot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img", "online_dqn.png")
    for name in ("actors", "max_steps", "max_seconds", "seed", "plot"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    return cfg


# ---- the Q-network as a flat float32 vector (actors evaluate it with numpy) ---------------------------

def layer_shapes(hidden: int) -> list[tuple[int, ...]]:
    """Shapes of the parameters in torch's order: (W1, b1, W2, b2, W3, b3) of a 4-h-h-2 MLP."""
    return [(hidden, OBS_DIM), (hidden,), (hidden, hidden), (hidden,), (N_ACTIONS, hidden), (N_ACTIONS,)]


def unflatten(flat: np.ndarray, hidden: int) -> list[np.ndarray]:
    out, at = [], 0
    for shape in layer_shapes(hidden):
        n = math.prod(shape)
        out.append(flat[at:at + n].reshape(shape))
        at += n
    return out


def numpy_q(params: list[np.ndarray], obs: np.ndarray) -> np.ndarray:
    w1, b1, w2, b2, w3, b3 = params
    h = np.maximum(w1 @ obs + b1, 0.0)
    h = np.maximum(w2 @ h + b2, 0.0)
    return w3 @ h + b3


class SharedState:
    """One shared-memory block between a learner and its actors.

    Layout: int64 control[8] (0: weights version, a seqlock -- odd while written; 1: stop flag;
    2: float64 bits of the priority for new transitions), float32 params[n], then per actor int64
    steps, int64 episodes and a float64 ring of the last RING episode returns.
    """

    RING = 1024

    def __init__(self, n_params: int, actors: int, name: str | None = None):
        self.n_params, self.actors = n_params, actors
        size = 64 + 4 * n_params + 16 * actors + 8 * actors * self.RING
        size += (-size) % 8
        self.owner = name is None
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=size if self.owner else 0)
        buf = self.shm.buf
        self.control = np.ndarray((8,), np.int64, buf, 0)
        self.params = np.ndarray((n_params,), np.float32, buf, 64)
        at = 64 + 4 * n_params
        at += (-at) % 8
        self.steps = np.ndarray((actors,), np.int64, buf, at)
        self.episodes = np.ndarray((actors,), np.int64, buf, at + 8 * actors)
        self.returns = np.ndarray((actors, self.RING), np.float64, buf, at + 16 * actors)
        if self.owner:
            self.control[:] = 0
            self.steps[:] = 0
            self.episodes[:] = 0
            self.set_priority(1.0)

    @property
    def name(self) -> str:
        return self.shm.name

    def publish(self, flat: np.ndarray) -> None:
        self.control[0] += 1  # odd: being written
        self.params[:] = flat
        self.control[0] += 1

    def read(self, out: np.ndarray, last: int) -> int:
        """Copy the weights into ``out`` if their version moved past ``last``; returns the version read."""
        while True:
            v = int(self.control[0])
            if v == last:
                return last
            if v & 1:
                continue
            out[:] = self.params
            if int(self.control[0]) == v:
                return v

    def set_priority(self, p: float) -> None:
        self.control[2:3].view(np.float64)[0] = p

    def priority(self) -> float:
        return float(self.control[2:3].view(np.float64)[0])

    @property
    def stop(self) -> bool:
        return bool(self.control[1])

    def close(self) -> None:
        for attr in ("control", "params", "steps", "episodes", "returns"):
            setattr(self, attr, None)
        self.shm.close()
        if self.owner:
            self.shm.unlink()


# ---- actors ---------------------------------------------------------------------------------------

def actor_main(index: int, state_name: str, n_params: int, cfg: Config, learners: int, seed: int, sink) -> None:
    """Step CartPole-v1 epsilon-greedily with the latest published weights; write one-step transitions."""
    import gymnasium as gym

    state = SharedState(n_params, cfg.actors, state_name)
    try:
        rng = np.random.default_rng(seed)
        env = gym.make("CartPole-v1")
        obs, _ = env.reset(seed=seed)
        flat = np.zeros(n_params, np.float32)
        params = unflatten(flat, cfg.hidden)
        version = state.read(flat, -1)
        ret, pending = 0.0, []
        while not state.stop:
            job_steps = int(state.steps.sum()) * learners  # this learner's actors, scaled to the job
            frac = min(1.0, job_steps / cfg.eps_decay_steps)
            eps = cfg.eps_start + frac * (cfg.eps_end - cfg.eps_start)
            if rng.random() < eps:
                action = int(rng.integers(N_ACTIONS))
            else:
                action = int(np.argmax(numpy_q(params, obs)))
            nxt, reward, terminated, truncated, _ = env.step(action)
            pending.append((obs, action, reward, nxt, float(terminated)))
            if len(pending) >= 16 or terminated or truncated:
                sink.put(pending, state.priority())
                pending = []
            state.steps[index] += 1
            ret += reward
            obs = nxt
            if terminated or truncated:
                e = int(state.episodes[index])
                state.returns[index, e % state.RING] = ret
                state.episodes[index] = e + 1
                ret = 0.0
                obs, _ = env.reset()
                version = state.read(flat, version)  # the latest policy for the next episode
        env.close()
    finally:
        state.close()


class QueueSink:
    """SCAFFOLD: transitions to the learner through a bounded queue."""

    def __init__(self, q):
        self.q = q

    def put(self, transitions, priority):
        self.q.put((transitions, priority))


# ---- learner --------------------------------------------------------------------------------------

def make_spec():
    import gear_mpi as gm
    return gm.TrajectorySpec({"obs": ((OBS_DIM,), np.float32), "action": ((), np.int64),
                              "reward": ((), np.float32), "next_obs": ((OBS_DIM,), np.float32),
                              "done": ((), np.float32)}, max_length=1)


def init_ddp(comm):
    """A gloo process group over the ranks of ``comm``, at a free port of rank 0 agreed through MPI."""
    import socket
    import torch.distributed as dist

    host = socket.gethostname()
    port = 0
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
    hosts = comm.allgather(host)
    port = comm.bcast(port, 0)
    addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(hosts[0])
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=comm.rank, world_size=comm.size)
    return dist


def main(argv=None) -> int:
    cfg = parse_config(argv)
    from mpi4py import MPI
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import gear_mpi as gm

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP also broadcasts them)
    dist = init_ddp(comm)

    def net():
        return nn.Sequential(nn.Linear(OBS_DIM, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden),
                             nn.ReLU(), nn.Linear(cfg.hidden, N_ACTIONS))

    q = net()
    ddp = nn.parallel.DistributedDataParallel(q)
    target = net()
    target.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=cfg.lr)
    n_params = sum(p.numel() for p in q.parameters())

    def flat_weights():
        return torch.nn.utils.parameters_to_vector(q.parameters()).detach().numpy()

    spec = make_spec()
    replay = gm.Replay(spec, cfg.capacity, gm.Prioritized(cfg.alpha, cfg.beta), comm=comm, seed=cfg.seed)
    state = SharedState(n_params, cfg.actors)
    state.publish(flat_weights())
    ctx = mp.get_context("spawn")
    tq = ctx.Queue(maxsize=64)
    actors = [ctx.Process(target=actor_main, name=f"actor{rank}.{i}",
                          args=(i, state.name, n_params, cfg, size, cfg.seed * 1000 + rank * 100 + i, QueueSink(tq)),
                          daemon=True)
              for i in range(cfg.actors)]
    for a in actors:
        a.start()

    curve = []  # (env steps, episodes, mean return of the last 100, wall seconds)
    returns: list[float] = []
    seen = np.zeros(cfg.actors, np.int64)
    inserted = sampled = 0
    updates = 0
    max_priority = 1.0
    t0 = time.time()
    next_log = t0 + cfg.log_every
    done = False
    if rank == 0:
        print(f"online_dqn: {size} learners x {cfg.actors} actors, CartPole-v1, budget {cfg.max_steps} env steps "
              f"/ {cfg.max_seconds:.0f} s, target mean return {cfg.target_return}", flush=True)
        print(f"{'env_steps':>10} {'episodes':>8} {'mean100':>8} {'updates':>8} {'wall_s':>7}", flush=True)
    try:
        while not done:
            # SCAFFOLD: drain the queue while the local sample/insert ratio allows
            while True:
                ahead = inserted * cfg.samples_per_insert - sampled * 1.0
                block = (inserted * size < cfg.min_size) or ahead < -cfg.error_buffer / size
                if ahead > cfg.error_buffer / size and not block:
                    break
                try:
                    trans, prio = tq.get(timeout=0.5 if block else 0.0) if block else tq.get_nowait()
                except queue_mod.Empty:
                    if block:
                        continue
                    break
                cols = {"obs": np.array([t[0] for t in trans], np.float32),
                        "action": np.array([t[1] for t in trans], np.int64),
                        "reward": np.array([t[2] for t in trans], np.float32),
                        "next_obs": np.array([t[3] for t in trans], np.float32),
                        "done": np.array([t[4] for t in trans], np.float32)}
                replay.insert_many([{k: v[i:i + 1] for k, v in cols.items()} for i in range(len(trans))],
                                   np.full(len(trans), prio))
                inserted += len(trans)
            batch = replay.sample(cfg.batch, window=1)
            sampled += cfg.batch * size
            obs = batch["obs"][:, 0]
            act = batch["action"][:, 0]
            rew = batch["reward"][:, 0]
            nxt = batch["next_obs"][:, 0]
            dn = batch["done"][:, 0]
            with torch.no_grad():
                best = q(nxt).argmax(1, keepdim=True)
                target_q = rew + cfg.gamma * (1.0 - dn) * target(nxt).gather(1, best).squeeze(1)
            pred = ddp(obs).gather(1, act[:, None]).squeeze(1)
            td = pred - target_q
            loss = (batch.weights * F.smooth_l1_loss(pred, target_q, reduction="none")).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            prios = td.detach().abs().numpy().astype(np.float64) + 1e-3
            replay.update_priorities(batch.keys, prios)
            max_priority = max(max_priority, float(prios.max()))
            updates += 1
            if updates % cfg.target_every == 0:
                target.load_state_dict(q.state_dict())
            if updates % cfg.publish_every == 0:
                state.publish(flat_weights())
                state.set_priority(max_priority)
            if updates % 20 == 0:
                now = time.time()
                # new episodes of this rank's actors, gathered over the job
                eps = state.episodes.copy()
                mine = []
                for i in range(cfg.actors):
                    for e in range(max(seen[i], eps[i] - state.RING), eps[i]):
                        mine.append(float(state.returns[i, e % state.RING]))
                seen[:] = eps
                rows = comm.allgather((mine, int(state.steps.sum()), now - t0))
                for r in rows:
                    returns.extend(r[0])
                steps = sum(r[1] for r in rows)
                wall = rows[0][2]
                mean100 = float(np.mean(returns[-100:])) if returns else 0.0
                if wall >= next_log - t0 or len(returns) >= 100 and mean100 >= cfg.target_return:
                    next_log = t0 + wall + cfg.log_every
                    curve.append((steps, len(returns), mean100, wall))
                    if rank == 0:
                        print(f"{steps:>10} {len(returns):>8} {mean100:>8.1f} {updates:>8} {wall:>7.1f}", flush=True)
                done = (len(returns) >= 100 and mean100 >= cfg.target_return) or steps >= cfg.max_steps \
                    or wall >= cfg.max_seconds
    finally:
        state.control[1] = 1
        # SCAFFOLD: unblock actors stuck on a full queue
        deadline = time.time() + 10
        while any(a.is_alive() for a in actors) and time.time() < deadline:
            try:
                while True:
                    tq.get_nowait()
            except queue_mod.Empty:
                pass
            time.sleep(0.05)
        for a in actors:
            a.join(1)
            if a.is_alive():
                a.terminate()
                a.join()
        tq.close()
        tq.join_thread()
        replay.close()
        state.close()
    if rank == 0:
        steps, n_ep, mean100, wall = curve[-1] if curve else (0, 0, 0.0, 0.0)
        solved = n_ep >= 100 and mean100 >= cfg.target_return
        print(f"online_dqn: {'SOLVED' if solved else 'stopped'} after {steps} env steps, {n_ep} episodes, "
              f"{updates} updates, {wall:.1f} s: mean return of the last 100 episodes {mean100:.1f}", flush=True)
        last = returns[-20:]
        print(f"RESULT episodes={n_ep} env_steps={steps} mean100={mean100:.1f} "
              f"last20={np.mean(last) if last else 0.0:.1f}", flush=True)
        if cfg.plot:
            save_plot(cfg.plot, curve, returns, steps)
    dist.destroy_process_group()
    return 0


def save_plot(path, curve, returns, steps):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("online_dqn: matplotlib is not installed; no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [c[0] for c in curve]
    ax.plot(xs, [c[2] for c in curve], label="mean return, last 100 episodes")
    ax.axhline(SOLVED, color="gray", ls="--", lw=1, label=f"solved ({SOLVED:.0f})")
    ax.set_xlabel("environment steps")
    ax.set_ylabel("return")
    ax.set_title("online DQN on CartPole-v1: 2 learners (DDP) x 2 actors, gear_mpi replay")
    ax.legend(loc="lower right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"online_dqn: plot saved to {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
