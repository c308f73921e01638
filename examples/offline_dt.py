"""Offline decision transformer on CartPole-v1: a mixed-quality dataset in gear_mpi, DDP over MPI ranks.

    mpiexec -n 2 python -m mpi4py examples/offline_dt.py            # the full run (a few minutes), and its plot
    mpiexec -n 2 python -m mpi4py examples/offline_dt.py --quick    # about 40 s (the CI test runs it)

The dataset goes through the dataset tools: rank 0 writes a D4RL-layout HDF5 file with
``scripts/data/make_dataset.py`` (``--set dataset_steps=N`` steps of CartPole-v1 under a scripted
controller whose actions are replaced by uniform random ones with probability ``eps``, the
episodes cycling through the noise levels, by default 0, 0.25, 0.5, 0.65, 0.8, 1, so the episode
returns range from about 10 to 500), adds ``infos/rtg`` (each step's return-to-go, per episode:
D4RL files carry rewards only), and every rank loads its share of the episodes with
``gm.datasets.from_d4rl(path, comm, columns=...)``: one trajectory per episode, columns
``observations`` [4], ``actions``, ``infos/rtg`` and ``infos/episode_step`` (the timestep). The
file is a temporary one, removed at the end, unless ``--dataset PATH`` names one (made there if
missing, else reused; any D4RL-layout CartPole file with ``infos/episode_step`` will do).

The model: a decision transformer (Chen et al. 2021): tokens (return-to-go, state, action) per
step, a timestep embedding added to each, a causal transformer (by default 3 layers, 64 dims, 4
heads, context 20 steps = 60 tokens), the action predicted from each state token with a
cross-entropy loss over the real steps of the window (the batch's ``mask``: an episode shorter
than the context is padded at the end).

Training: every rank samples ``--batch`` windows of ``context`` steps (``align="random"``) from
the whole replay through ``replay.batches(batch, window, prefetch=2)`` -- the next batches are
selected and exchanged by a background thread while the step runs -- and the ranks train one
model with torch DDP (gloo, from the MPI ranks and a free port agreed over MPI). The sampler is
``--sampler length`` (default: ``Prioritized(alpha=1, beta=0)`` with each episode's length as
its priority, so every step of the dataset is equally likely to be in a window, as in the
reference implementation) or ``--sampler uniform`` (every episode equally likely).

Evaluation: the model acts greedily in CartPole-v1 (seeds unseen in the dataset), conditioned on
the dataset's best return as the target; the episodes are shared among the ranks. The run prints
the dataset's mean and best episode return, the training loss as it goes, the evaluation returns
(every ``eval_every`` steps, and ``eval_episodes`` episodes at the end), a ``RESULT`` json line,
and saves a plot of the loss and the evaluation return (docs/img/offline_dt.png).
"""
from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy: the ranks share few cores

import argparse
import dataclasses
import json
import sys
import time

import numpy as np

OBS_DIM, N_ACTIONS = 4, 2
MAX_STEPS = 500  # CartPole-v1's time limit: the longest episode, and the timestep embedding's size
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # scripts.data.make_dataset, when run as ``python examples/offline_dt.py``
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "img", "offline_dt.png")


@dataclasses.dataclass
class Config:
    """Everything a run uses; the command line sets a few (see :func:`parse_config`)."""

    dataset_steps: int = 21000       # dataset steps (CartPole-v1: about 95 episodes at these noise levels)
    dataset: str = ""                # the HDF5 file ("": a temporary one for the run)
    noise: str = "0,0.25,0.5,0.65,0.8,1"  # the eps levels (probability of a random action), cycled over episodes
    sampler: str = "length"          # "length": Prioritized(1, 0), priority = episode length; "uniform"
    context: int = 20                # steps per window (the transformer sees 3 tokens per step)
    embed: int = 64
    layers: int = 3
    heads: int = 4
    dropout: float = 0.1
    batch: int = 64                  # windows per rank per step
    steps: int = 2000                # training steps
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup: int = 100                # steps of linear learning-rate warm-up
    grad_clip: float = 0.25
    rtg_scale: float = float(MAX_STEPS)  # returns-to-go are divided by this
    eval_every: int = 250            # steps between curve evaluations (0: none)
    eval_curve_episodes: int = 4     # episodes per curve evaluation, whole job
    eval_episodes: int = 20          # episodes of the final evaluation, whole job
    max_seconds: float = 900.0       # wall-time budget of the training loop
    log_every: float = 5.0           # seconds between loss lines
    seed: int = 0
    plot: str | None = DEFAULT_PLOT
    quick: bool = False

    def levels(self) -> list[float]:
        return [float(x) for x in self.noise.split(",")]


def parse_config(argv=None) -> Config:
    """The run's :class:`Config` from the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the CI version: 2 layers, 100 steps, 4 evaluation episodes, no plot unless --plot")
    p.add_argument("--sampler", choices=("length", "uniform"), help="how episodes are drawn (default length)")
    p.add_argument("--steps", type=int, help="training steps (default 2000)")
    p.add_argument("--seed", type=int, help="seed of the dataset, the model and the replay (default 0)")
    p.add_argument("--dataset", help="the D4RL-layout HDF5 file: reused if it exists, else made there "
                                     "(default: a temporary file, removed at the end)")
    p.add_argument("--plot", help=f"save loss and evaluation return here (default {os.path.normpath(DEFAULT_PLOT)}; "
                                  f"'' for none)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override any Config field, e.g. --set lr=5e-4 (repeatable)")
    args = p.parse_args(argv)
    cfg = Config()
    if args.quick:
        cfg.quick, cfg.layers, cfg.steps, cfg.warmup, cfg.plot = True, 2, 100, 20, None
        cfg.eval_every, cfg.eval_episodes, cfg.max_seconds = 0, 4, 150.0
    for name in ("sampler", "steps", "seed", "plot", "dataset"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    fields = {f.name: f.type for f in dataclasses.fields(Config)}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in fields or not value:
            p.error(f"--set {item}: expected NAME=VALUE with NAME one of {sorted(fields)}")
        kind = {"int": int, "float": float, "bool": lambda v: v.lower() in ("1", "true", "yes")}.get(fields[name], str)
        setattr(cfg, name, kind(value))
    if cfg.steps < 10 or cfg.dataset_steps < MAX_STEPS or cfg.context < 1:
        p.error(f"need steps >= 10, dataset_steps >= {MAX_STEPS}, context >= 1")
    cfg.plot = cfg.plot or None
    return cfg


# ---- the dataset ---------------------------------------------------------------------------------------

def make_file(cfg: Config, path: str) -> None:
    """Write the dataset to ``path`` (D4RL layout, through a temporary name) with ``infos/rtg`` added."""
    import h5py
    from gear_mpi.datasets import split_episodes
    from scripts.data.make_dataset import make_dataset

    tmp = f"{path}.{os.getpid()}.part"
    make_dataset(tmp, "CartPole-v1", steps=cfg.dataset_steps, noise=tuple(cfg.levels()), seed=cfg.seed)
    with h5py.File(tmp, "a") as f:
        rew = f["rewards"][:].astype(np.float64)
        starts, lengths, _ = split_episodes(f["terminals"][:], f["timeouts"][:])
        rtg = np.empty(len(rew), np.float32)
        for a, n in zip(starts, lengths):  # the return from each step to its episode's end
            rtg[a:a + n] = np.cumsum(rew[a:a + n][::-1])[::-1]
        f.create_dataset("infos/rtg", data=rtg)
    os.replace(tmp, path)


def describe(path: str, levels: list[float]) -> dict:
    """The dataset's returns (closed episodes; mean, best, min and mean by noise level), episode lengths
    (every episode, in file order) and the observations' mean and standard deviation."""
    import h5py
    from gear_mpi.datasets import split_episodes

    with h5py.File(path, "r") as f:
        rew, obs, noise = f["rewards"][:], f["observations"][:].astype(np.float64), f["infos/noise"][:]
        starts, lengths, open_last = split_episodes(f["terminals"][:], f["timeouts"][:])
    closed = slice(0, len(starts) - int(open_last))
    rets = np.add.reduceat(rew.astype(np.float64), starts)[closed]
    lv = noise[starts][closed]
    return {"returns": rets, "lengths": lengths, "steps": len(rew), "open_last": open_last,
            "by_level": {str(x): round(float(rets[np.isclose(lv, x)].mean()), 1) for x in levels
                         if np.isclose(lv, x).any()},
            "mean": obs.mean(0).astype(np.float32),
            "std": np.sqrt(np.maximum(obs.var(0), 1e-6)).astype(np.float32)}


# ---- the model -----------------------------------------------------------------------------------------

def build_model(cfg: Config):
    """The decision transformer (a torch module)."""
    import torch
    import torch.nn as nn

    class DecisionTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg.embed
            self.embed_t = nn.Embedding(MAX_STEPS, d)
            self.embed_r = nn.Linear(1, d)
            self.embed_s = nn.Linear(OBS_DIM, d)
            self.embed_a = nn.Embedding(N_ACTIONS, d)
            self.norm = nn.LayerNorm(d)
            layer = nn.TransformerEncoderLayer(d, cfg.heads, 4 * d, cfg.dropout, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(layer, cfg.layers, enable_nested_tensor=False)
            self.head = nn.Sequential(nn.LayerNorm(d), nn.Linear(d, N_ACTIONS))
            n = 3 * cfg.context
            self.register_buffer("causal", torch.triu(torch.full((n, n), float("-inf")), 1), persistent=False)

        def forward(self, rtg, obs, action, timestep):
            """Action logits ``[B, W, N_ACTIONS]``: position ``i`` from the tokens up to state ``i``.

            Args: rtg ``[B, W]`` (scaled), obs ``[B, W, 4]`` (normalised), action ``[B, W]`` int64,
            timestep ``[B, W]`` int64.
            """
            b, w = rtg.shape
            t = self.embed_t(timestep)
            tokens = torch.stack([self.embed_r(rtg[..., None]) + t, self.embed_s(obs) + t,
                                  self.embed_a(action) + t], dim=2).reshape(b, 3 * w, -1)
            h = self.blocks(self.norm(tokens), mask=self.causal[:3 * w, :3 * w], is_causal=True)
            return self.head(h[:, 1::3])  # the state tokens: they see R_t, s_t and everything before

    return DecisionTransformer()


def evaluate(model, cfg: Config, target: float, seeds: list[int], mean: np.ndarray, std: np.ndarray) -> list[float]:
    """Returns of greedy episodes of ``model`` in CartPole-v1, conditioned on ``target``, one per seed."""
    import gymnasium as gym
    import torch

    env = gym.make("CartPole-v1")
    c = cfg.context
    out = []
    model.eval()
    with torch.no_grad():
        for seed in seeds:
            obs_h = np.zeros((MAX_STEPS, OBS_DIM), np.float32)
            act_h = np.zeros(MAX_STEPS, np.int64)
            rtg_h = np.zeros(MAX_STEPS, np.float32)
            obs, _ = env.reset(seed=seed)
            togo, ret = target, 0.0
            for t in range(MAX_STEPS):
                obs_h[t], rtg_h[t] = (obs - mean) / std, togo / cfg.rtg_scale
                lo = max(0, t + 1 - c)
                logits = model(torch.from_numpy(rtg_h[None, lo:t + 1]), torch.from_numpy(obs_h[None, lo:t + 1]),
                               torch.from_numpy(act_h[None, lo:t + 1]),
                               torch.arange(lo, t + 1)[None])  # the current action (0 here) is never seen
                act_h[t] = int(logits[0, -1].argmax())
                obs, reward, terminated, truncated, _ = env.step(int(act_h[t]))
                ret += reward
                togo -= reward
                if terminated or truncated:
                    break
            out.append(ret)
    model.train()
    env.close()
    return out


# ---- the run -------------------------------------------------------------------------------------------

def run(cfg: Config) -> dict:
    """Make and load the dataset, train and evaluate on every rank of ``MPI.COMM_WORLD``; returns the run's
    figures (on every rank)."""
    from mpi4py import MPI
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import gear_mpi as gm

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    t0 = time.time()
    torch.manual_seed(cfg.seed)
    gm.init_torch_process_group(world, "gloo")  # DDP's gloo group, its address agreed over MPI
    import torch.distributed as dist

    # the dataset: a D4RL-layout file made by rank 0 (or given), each rank loading its share of the episodes
    levels = cfg.levels()
    path, tmpdir, err, info = cfg.dataset, None, None, None
    if rank == 0:
        try:
            if not path:
                import tempfile
                tmpdir = tempfile.mkdtemp(prefix="gear_mpi_offline_dt_")  # /tmp: seen by both "hosts" too
                path = os.path.join(tmpdir, "cartpole-mixed.hdf5")
            if not os.path.exists(path):
                make_file(cfg, path)
            info = describe(path, levels)
        except Exception as e:  # noqa: BLE001 -- raised on every rank below
            err, info = repr(e), None
    path, info, err = world.bcast((path, info, err), 0)
    if err:
        raise RuntimeError(f"offline_dt: the dataset could not be made or read on rank 0: {err}")
    rets, mean, std = info["returns"], info["mean"], info["std"]
    dataset_mean, dataset_best, by_level = float(rets.mean()), float(rets.max()), info["by_level"]
    sampler = gm.Prioritized(1.0, 0.0) if cfg.sampler == "length" else gm.Uniform()
    learners = world.Dup()  # the replay's collectives run on the prefetch thread: a communicator of their own
    replay = gm.datasets.from_d4rl(path, learners, columns=["observations", "actions", "infos/rtg",
                                                            "infos/episode_step"],
                                   max_length=MAX_STEPS, sampler=sampler, seed=cfg.seed)
    loaded = replay.dataset_info
    if cfg.sampler == "length":  # each episode's length as its priority: every step equally likely
        mine = info["lengths"][loaded["first_episode"]:loaded["first_episode"] + len(loaded["episode_keys"])]
        replay.update_priorities(loaded["episode_keys"], mine.astype(np.float64))
    world.Barrier()  # loaded on every rank: a temporary file is no longer needed
    if tmpdir is not None:
        import shutil
        shutil.rmtree(tmpdir, ignore_errors=True)
    total_steps = loaded["steps"]
    segments = world.allgather(replay.shard.shm_name)
    gen_s = time.time() - t0
    if rank == 0:
        print(f"offline_dt: {size} ranks; dataset: {loaded['episodes']} CartPole-v1 episodes, {total_steps} steps "
              f"({path if cfg.dataset else 'a temporary file'}, gm.datasets.from_d4rl), noise levels {levels}: "
              f"return mean {dataset_mean:.1f}, best {dataset_best:g}, min {rets.min():g} over the {len(rets)} "
              f"ended episodes; mean by level {by_level} ({gen_s:.1f} s)", flush=True)

    model = build_model(cfg)
    ddp = nn.parallel.DistributedDataParallel(model)  # broadcasts rank 0's initial weights
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / cfg.warmup))
    n_params = sum(p.numel() for p in model.parameters())
    mean_t, std_t = torch.from_numpy(mean), torch.from_numpy(std)
    if rank == 0:
        print(f"offline_dt: decision transformer, {cfg.layers} layers x {cfg.embed} dims x {cfg.heads} heads, "
              f"context {cfg.context}, {n_params} parameters; {cfg.batch} windows per rank per step, sampler "
              f"{sampler!r}; {cfg.steps} steps, target return {dataset_best:g}", flush=True)
        print(f"{'step':>6} {'loss':>7} {'eval':>7} {'wall_s':>7}", flush=True)

    def eval_seeds(count: int, base: int) -> list[int]:  # seeds unseen in the dataset, shared among the ranks
        return [10_000_000 + base + i for i in range(rank, count, size)]

    losses: list[float] = []
    curve: list[tuple[int, float, float]] = []  # (step, mean evaluation return, wall s)
    train_s = wall = 0.0
    t1 = next_log = time.time()
    step = 0
    if cfg.eval_every:  # the untrained model, for the curve's first point
        got = world.allgather(evaluate(model, cfg, dataset_best, eval_seeds(cfg.eval_curve_episodes, 0), mean, std))
        curve.append((0, float(np.mean([x for r in got for x in r])), 0.0))
        if rank == 0:
            print(f"{0:>6} {'':>7} {curve[-1][1]:>7.1f} {0.0:>7.1f}", flush=True)
    with replay.batches(cfg.batch, window=cfg.context, align="random", prefetch=2, limit=cfg.steps) as it:
        for batch in it:
            step += 1
            mask = batch.mask
            obs = (batch["observations"] - mean_t) / std_t
            rtg = batch["infos/rtg"] / cfg.rtg_scale
            action, timestep = batch["actions"].long(), batch["infos/episode_step"].long()
            logits = ddp(rtg, obs, action, timestep)
            loss = F.cross_entropy(logits[mask], action[mask])
            opt.zero_grad()
            loss.backward()  # DDP averages the gradients over the ranks
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            sched.step()
            losses.append(loss.item())
            ev = ""
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                got = world.allgather(evaluate(model, cfg, dataset_best, eval_seeds(cfg.eval_curve_episodes,
                                                                                    1000 * step), mean, std))
                curve.append((step, float(np.mean([x for r in got for x in r])), time.time() - t1))
                ev = f"{curve[-1][1]:.1f}"
            wall = world.bcast(time.time() - t1, 0)  # the same stop decision on every rank
            if rank == 0 and (time.time() >= next_log or ev):
                next_log = time.time() + cfg.log_every
                recent = float(np.mean(losses[-50:]))
                print(f"{step:>6} {recent:>7.4f} {ev:>7} {wall:>7.1f}", flush=True)
            if wall >= cfg.max_seconds:
                break  # leaving the with block closes the iterator on every rank
    train_s = time.time() - t1
    steps_done = world.allreduce(step, op=MPI.MIN)
    final = world.allgather(evaluate(model, cfg, dataset_best, eval_seeds(cfg.eval_episodes, 0), mean, std))
    final = [x for r in final for x in r]
    curve.append((steps_done, float(np.mean(final)), time.time() - t1))
    stats = replay.stats()["total"]
    replay.close()
    learners.Free()
    dist.destroy_process_group()

    all_losses = np.mean(np.array(world.allgather(losses[:steps_done])), axis=0)  # the ranks' mean, per step
    k = max(1, steps_done // 10)
    first, last = float(all_losses[:k].mean()), float(all_losses[-k:].mean())
    return {"steps": steps_done, "train_s": round(train_s, 1), "data_s": round(gen_s, 1),
            "dataset_episodes": int(loaded["episodes"]), "dataset_ended_episodes": len(rets),
            "dataset_steps": int(total_steps),
            "dataset_mean_return": round(dataset_mean, 1), "dataset_best_return": dataset_best,
            "dataset_mean_by_noise": by_level, "target_return": dataset_best,
            "eval_episodes": len(final), "eval_mean_return": round(float(np.mean(final)), 1),
            "eval_min_return": float(np.min(final)), "eval_returns": final,
            "loss_first10": round(first, 4), "loss_last10": round(last, 4),
            "loss_ratio": round(last / first, 3), "sampled": int(stats.get("sampled", -1)),
            "sampler": cfg.sampler, "model": [cfg.layers, cfg.embed, cfg.heads, cfg.context, n_params],
            "segments": segments, "curve": curve, "losses": [round(float(x), 5) for x in all_losses]}


def save_plot(path: str, result: dict, ranks: int) -> None:
    """Training loss vs step, and evaluation return vs step against the dataset's mean and best; needs
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("offline_dt: matplotlib is not installed; no plot", flush=True)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    losses = np.array(result["losses"])
    steps = np.arange(1, len(losses) + 1)
    ax1.plot(steps, losses, color="tab:blue", alpha=0.3, lw=0.8, label="per step (mean of the ranks)")
    w = min(50, len(losses))
    ax1.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, mode="valid"), color="tab:blue",
             label=f"mean of {w} steps")
    ax1.set_xlabel("training step")
    ax1.set_ylabel("action cross-entropy")
    ax1.set_title("training loss", fontsize=10)
    ax1.legend(fontsize=8)
    curve = result["curve"]
    ax2.plot([c[0] for c in curve], [c[1] for c in curve], "o-", color="tab:red",
             label=f"decision transformer, target {result['target_return']:g} (last point: "
                   f"{result['eval_episodes']} episodes)")
    ax2.axhline(result["dataset_mean_return"], color="gray", ls="--", lw=1,
                label=f"dataset mean ({result['dataset_mean_return']:g})")
    ax2.axhline(result["dataset_best_return"], color="black", ls=":", lw=1,
                label=f"dataset best ({result['dataset_best_return']:g})")
    ax2.set_xlabel("training step")
    ax2.set_ylabel("evaluation return")
    ax2.set_ylim(0, 540)
    ax2.set_title("CartPole-v1 return", fontsize=10)
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"offline decision transformer, {result['dataset_episodes']} mixed-quality episodes in gear_mpi, "
                 f"{ranks} DDP ranks, replay.batches(prefetch=2)", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"offline_dt: plot saved to {os.path.normpath(path)}", flush=True)


def main(argv=None) -> int:
    cfg = parse_config(argv)
    result = run(cfg)
    from mpi4py import MPI
    if MPI.COMM_WORLD.rank == 0:
        print(f"offline_dt: {result['steps']} steps in {result['train_s']} s: loss {result['loss_first10']} "
              f"(first 10%) -> {result['loss_last10']} (last 10%); evaluation conditioned on "
              f"{result['target_return']:g}: mean return {result['eval_mean_return']} over "
              f"{result['eval_episodes']} episodes (min {result['eval_min_return']:g}); dataset mean "
              f"{result['dataset_mean_return']}, best {result['dataset_best_return']:g}", flush=True)
        summary = {k: v for k, v in result.items() if k not in ("curve", "losses")}
        print("RESULT " + json.dumps(summary), flush=True)
        if cfg.plot:
            save_plot(cfg.plot, result, MPI.COMM_WORLD.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
