"""DQN on CartPole-v1 with TorchRL, its replay a gear_mpi replay sharded over the DDP ranks.

    mpiexec -n 2 python -m mpi4py examples/torchrl_dqn.py            # 50,000 env steps over the job
    mpiexec -n 2 python -m mpi4py examples/torchrl_dqn.py --quick    # 64 hidden units, about 25 s (the CI test runs it)

A TorchRL recipe throughout -- ``GymEnv`` with ``RewardSum``, a ``QValueActor`` over an ``MLP``,
``EGreedyModule`` exploration, TorchRL's ``Collector``, ``DQNLoss`` (double DQN, Huber loss) with a
``HardUpdate`` target network -- whose ``TensorDictReplayBuffer`` is built on
``gear_mpi.integrations.torchrl``: a ``GearStorage`` (each rank's shard), ``GearSampler`` and
``GearWriter``. Each rank runs its own environment and collector and ``rb.extend``s what it collects
into its own shard; ``rb.sample()`` is the collective draw from every rank's shard; the Q-network
is wrapped in torch's ``DistributedDataParallel`` (gloo, started by ``gm.init_torch_process_group``),
so the ranks train one network on the data of all. With ``--per`` the replay is prioritized
(``GearSampler(alpha, beta)``): ``DQNLoss`` writes ``td_error`` into the batch and
``rb.update_tensordict_priority(batch)`` sends each priority to the rank owning the item.

The hyperparameters are rl-zoo's for SB3's DQN on CartPole-v1 (a 256x256 network, Adam at 2.3e-3,
batch 64, 1000 random steps first, epsilon down to 0.04 over the first 16% of the steps, a training
phase after every 256 environment steps of the job), split over the ranks: each rank collects 256/R
steps, then takes 128/R... gradient steps (``--grad-steps``) on its batch of 64, DDP averaging the
gradients; the target network is refreshed at the start of every training phase. At the end every
rank plays ``--eval-episodes`` greedy episodes; rank 0 prints the curve (environment steps, mean
return of the last 20 training episodes) and one ``RESULT {json}`` line.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy and torch: the ranks share few cores

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

RANDOM_RETURN = 22.0  # CartPole-v1 under uniformly random actions


@dataclasses.dataclass
class Config:
    """What a run uses (the command line sets a few; see :func:`parse_config`)."""

    steps: int = 50_000              # environment steps of the whole job
    max_seconds: float = 900.0       # wall-time budget (the ranks stop together)
    frames: int = 256                # environment steps of the job between training phases
    grad_steps: int = 64             # gradient steps per rank per training phase
    batch: int = 64                  # transitions each rank samples per gradient step
    learning_starts: int = 1000      # random steps of the job before training
    capacity: int = 50_000           # transitions each rank's shard holds
    lr: float = 2.3e-3
    gamma: float = 0.99
    hidden: int = 256
    explore_fraction: float = 0.16   # share of the steps over which epsilon falls from 1
    eps_end: float = 0.04
    grad_clip: float = 10.0
    per: bool = False                # prioritized replay (GearSampler(alpha, beta)), priorities from td_error
    alpha: float = 0.6
    beta: float = 0.4
    eval_episodes: int = 10          # greedy episodes per rank at the end
    seed: int = 0
    log_every: float = 5.0           # seconds between curve lines


def parse_config(argv=None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="12,000 steps, 64 hidden units, 3 eval episodes a rank: the CI run")
    p.add_argument("--steps", type=int, help="environment steps of the whole job (default 50000)")
    p.add_argument("--max-seconds", type=float, help="wall-time budget (default 900)")
    p.add_argument("--grad-steps", type=int, help="gradient steps per rank per training phase (default 64)")
    p.add_argument("--hidden", type=int, help="units of the Q-network's two hidden layers (default 256)")
    p.add_argument("--per", action="store_true", help="prioritized replay, priorities routed to their owners")
    p.add_argument("--seed", type=int, help="seed (default 0)")
    a = p.parse_args(argv)
    cfg = Config()
    if a.quick:
        # 12,000 steps take 44-48 s on two idle cores; 150 s leaves room for a loaded CI machine (8,960 steps in
        # 90 s there once, beside the other tests), within the test's 240 s
        cfg.steps, cfg.eval_episodes, cfg.max_seconds, cfg.hidden = 12_000, 3, 150.0, 64  # 64x64: faster on CPU
    for name in ("steps", "max_seconds", "grad_steps", "hidden", "seed"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    cfg.per = cfg.per or a.per
    return cfg


def run(cfg: Config) -> dict:
    import torch
    from mpi4py import MPI
    from tensordict.nn import TensorDictSequential
    from torch.nn.parallel import DistributedDataParallel
    from torchrl.collectors import Collector
    from torchrl.data import TensorDictReplayBuffer
    from torchrl.envs import ExplorationType, GymEnv, RewardSum, TransformedEnv, set_exploration_type
    from torchrl.modules import MLP, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss, HardUpdate

    import gear_mpi as gm
    from gear_mpi.integrations import torchrl as gtrl

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    torch.set_num_threads(1)
    torch.manual_seed(cfg.seed + rank)
    gm.init_torch_process_group(comm, "gloo")  # DDP's group, its address agreed over MPI

    env = TransformedEnv(GymEnv("CartPole-v1"), RewardSum())
    env.set_seed(cfg.seed + 1000 * rank)
    net = DistributedDataParallel(MLP(in_features=4, out_features=2, num_cells=[cfg.hidden, cfg.hidden]))
    actor = QValueActor(net, in_keys=["observation"], spec=env.action_spec)  # DDP gave every rank rank 0's weights
    explore = EGreedyModule(env.action_spec, eps_init=1.0, eps_end=cfg.eps_end,
                            annealing_num_steps=int(cfg.explore_fraction * cfg.steps) // size)
    frames = max(1, cfg.frames // size)
    random_frames = -(-cfg.learning_starts // size // frames) * frames  # a whole number of batches
    collector = Collector(env, TensorDictSequential(actor, explore), frames_per_batch=frames, total_frames=-1,
                          init_random_frames=random_frames, auto_register_policy_transforms=False)
    loss = DQNLoss(actor, loss_function="smooth_l1", delay_value=True, double_dqn=True, action_space=env.action_spec)
    loss.make_value_estimator(gamma=cfg.gamma)
    target = HardUpdate(loss, value_network_update_interval=cfg.grad_steps)
    opt = torch.optim.Adam(loss.parameters(), lr=cfg.lr)

    storage = gtrl.GearStorage(cfg.capacity, seed=cfg.seed, timeout=120.0)
    sampler = gtrl.GearSampler(alpha=cfg.alpha, beta=cfg.beta) if cfg.per else gtrl.GearSampler()
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, writer=gtrl.GearWriter(), batch_size=cfg.batch)

    returns: list[float] = []
    curve: list[tuple[int, float, float]] = []
    steps = updates = 0
    start = last_log = time.time()
    for data in collector:
        data = data.reshape(-1)
        rb.extend(data)  # this rank's shard (the first extend builds the replay: every rank together)
        steps += data.numel()
        explore.step(data.numel())
        done = data["next", "done"].reshape(-1)
        returns += data["next", "episode_reward"].reshape(-1)[done].tolist()
        job_steps = steps * size
        if job_steps >= cfg.learning_starts:
            for _ in range(cfg.grad_steps):
                batch = rb.sample()  # collective: a batch from every rank's shard
                out = loss(batch)
                opt.zero_grad()
                out["loss"].backward()  # DDP averages the gradients over the ranks
                torch.nn.utils.clip_grad_norm_(loss.parameters(), cfg.grad_clip)
                opt.step()
                target.step()
                if cfg.per:
                    rb.update_tensordict_priority(batch)  # collective: each priority to its item's owner
                updates += 1
            collector.update_policy_weights_()
        # stop together: the steps are the same on every rank, the clock is rank 0's
        elapsed = comm.bcast(time.time() - start, root=0)
        if rank == 0 and time.time() - last_log >= cfg.log_every:
            last_log = time.time()
            mean20 = float(np.mean(returns[-20:])) if returns else 0.0
            curve.append((job_steps, mean20, round(elapsed, 1)))
            print(f"torchrl_dqn: {job_steps} env steps, {len(returns)} episodes here, mean return of the last 20 "
                  f"{mean20:.1f}, epsilon {float(explore.eps):.3f}, {elapsed:.0f} s", flush=True)
        if job_steps >= cfg.steps or elapsed >= cfg.max_seconds:
            break
    collector.shutdown()
    train_s = time.time() - start

    eval_returns = []
    with set_exploration_type(ExplorationType.DETERMINISTIC), torch.no_grad():
        for _ in range(cfg.eval_episodes):
            td = env.rollout(500, actor)
            eval_returns.append(float(td["next", "reward"].sum()))
    all_eval = [r for rs in comm.gather(eval_returns, root=0) or [] for r in rs] if rank == 0 else \
        comm.gather(eval_returns, root=0)
    all_train = comm.gather(returns[-20:], root=0)
    checksum = float(sum(p.detach().double().sum() for p in net.parameters()))
    same_weights = len(set(comm.allgather(checksum))) == 1  # DDP kept one network on every rank
    stats = storage.replay.stats()
    storage.close()
    env.close()
    if rank != 0:
        return {}
    train_tail = [r for rs in all_train for r in rs]
    return {"ranks": size, "env_steps": steps * size, "updates": updates, "train_s": round(train_s, 1),
            "eval_mean": round(float(np.mean(all_eval)), 1), "eval_min": round(float(np.min(all_eval)), 1),
            "eval_episodes": len(all_eval), "train_mean20": round(float(np.mean(train_tail)), 1),
            "replay_items": int(stats["total"]["items"]), "items_per_rank": stats["per_rank"]["items"],
            "per": cfg.per, "same_weights": same_weights, "random_return": RANDOM_RETURN, "curve": curve}


def main(argv=None) -> int:
    cfg = parse_config(argv)
    result = run(cfg)
    if result:
        print(f"torchrl_dqn: {result['env_steps']} env steps on {result['ranks']} ranks, {result['updates']} updates "
              f"a rank, {result['train_s']} s: greedy return {result['eval_mean']} (min {result['eval_min']}) over "
              f"{result['eval_episodes']} episodes; random play: about {RANDOM_RETURN:.0f}", flush=True)
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
