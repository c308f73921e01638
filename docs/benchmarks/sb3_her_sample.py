"""One HER sample's cost: gear_mpi's GearHerReplayBuffer against SB3's HerReplayBuffer, same transitions.

    python docs/benchmarks/sb3_her_sample.py [--sizes 10000,1000000] [--batch 256] [--reps 200]

Fills both buffers with the same BitFlippingEnv(n_bits=16) transitions (8 environments, episodes of up to 16
steps), then times ``sample(B)`` alternately, one buffer then the other, and prints the median and best of
``--reps`` calls each. SB3's draw lists the drawable transitions at every call (O(buffer) work); the shard's is
O(B log N) over its priority index. Both reward the virtual transitions with the same ``compute_reward`` call.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def fill(buffers, env, transitions: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    obs = env.reset()
    for _ in range(transitions // env.num_envs):
        action = rng.integers(0, env.action_space.n, env.num_envs)
        new_obs, reward, done, infos = env.step(action)
        nxt = {k: v.copy() for k, v in new_obs.items()}
        for i in np.flatnonzero(done):
            for k in nxt:
                nxt[k][i] = infos[i]["terminal_observation"][k]
        for b in buffers:
            b.add({k: v.copy() for k, v in obs.items()}, {k: v.copy() for k, v in nxt.items()}, action, reward,
                  done, infos)
        obs = new_obs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10000,1000000")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    from stable_baselines3 import HerReplayBuffer
    from stable_baselines3.common.env_util import make_vec_env
    from stable_baselines3.common.envs import BitFlippingEnv

    from gear_mpi.integrations.sb3_her import GearHerReplayBuffer
    print(f"{'buffer':>9} {'B':>5}  {'SB3 med/best us':>17}  {'gear_mpi med/best us':>21}  SB3/gear")
    for size in (int(float(s)) for s in args.sizes.split(",")):
        env = make_vec_env(lambda: BitFlippingEnv(n_bits=16, continuous=False), 8, seed=0)
        kw = dict(n_envs=8, device="cpu", n_sampled_goal=4, goal_selection_strategy="future")
        theirs = HerReplayBuffer(size, env.observation_space, env.action_space, env, **kw)
        ours = GearHerReplayBuffer(size, env.observation_space, env.action_space, env, seed=0, **kw)
        fill((theirs, ours), env, size + size // 3)  # wrapped: overwritten episodes are not drawn
        times = {"sb3": [], "gear": []}
        for _ in range(3):  # warm-up
            theirs.sample(args.batch), ours.sample(args.batch)
        for _ in range(args.reps):
            for name, buf in (("sb3", theirs), ("gear", ours)):
                t = time.perf_counter()
                buf.sample(args.batch)
                times[name].append((time.perf_counter() - t) * 1e6)
        med = {k: float(np.median(v)) for k, v in times.items()}
        best = {k: float(np.min(v)) for k, v in times.items()}
        print(f"{size:>9} {args.batch:>5}  {med['sb3']:>8.0f} / {best['sb3']:<6.0f}  {med['gear']:>10.0f} / "
              f"{best['gear']:<8.0f}  {med['sb3'] / med['gear']:.2f}x", flush=True)
        ours.close()


if __name__ == "__main__":
    main()
