"""Online DQN on CartPole-v1: actor processes write into gear_mpi shards, DDP learners sample them.

    mpiexec -n 2 python -m mpi4py examples/online_dqn.py            # until solved, or the step budget
    mpiexec -n 2 python -m mpi4py examples/online_dqn.py --quick    # 64 hidden units, about a minute (the CI test runs it)

Each MPI rank is a learner. It owns one shard of a prioritized :class:`gear_mpi.Replay` with a
:class:`gear_mpi.SampleToInsertRatio` rate limiter, and spawns ``--actors`` processes
(multiprocessing "spawn"; they never import mpi4py). An actor steps CartPole-v1 epsilon-greedily
with the latest policy, which its learner publishes into a shared-memory block (a flat float32
parameter vector under a version counter, read as a seqlock; the actor evaluates the small MLP with
numpy and refreshes it at every episode start), and writes every transition through
``gm.Writer(replay.writer_address())``.

Items are one-step transitions ``{obs, action, reward, next_obs, done}`` (an ``append`` and an
``end_episode`` per environment step: trajectories of length 1). So priorities are per transition,
as in prioritized replay (Schaul et al.) -- a whole-episode item would share one priority among all
its steps -- and the rate limiter, which counts items, counts environment steps: ``samples_per_insert``
is the classic replay ratio (windows sampled per environment step, over the whole job).

The learners train one Q-network with torch DDP (gloo, initialised from the MPI ranks and a free
port agreed over MPI): each update samples ``--batch`` windows per rank from the whole replay,
takes a double-DQN step with importance weights and a target network, and sends ``|TD error|``
back as the new priorities. ``done`` is set on termination only (a time-limit truncation at 500
steps bootstraps). The recipe follows rl-baselines3-zoo's tuned DQN for CartPole-v1 (Adam at
2.3e-3, a 256x256 MLP, epsilon from 1 to 0.04 over the first 8,000 environment steps, 1,000
transitions before the first update, gradient norm clipped at 10) and its replay ratio: 32 windows
sampled per environment step (zoo: 128 gradient steps of 64 per 256 steps), here 64 per rank per
update, one update per 4 environment steps, the target network copied every 100 updates.

When to stop. CartPole-v1 is solved at a mean return of 475 over 100 consecutive episodes. Every
``eval_every`` (5) seconds the learners play 100 episodes greedily (no exploration; 50 a rank, on
gymnasium's vectorized CartPole-v1, the same dynamics and 500-step limit) with the current network;
the run stops when their mean reaches 475 in ``eval_passes`` (3) evaluations in a row, while training
goes on between them (one lucky network does not count: a greedy policy that happens to balance
the pole early is common on CartPole) -- or when the mean of the last 100 *training* episodes
(epsilon-greedy, by policies of the recent past) reaches 475 -- or at the step or time budget. The curve
-- environment steps, episodes, the training mean of the last 100 episodes, the latest greedy
evaluation, wall time -- is printed as it goes, and a plot of return vs environment steps is saved.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: many small processes share few cores

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import sys
import time
from multiprocessing import shared_memory

import numpy as np

OBS_DIM, N_ACTIONS = 4, 2
SOLVED = 475.0  # CartPole-v1's threshold: mean return over 100 consecutive episodes
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "img", "online_dqn.png")


@dataclasses.dataclass
class Config:
    """Everything a run uses; the command line sets a few (see :func:`parse_config`)."""

    actors: int = 2                  # actor processes per learner rank
    hidden: int = 256                # units of the two hidden layers
    lr: float = 2.3e-3
    gamma: float = 0.99
    batch: int = 64                  # windows sampled per learner rank per update
    capacity: int = 50_000           # transitions each rank's shard holds
    samples_per_insert: float = 32.0  # windows sampled per transition inserted, whole job
    min_size: int = 1000             # transitions in the replay before the first sample
    error_buffer: float = 8192.0     # the limiter's band: +-8192 windows (256 env steps, 64 updates of 128)
    staging_steps: int = 256         # each writer's staging ring: backpressure within 256 steps
    grad_clip: float = 10.0          # max gradient norm (0: none)
    target_every: int = 100          # updates between target-network copies
    publish_every: int = 10          # updates between weight publications to the actors
    eps_start: float = 1.0
    eps_end: float = 0.04
    eps_decay_steps: int = 8_000     # env steps (whole job) of the linear epsilon decay
    alpha: float = 0.6
    beta: float = 0.4
    max_steps: int = 500_000         # env-step budget, whole job
    max_seconds: float = 1200.0      # wall-time budget
    target_return: float = SOLVED
    eval_every: float = 5.0          # seconds between greedy evaluations (0: none)
    eval_episodes: int = 100         # episodes of one greedy evaluation, split over the learner ranks
    eval_passes: int = 3             # consecutive greedy evaluations at target_return that stop the run
    log_every: float = 2.0           # seconds between curve lines
    seed: int = 0
    plot: str | None = DEFAULT_PLOT
    quick: bool = False


def parse_config(argv=None) -> Config:
    """The run's :class:`Config` from the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the CI version: 12000 env steps, 64 hidden units (about a minute), no plot unless --plot")
    p.add_argument("--actors", type=int, help="actor processes per learner rank (default 2)")
    p.add_argument("--max-steps", type=int, help="env-step budget of the whole job (default 500000)")
    p.add_argument("--max-seconds", type=float, help="wall-time budget (default 1200)")
    p.add_argument("--seed", type=int, help="seed of the network, the replay and the actors (default 0)")
    p.add_argument("--plot", help=f"save return vs env steps here (default {os.path.normpath(DEFAULT_PLOT)}; "
                                  f"'' for none)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override any Config field, e.g. --set lr=5e-4 (repeatable)")
    args = p.parse_args(argv)
    cfg = Config()
    if args.quick:
        # a 64x64 network: on CPU a third less time than 256x256 for the same steps, and it learns as well
        cfg.quick, cfg.max_steps, cfg.max_seconds, cfg.hidden, cfg.plot = True, 12_000, 120.0, 64, None
    for name in ("actors", "max_steps", "max_seconds", "seed", "plot"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            p.error(f"--set {item}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(fields[name], str)
        setattr(cfg, name, kind(value))
    if cfg.actors < 1:
        p.error("--actors must be >= 1")
    if cfg.eval_every > 0 and (cfg.eval_episodes < 1 or cfg.eval_passes < 1):
        p.error("eval_episodes and eval_passes must be >= 1 (or eval_every=0: no greedy evaluation)")
    cfg.plot = cfg.plot or None
    return cfg


# ---- the Q-network as a flat float32 vector (actors evaluate it with numpy) --------------------------

def layer_shapes(hidden: int) -> list[tuple[int, ...]]:
    """Parameter shapes in torch's order: W1, b1, W2, b2, W3, b3 of a 4-h-h-2 MLP."""
    return [(hidden, OBS_DIM), (hidden,), (hidden, hidden), (hidden,), (N_ACTIONS, hidden), (N_ACTIONS,)]


def unflatten(flat: np.ndarray, hidden: int) -> list[np.ndarray]:
    """Views of ``flat`` shaped as the layers' parameters."""
    out, at = [], 0
    for shape in layer_shapes(hidden):
        n = math.prod(shape)
        out.append(flat[at:at + n].reshape(shape))
        at += n
    return out


def numpy_q(params: list[np.ndarray], obs: np.ndarray) -> np.ndarray:
    """Q-values of one observation (the torch network's forward pass, in numpy)."""
    w1, b1, w2, b2, w3, b3 = params
    h = np.maximum(w1 @ obs + b1, 0.0)
    h = np.maximum(w2 @ h + b2, 0.0)
    return w3 @ h + b3


class SharedState:
    """The shared-memory block between a learner and its actors (the learner creates and unlinks it).

    Layout: int64 control[8] (0: weights version, a seqlock, odd while being written; 1: stop flag;
    2: float64 bits of the priority of new transitions), float32 params[n], then per actor an int64
    step count, an int64 episode count and a float64 ring of its last RING episode returns.
    """

    RING = 1024

    def __init__(self, n_params: int, actors: int, name: str | None = None):
        self.owner = name is None
        params_end = 64 + 4 * n_params
        params_end += (-params_end) % 8
        size = params_end + 16 * actors + 8 * actors * self.RING
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=size if self.owner else 0)
        buf = self.shm.buf
        self.control = np.ndarray((8,), np.int64, buf, 0)
        self.params = np.ndarray((n_params,), np.float32, buf, 64)
        self.steps = np.ndarray((actors,), np.int64, buf, params_end)
        self.episodes = np.ndarray((actors,), np.int64, buf, params_end + 8 * actors)
        self.returns = np.ndarray((actors, self.RING), np.float64, buf, params_end + 16 * actors)
        if self.owner:
            self.control[:] = 0
            self.steps[:] = 0
            self.episodes[:] = 0
            self.set_priority(1.0)

    @property
    def name(self) -> str:
        return self.shm.name

    def publish(self, flat: np.ndarray) -> None:
        """Write new weights (the learner; readers retry while the version is odd or moves)."""
        self.control[0] += 1
        self.params[:] = flat
        self.control[0] += 1

    def read(self, out: np.ndarray, last: int) -> int:
        """Copy the weights into ``out`` unless their version is still ``last``; returns the version held."""
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
        """Unmap (the learner also unlinks). Idempotent."""
        if self.shm is None:
            return
        self.control = self.params = self.steps = self.episodes = self.returns = None
        self.shm.close()
        if self.owner:
            self.shm.unlink()
        self.shm = None


# ---- actors ------------------------------------------------------------------------------------------

def actor_main(index: int, address: str, state_name: str, n_params: int, cfg: Config, learners: int,
               seed: int, parent: int) -> None:
    """One actor process: CartPole-v1, epsilon-greedy on the latest weights, a transition per step.

    Ends when the learner sets the stop flag, closes its replay (the writer raises WriterError) or dies.
    """
    if "mpi4py" in sys.modules:
        raise RuntimeError("an actor must not import mpi4py")
    import gymnasium as gym
    import gear_mpi as gm

    state = SharedState(n_params, cfg.actors, state_name)
    env = gym.make("CartPole-v1")
    try:
        with gm.Writer(address, timeout=120.0, staging_steps=cfg.staging_steps) as writer:
            rng = np.random.default_rng(seed)
            flat = np.zeros(n_params, np.float32)
            params = unflatten(flat, cfg.hidden)
            version = state.read(flat, -1)
            obs, _ = env.reset(seed=seed)
            ret = 0.0
            while not state.stop:
                job_steps = int(state.steps.sum()) * learners  # this learner's actors, scaled to the job
                eps = cfg.eps_start + min(1.0, job_steps / cfg.eps_decay_steps) * (cfg.eps_end - cfg.eps_start)
                if rng.random() < eps:
                    action = int(rng.integers(N_ACTIONS))
                else:
                    action = int(np.argmax(numpy_q(params, obs)))
                nxt, reward, terminated, truncated, _ = env.step(action)
                writer.append({"obs": obs, "action": np.int64(action), "reward": np.float32(reward),
                               "next_obs": nxt, "done": np.float32(terminated)})
                writer.end_episode(priority=state.priority())  # one item per transition
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
                    if os.getppid() != parent:
                        return  # the learner is gone
    except gm.WriterError:
        if not state.stop:
            raise  # the replay went away while the learner still wanted data
    finally:
        env.close()
        state.close()


# ---- learner -----------------------------------------------------------------------------------------

def greedy_returns(q, env, episodes: int, seed: int) -> list[float]:
    """Returns of ``episodes`` CartPole-v1 episodes played greedily by ``q`` (no exploration), one per env.

    ``env`` is gymnasium's vectorized CartPole-v1 with ``episodes`` copies (the same dynamics and 500-step
    limit); an episode's later auto-resets are ignored. Cost: at most 500 batched forward passes.
    """
    import torch
    if episodes == 0:
        return []
    obs, _ = env.reset(seed=seed)
    ret, ended = np.zeros(episodes), np.zeros(episodes, bool)
    with torch.no_grad():
        while not ended.all():
            action = q(torch.as_tensor(obs, dtype=torch.float32)).argmax(1).numpy()
            obs, reward, terminated, truncated, _ = env.step(action)
            ret += np.where(ended, 0.0, reward)
            ended |= terminated | truncated
    return ret.tolist()


def run(cfg: Config) -> dict:
    """Train on every rank of ``MPI.COMM_WORLD``; returns the run's figures (on every rank)."""
    from mpi4py import MPI
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import gear_mpi as gm

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    torch.manual_seed(cfg.seed)
    gm.init_torch_process_group(comm, "gloo")  # DDP's gloo group, its address agreed over MPI
    import torch.distributed as dist

    def net():
        return nn.Sequential(nn.Linear(OBS_DIM, cfg.hidden), nn.ReLU(), nn.Linear(cfg.hidden, cfg.hidden),
                             nn.ReLU(), nn.Linear(cfg.hidden, N_ACTIONS))

    q = net()
    ddp = nn.parallel.DistributedDataParallel(q)  # broadcasts rank 0's initial weights
    target = net()
    target.load_state_dict(q.state_dict())
    opt = torch.optim.Adam(q.parameters(), lr=cfg.lr)
    n_params = sum(p.numel() for p in q.parameters())

    def flat_weights() -> np.ndarray:
        return torch.nn.utils.parameters_to_vector(q.parameters()).detach().numpy()

    spec = gm.TrajectorySpec({"obs": ((OBS_DIM,), np.float32), "action": ((), np.int64),
                              "reward": ((), np.float32), "next_obs": ((OBS_DIM,), np.float32),
                              "done": ((), np.float32)}, max_length=1)
    limiter = gm.SampleToInsertRatio(cfg.samples_per_insert, cfg.min_size, cfg.error_buffer)
    replay = gm.Replay(spec, cfg.capacity, gm.Prioritized(cfg.alpha, cfg.beta), comm=comm, seed=cfg.seed,
                       rate_limiter=limiter, rate_limit_timeout=120.0)
    state = SharedState(n_params, cfg.actors)
    state.publish(flat_weights())
    ctx = mp.get_context("spawn")
    actors = [ctx.Process(target=actor_main, name=f"actor{rank}.{i}", daemon=True,
                          args=(i, replay.writer_address(), state.name, n_params, cfg, size,
                                cfg.seed * 1000 + rank * 100 + i, os.getpid()))
              for i in range(cfg.actors)]
    episodes: list[tuple[int, float]] = []  # (job env steps when seen, return), in the order gathered
    evals: list[tuple[int, float, float]] = []  # greedy evaluations: (env steps, mean return, wall s)
    my_evals = cfg.eval_episodes // size + (rank < cfg.eval_episodes % size)  # this rank's share
    eval_env = None
    if cfg.eval_every > 0 and my_evals:
        import gymnasium as gym
        eval_env = gym.make_vec("CartPole-v1", num_envs=my_evals, vectorization_mode="vector_entry_point")
    next_eval, stop_reason, eval_seed, solved = cfg.eval_every, "budget", 10**6 + cfg.seed * 10**5, False
    passes = 0  # consecutive greedy evaluations at the target so far
    curve: list[tuple[int, int, float, float]] = []  # (env steps, episodes, mean of the last 100, wall s)
    seen = np.zeros(cfg.actors, np.int64)
    updates, max_priority, steps, mean100, wall, failure = 0, 1.0, 0, 0.0, 0.0, None
    t0 = time.time()
    next_log = cfg.log_every
    if rank == 0:
        print(f"online_dqn: {size} learners x {cfg.actors} actors, CartPole-v1, {limiter!r}; budget "
              f"{cfg.max_steps} env steps / {cfg.max_seconds:g} s; stops at mean return {cfg.target_return:g} (of the "
              f"last 100 training episodes" + (f", or of {cfg.eval_episodes} greedy ones {cfg.eval_passes} times in "
                                               f"a row" if cfg.eval_every > 0 else "") + ")",
              flush=True)
        print(f"{'env_steps':>10} {'episodes':>8} {'mean100':>8} {'greedy':>7} {'updates':>8} {'smp/ins':>7} "
              f"{'wall_s':>7}",
              flush=True)
    try:
        for a in actors:
            a.start()
        done = False
        while not done:
            batch = replay.sample(cfg.batch, window=1)  # waits (draining the writers) as the limiter says
            obs, act, rew = batch["obs"][:, 0], batch["action"][:, 0], batch["reward"][:, 0]
            nxt, term = batch["next_obs"][:, 0], batch["done"][:, 0]
            with torch.no_grad():  # double DQN: the online net picks, the target net values
                best = q(nxt).argmax(1, keepdim=True)
                y = rew + cfg.gamma * (1.0 - term) * target(nxt).gather(1, best).squeeze(1)
            pred = ddp(obs).gather(1, act[:, None]).squeeze(1)
            loss = (batch.weights * F.smooth_l1_loss(pred, y, reduction="none")).mean()
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients over the learners
            if cfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(q.parameters(), cfg.grad_clip)
            opt.step()
            prios = (pred.detach() - y).abs().double().numpy() + 1e-3
            replay.update_priorities(batch.keys, prios)
            max_priority = max(max_priority, float(prios.max()))
            updates += 1
            if updates % cfg.target_every == 0:
                target.load_state_dict(q.state_dict())
            if updates % cfg.publish_every == 0:
                state.publish(flat_weights())
                state.set_priority(max_priority)
            if updates % 20:
                continue
            # the curve: new episodes of every rank's actors, gathered (the same decisions on every rank)
            counts = state.episodes.copy()
            mine = [float(state.returns[i, e % state.RING])
                    for i in range(cfg.actors) for e in range(max(seen[i], counts[i] - state.RING), counts[i])]
            seen[:] = counts
            alive = all(a.is_alive() for a in actors)
            rows = comm.allgather((mine, int(state.steps.sum()), time.time() - t0, alive))
            steps, wall = sum(r[1] for r in rows), rows[0][2]
            if not all(r[3] for r in rows):  # agreed: every rank tears down, then raises
                failure = "an actor process died (see its traceback above)"
                break
            episodes.extend((steps, x) for r in rows for x in r[0])
            recent = [x for _, x in episodes[-100:]]
            mean100 = float(np.mean(recent)) if recent else 0.0
            solved = len(episodes) >= 100 and mean100 >= cfg.target_return
            if solved:
                stop_reason = "training"
            elif cfg.eval_every > 0 and wall >= next_eval:  # the same decision on every rank (rank 0's clock)
                next_eval = wall + cfg.eval_every
                greedy = [x for r in comm.allgather(greedy_returns(q, eval_env, my_evals,
                                                                   eval_seed + len(evals) * cfg.eval_episodes
                                                                   + rank * (my_evals + 1))) for x in r]
                evals.append((steps, float(np.mean(greedy)), wall))
                passes = passes + 1 if evals[-1][1] >= cfg.target_return else 0
                if passes >= cfg.eval_passes:
                    solved, stop_reason = True, "greedy"
            done = solved or steps >= cfg.max_steps or wall >= cfg.max_seconds
            if wall >= next_log or done:
                next_log = wall + cfg.log_every
                curve.append((steps, len(episodes), mean100, wall))
                ratio = replay.stats()["sample_to_insert_ratio"]  # collective: every rank logs alike
                if rank == 0:
                    greedy = f"{evals[-1][1]:>7.1f}" if evals else f"{'-':>7}"
                    print(f"{steps:>10} {len(episodes):>8} {mean100:>8.1f} {greedy} {updates:>8} {ratio:>7.2f} "
                          f"{wall:>7.1f}", flush=True)
        total = replay.stats()["total"]
        actor_steps = comm.allgather(state.steps.tolist())
        segments = comm.allgather([state.name, replay.writer_address()])  # for the test's leak check
    except BaseException:
        # this rank alone: no collective on the way out (python -m mpi4py aborts the job); end the actors
        state.control[1] = 1
        for a in actors:
            if a.pid is not None:  # started
                a.terminate()
                a.join(5)
        state.close()
        raise
    state.control[1] = 1
    replay.close()  # collective; removes the writers' staging; a blocked writer gets WriterError and ends
    for a in actors:
        a.join(30)
        if a.is_alive():
            a.terminate()
            a.join()
    state.close()
    dist.destroy_process_group()
    if eval_env is not None:
        eval_env.close()
    if failure:
        raise RuntimeError(failure)
    last = [x for _, x in episodes[-20:]]
    return {"solved": bool(solved), "solved_by": stop_reason if solved else None, "env_steps": steps,
            "episodes": len(episodes), "mean100": round(mean100, 1),
            "last20": round(float(np.mean(last)) if last else 0.0, 1), "updates": updates,
            "wall_s": round(wall, 1), "inserted": int(total["inserted"]), "sampled": int(total["sampled"]),
            "limiter": [cfg.samples_per_insert, cfg.min_size, cfg.error_buffer], "actor_steps": actor_steps,
            "actor_exitcodes": comm.allgather([a.exitcode for a in actors]), "segments": segments,
            "greedy_mean": round(evals[-1][1], 1) if evals else None, "evals": evals,
            "curve": curve, "episode_returns": episodes}


def save_plot(path: str, result: dict, learners: int, actors: int) -> None:
    """Return vs environment steps (each episode a dot, the mean of the last 100 a line); needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("online_dqn: matplotlib is not installed; no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(7.5, 4))
    eps = result["episode_returns"]
    ax.scatter([s for s, _ in eps], [x for _, x in eps], s=2, alpha=0.25, color="tab:blue", label="episode return")
    curve = result["curve"]
    ax.plot([c[0] for c in curve], [c[2] for c in curve], color="tab:red", label="mean of the last 100 episodes")
    if result["evals"]:
        ax.plot([e[0] for e in result["evals"]], [e[1] for e in result["evals"]], "o", ms=3, color="tab:green",
                label="greedy policy: mean of 100 evaluation episodes")
    ax.axhline(SOLVED, color="gray", ls="--", lw=1, label=f"solved ({SOLVED:g})")
    ax.set_xlabel("environment steps (whole job)")
    ax.set_ylabel("return")
    ax.set_title(f"online DQN, CartPole-v1: {learners} DDP learners x {actors} actors each, gear_mpi replay",
                 fontsize=10)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"online_dqn: plot saved to {os.path.normpath(path)}", flush=True)


def main(argv=None) -> int:
    cfg = parse_config(argv)
    result = run(cfg)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        print(f"online_dqn: {'SOLVED' if result['solved'] else 'stopped'} after {result['env_steps']} env steps, "
              f"{result['episodes']} episodes, {result['updates']} updates, {result['wall_s']} s: mean return of "
              f"the last 100 episodes {result['mean100']}, of the last 20 {result['last20']}; greedy evaluation "
              f"{result['greedy_mean']}" + (f" (solved by the {result['solved_by']} rule)" if result["solved"] else ""),
              flush=True)
        summary = {k: v for k, v in result.items() if k not in ("curve", "episode_returns", "evals")}
        print("RESULT " + json.dumps(summary), flush=True)
        if cfg.plot:
            save_plot(cfg.plot, result, MPI.COMM_WORLD.size, cfg.actors)
    return 0


if __name__ == "__main__":
    sys.exit(main())
