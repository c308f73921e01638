#!/usr/bin/env python
"""SB3's DQN on CartPole-v1 with rl-baselines3-zoo's tuned hyperparameters, trained with SB3's own
``ReplayBuffer`` and with gear_mpi's ``GearReplayBuffer``, seed by seed: final return and time of each.

The hyperparameters are rl-baselines3-zoo's ``hyperparams/dqn.yml`` entry for CartPole-v1 (:data:`ZOO`):
5e4 steps, learning rate 2.3e-3, batch 64, buffer 1e5, learning starts 1000, gamma 0.99, target update
every 10 steps, train every 256 steps with 128 gradient steps, exploration fraction 0.16 down to 0.04,
an MLP of [256, 256]. Each run is a process of its own (so that one run's threads and caches do not
carry into the next), the two buffers alternating within each seed; the evaluation is SB3's
``evaluate_policy`` over ``--eval-episodes`` deterministic episodes of a fresh environment seeded apart.
Printed per run: buffer, seed, mean and std of the final evaluation's return, the mean of the last five
10-episode evaluations of the learning curve (every ``--eval-every`` steps: DQN's greedy policy on
CartPole swings from one evaluation to the next, so one final figure says little), wall time of ``learn``
and the process's CPU time over it (evaluations taken out), and the curve; then, per buffer, the means,
and the ratio of gear_mpi's wall time to SB3's.

    python -m scripts.bench.bench_sb3_dqn                     # seeds 0 1 2, 5e4 steps each (minutes)
    python -m scripts.bench.bench_sb3_dqn --steps 3000 --seeds 0 --eval-episodes 2   # a smoke run
    python -m scripts.bench.bench_sb3_dqn --json              # one JSON object per run
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ZOO = dict(learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1000, gamma=0.99,
           target_update_interval=10, train_freq=256, gradient_steps=128, exploration_fraction=0.16,
           exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]))
ZOO_STEPS = 50_000
BUFFERS = ("sb3", "gear")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def one_run(buffer: str, seed: int, steps: int, eval_episodes: int, eval_every: int) -> dict:
    """Train and evaluate one DQN in this process; returns the row. Every ``eval_every`` steps a callback
    evaluates the greedy policy over 10 episodes (its time is taken out of the wall and CPU times)."""
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback
    from stable_baselines3.common.evaluation import evaluate_policy

    class Curve(BaseCallback):
        def __init__(self):
            super().__init__()
            self.points, self.wall, self.cpu = [], 0.0, 0.0
            self.env = gym.make("CartPole-v1")
            self.env.reset(seed=20_000 + seed)

        def _on_step(self) -> bool:
            if eval_every and self.num_timesteps % eval_every == 0:
                wall, cpu = time.perf_counter(), time.process_time()
                mean, _ = evaluate_policy(self.model, self.env, n_eval_episodes=10, deterministic=True)
                self.points.append((self.num_timesteps, float(mean)))
                self.wall += time.perf_counter() - wall
                self.cpu += time.process_time() - cpu
            return True

    kwargs = dict(ZOO)
    if buffer == "gear":
        from gear_mpi.integrations.sb3 import GearReplayBuffer
        kwargs["replay_buffer_class"] = GearReplayBuffer
    model = DQN("MlpPolicy", "CartPole-v1", seed=seed, device="cpu", verbose=0, **kwargs)
    curve = Curve()
    wall, cpu = time.perf_counter(), time.process_time()
    model.learn(total_timesteps=steps, callback=curve)
    wall, cpu = time.perf_counter() - wall - curve.wall, time.process_time() - cpu - curve.cpu
    env = gym.make("CartPole-v1")
    env.reset(seed=10_000 + seed)
    mean, std = evaluate_policy(model, env, n_eval_episodes=eval_episodes, deterministic=True)
    last = [r for _, r in curve.points[-5:]]
    return {"buffer": buffer, "seed": seed, "steps": steps, "return_mean": float(mean), "return_std": float(std),
            "last5_mean": float(np.mean(last)) if last else None, "curve": curve.points,
            "wall_s": wall, "cpu_s": cpu, "torch_threads": torch.get_num_threads(),
            "buffer_class": type(model.replay_buffer).__name__, "numpy": np.__version__}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=ZOO_STEPS, help=f"environment steps per run (zoo: {ZOO_STEPS})")
    ap.add_argument("--eval-episodes", type=int, default=20, help="episodes of the final evaluation")
    ap.add_argument("--eval-every", type=int, default=5000,
                    help="steps between the 10-episode evaluations of the learning curve (0: none)")
    ap.add_argument("--buffers", nargs="+", choices=BUFFERS, default=list(BUFFERS))
    ap.add_argument("--json", action="store_true", help="one JSON object per run")
    ap.add_argument("--one", choices=BUFFERS, help=argparse.SUPPRESS)  # a child: run one and print its row
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one, args.seeds[0], args.steps, args.eval_episodes, args.eval_every)),
              flush=True)
        return 0
    rows = []
    if not args.json:
        print(f"# SB3 DQN, CartPole-v1, rl-zoo hyperparameters, {args.steps} steps, evaluation over "
              f"{args.eval_episodes} deterministic episodes; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}",
              flush=True)
        print(f"#{'buffer':>7} {'seed':>4} {'return':>8} {'std':>6} {'last5':>7} {'wall_s':>7} {'cpu_s':>7}  "
              f"curve (10-episode means every {args.eval_every} steps)", flush=True)
    for i, seed in enumerate(args.seeds):
        order = args.buffers if i % 2 == 0 else list(reversed(args.buffers))  # alternate who runs first
        for buffer in order:
            cmd = [sys.executable, "-m", "scripts.bench.bench_sb3_dqn", "--one", buffer, "--seeds", str(seed),
                   "--steps", str(args.steps), "--eval-episodes", str(args.eval_episodes),
                   "--eval-every", str(args.eval_every)]
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                return proc.returncode
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            if args.json:
                print(json.dumps(row), flush=True)
            else:
                last5 = "-" if row["last5_mean"] is None else f"{row['last5_mean']:.1f}"
                print(f" {buffer:>7} {seed:>4} {row['return_mean']:8.1f} {row['return_std']:6.1f} {last5:>7} "
                      f"{row['wall_s']:7.1f} {row['cpu_s']:7.1f}  {' '.join(f'{r:.0f}' for _, r in row['curve'])}",
                      flush=True)
    if not args.json:
        means = {}
        for b in args.buffers:
            mine = [r for r in rows if r["buffer"] == b]
            means[b] = {k: sum(r[k] or 0 for r in mine) / len(mine)
                        for k in ("return_mean", "last5_mean", "wall_s", "cpu_s")}
            print(f"# {b}: mean final return {means[b]['return_mean']:.1f}, mean of the last 5 evaluations "
                  f"{means[b]['last5_mean']:.1f}, mean wall {means[b]['wall_s']:.1f} s, "
                  f"mean CPU {means[b]['cpu_s']:.1f} s", flush=True)
        if set(BUFFERS) <= set(means):
            print(f"# wall time gear / sb3: {means['gear']['wall_s'] / means['sb3']['wall_s']:.3f} "
                  f"(target <= 1.2)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
