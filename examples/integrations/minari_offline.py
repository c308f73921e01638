"""Behaviour cloning from a Minari dataset, every rank holding its share of the episodes (gm.datasets.from_minari).

    mpiexec -n 2 python -m mpi4py examples/integrations/minari_offline.py --root /tmp/minari

Rank 0 writes a small Minari dataset ``cartpole/noisy-expert-v0`` under ``--root`` if it is not there (minari's
own writer, ``minari.create_dataset_from_buffers``, from CartPole-v1 episodes of a scripted controller whose
actions are random one time in four; any local Minari dataset id or directory can be given with ``--dataset``
instead). Every rank then loads its share of the episodes with ``gm.datasets.from_minari`` (one trajectory per
episode: observations, next_observations, actions, rewards, terminations, truncations), and the ranks train a
small policy by behaviour cloning with torch DDP (gloo, started over MPI): each step, every rank samples 128
steps from the whole replay (a collective draw) and the gradients are averaged. Prints the loss and one
``RESULT`` json line (rank 0). Needs ``pip install gear-mpi[minari]`` (minari 0.5's HDF5 writer also imports
pillow) and gymnasium.
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: the ranks share few cores

import argparse
import json

import numpy as np
import torch
from mpi4py import MPI

import gear_mpi as gm

DATASET = "cartpole/noisy-expert-v0"


def write_dataset(dataset_id: str, episodes: int, seed: int) -> None:
    """CartPole-v1 episodes of a noisy scripted controller, written with minari's own writer."""
    import gymnasium as gym
    import minari
    from minari.data_collector import EpisodeBuffer

    env, rng, buffers = gym.make("CartPole-v1"), np.random.default_rng(seed), []
    for e in range(episodes):
        obs, _ = env.reset(seed=seed + e)
        o, a, r, term, trunc = [obs], [], [], [], []
        while True:
            action = int(obs[2] + 0.5 * obs[3] > 0) if rng.random() > 0.25 else int(rng.integers(2))
            obs, reward, terminated, truncated, _ = env.step(action)
            o.append(obs), a.append(action), r.append(reward), term.append(terminated), trunc.append(truncated)
            if terminated or truncated:
                break
        buffers.append(EpisodeBuffer(id=e, observations=np.stack(o), actions=np.asarray(a), rewards=np.asarray(r),
                                     terminations=np.asarray(term), truncations=np.asarray(trunc)))
    minari.create_dataset_from_buffers(dataset_id, buffers, env="CartPole-v1", algorithm_name="noisy-expert")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", help="the Minari datasets root (default: $MINARI_DATASETS_PATH, else ~/.minari/datasets)")
    p.add_argument("--dataset", default=DATASET, help="a local Minari dataset id or directory")
    p.add_argument("--episodes", type=int, default=40, help="episodes written when the dataset is made")
    p.add_argument("--steps", type=int, default=150, help="training steps")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    if args.root:
        os.environ["MINARI_DATASETS_PATH"] = args.root
    if comm.rank == 0 and args.dataset == DATASET and not gm.datasets.minari_files.datasets_root().joinpath(
            DATASET, "data", "metadata.json").exists():
        write_dataset(DATASET, args.episodes, seed=0)
    comm.Barrier()

    replay = gm.datasets.from_minari(args.dataset, comm, sampler=gm.Uniform(), seed=0)
    info = replay.dataset_info
    if comm.rank == 0:
        print(f"{info['source']}: {info['episodes']} episodes, {info['steps']} steps; rank 0 holds "
              f"{len(info['episode_keys'])} of them", flush=True)

    group = gm.init_torch_process_group(comm, "gloo")
    torch.manual_seed(0)
    policy = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.Tanh(), torch.nn.Linear(64, 2)), process_group=group)
    opt = torch.optim.Adam(policy.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        batch = replay.sample(128, window=1)  # collective: 128 steps for this rank, from every rank's episodes
        obs = batch.data["observations"][:, 0]
        action = batch.data["actions"][:, 0].long()
        loss = torch.nn.functional.cross_entropy(policy(obs), action)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(comm.allreduce(loss.item()) / comm.size)
        if comm.rank == 0 and step % 50 == 0:
            print(f"step {step}: loss {losses[-1]:.3f}", flush=True)
    replay.close()
    torch.distributed.destroy_process_group()

    if comm.rank == 0:
        import minari
        ds = minari.MinariDataset(info["source"])  # minari's own reading of the same directory
        print("RESULT " + json.dumps({"episodes": info["episodes"], "steps": info["steps"],
                                      "episodes_minari": ds.total_episodes, "steps_minari": int(ds.total_steps),
                                      "first_loss": float(np.mean(losses[:10])),
                                      "final_loss": float(np.mean(losses[-10:]))}), flush=True)


if __name__ == "__main__":
    main()
