"""Offline RL on CartPole-v1 from a learning agent's replay in gear_mpi: a decision transformer against
behaviour cloning and filtered behaviour cloning, trained side by side with DDP over MPI ranks.

    mpiexec -n 2 python -m mpi4py examples/offline_dt.py            # the full run (6.5 min on 2 cores), its plot
    mpiexec -n 2 python -m mpi4py examples/offline_dt.py --quick    # about 30 s (the CI test runs it)

The dataset is one where behaviour cloning on everything is not enough, as D4RL's medium-replay
sets: rank 0 writes a D4RL-layout HDF5 file with ``scripts/data/make_dataset.py --phases``, the
history of a "learning agent" on CartPole-v1 in phases of episodes (``--set phases=...``,
``EPISODES:NOISE:BIAS``): 20 episodes of random actions, then a scripted controller that leans
(its decision value plus a bias of 0.2, 0.15, 0.1 and 0.05, for 30, 40, 40 and 20 episodes, and
a random action with probability 0.2 or 0.1): it holds the pole but pushes right too often and
drives the cart off the track (returns about 80, 115, 145 and 240), and last, until
``dataset_steps`` are written, the unbiased controller without noise (500, the time limit). Most
steps come from the leaning controller, so about 30% of all actions differ from the unbiased
controller's, and in the states the leaning controller visits its action is the common one.
``infos/rtg`` (each step's return-to-go) and ``infos/return`` (its episode's return) are added
(D4RL files carry rewards only), and every rank loads its share of the episodes with
``gm.datasets.from_d4rl(path, comm, columns=...)``, twice: once for all the data, once for
filtered behaviour cloning, whose replay gives the episodes outside the best ones priority 0
(the best episodes by return that hold ``top`` of the steps, by default 10%: they sit on the
last rank, and every rank samples them). The file is a temporary one, removed at the end,
unless ``--dataset PATH`` names one (made there if missing, else reused: a file this example made).

Three models with the same architecture, initial weights, optimiser and steps: a decision
transformer (Chen et al. 2021): tokens (return-to-go, state, action) per step, a timestep
embedding added to each, a causal transformer (by default 3 layers, 64 dims, 4 heads, context 20
steps = 60 tokens), the action predicted from each state token (cross-entropy over the real steps
of the window, the batch's ``mask``); behaviour cloning ("bc"): the same model with the
return-to-go input held at 0, on the same batches; filtered behaviour cloning ("filtered_bc"):
that model on batches of the best episodes only.

Training: every rank samples ``--batch`` windows of ``context`` steps (``align="random"``) from
each replay through ``replay.batches(batch, window, prefetch=2)`` -- the next batches are
selected and exchanged by background threads while the step runs -- and the ranks train each
model with torch DDP (gloo, from the MPI ranks and a free port agreed over MPI). The sampler is
``--sampler length`` (default: ``Prioritized(alpha=1, beta=0)`` with each episode's length as its
priority, so every step is equally likely to be in a window) or ``--sampler uniform`` (every
episode equally likely).

Evaluation: greedy episodes in CartPole-v1 (seeds unseen in the dataset), shared among the ranks:
behaviour cloning, filtered behaviour cloning, and the decision transformer conditioned on each
of ``targets`` (by default 500, the dataset's best; 150, about the leaning controller's; 30, about
the random episodes'): it should follow the target, where the others have one behaviour each. The
run prints the dataset's returns, the training losses as it goes, the evaluation returns (every
``eval_every`` steps, the decision transformer at the first target, and ``eval_episodes`` episodes
each at the end), a ``RESULT`` json line, and saves a plot (docs/img/offline_dt.png).
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
METHODS = ("dt", "bc", "filtered_bc")  # the three models, trained side by side
ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))
if ROOT not in sys.path:
    sys.path.append(ROOT)  # scripts.data.make_dataset, when run as ``python examples/offline_dt.py``
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "docs", "img", "offline_dt.png")


@dataclasses.dataclass
class Config:
    """Everything a run uses; the command line sets a few (see :func:`parse_config`)."""

    dataset_steps: int = 21000       # dataset steps (the last phase, the unbiased controller, fills what is left)
    dataset: str = ""                # the HDF5 file ("": a temporary one for the run)
    phases: str = "20:1:0,30:0.2:0.2,40:0.1:0.15,40:0.1:0.1,20:0.1:0.05,1:0:0"  # EPISODES:NOISE:BIAS, in order
    top: float = 0.1                 # filtered behaviour cloning: the best episodes holding this share of the steps
    targets: str = "500,150,30"      # the decision transformer's evaluation targets (the first also in the curve)
    sampler: str = "length"          # "length": Prioritized(1, 0), priority = episode length; "uniform"
    context: int = 20                # steps per window (the transformer sees 3 tokens per step)
    embed: int = 64
    layers: int = 3
    heads: int = 4
    dropout: float = 0.1
    batch: int = 64                  # windows per rank per step, per replay
    steps: int = 600                 # training steps (each trains the three models)
    lr: float = 1e-3
    weight_decay: float = 1e-4
    warmup: int = 100                # steps of linear learning-rate warm-up
    grad_clip: float = 0.25
    rtg_scale: float = float(MAX_STEPS)  # returns-to-go are divided by this
    eval_every: int = 150            # steps between curve evaluations (0: none)
    eval_curve_episodes: int = 4     # episodes per model per curve evaluation, whole job
    eval_episodes: int = 20          # episodes per model and target in the final evaluation, whole job
    max_seconds: float = 900.0       # wall-time budget of the training loop
    log_every: float = 10.0          # seconds between loss lines
    seed: int = 0
    plot: str | None = DEFAULT_PLOT
    quick: bool = False

    def target_list(self) -> list[float]:
        return [float(x) for x in self.targets.split(",")]


def parse_config(argv=None) -> Config:
    """The run's :class:`Config` from the command line."""
    from scripts.data.make_dataset import parse_phases

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="the CI version: 2 layers, 60 steps, 4 evaluation episodes per model and target, no plot "
                        "unless --plot")
    p.add_argument("--sampler", choices=("length", "uniform"), help="how episodes are drawn (default length)")
    p.add_argument("--steps", type=int, help=f"training steps (default {Config.steps})")
    p.add_argument("--seed", type=int, help="seed of the dataset, the models and the replays (default 0)")
    p.add_argument("--dataset", help="the D4RL-layout HDF5 file: reused if it exists, else made there "
                                     "(default: a temporary file, removed at the end)")
    p.add_argument("--plot", help=f"save losses and evaluation returns here (default "
                                  f"{os.path.normpath(DEFAULT_PLOT)}; '' for none)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="override any Config field, e.g. --set lr=5e-4 (repeatable)")
    args = p.parse_args(argv)
    cfg = Config()
    if args.quick:
        cfg.quick, cfg.layers, cfg.steps, cfg.warmup, cfg.plot = True, 2, 60, 20, None
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
    if cfg.steps < 10 or cfg.dataset_steps < MAX_STEPS or cfg.context < 1 or not 0 < cfg.top <= 1:
        p.error(f"need steps >= 10, dataset_steps >= {MAX_STEPS}, context >= 1, 0 < top <= 1")
    try:
        parse_phases(cfg.phases)
        if not cfg.target_list():
            raise ValueError
    except ValueError as e:
        p.error(f"--set phases / targets: {e or 'expected numbers separated by commas'}")
    cfg.plot = cfg.plot or None
    return cfg


# ---- the dataset ---------------------------------------------------------------------------------------

def make_file(cfg: Config, path: str) -> None:
    """Write the dataset to ``path`` (D4RL layout, through a temporary name) with ``infos/rtg`` and
    ``infos/return`` added."""
    import h5py
    from gear_mpi.datasets import split_episodes
    from scripts.data.make_dataset import make_dataset, parse_phases

    tmp = f"{path}.{os.getpid()}.part"
    make_dataset(tmp, "CartPole-v1", steps=cfg.dataset_steps, seed=cfg.seed, phases=parse_phases(cfg.phases))
    with h5py.File(tmp, "a") as f:
        rew = f["rewards"][:].astype(np.float64)
        starts, lengths, _ = split_episodes(f["terminals"][:], f["timeouts"][:])
        rtg, ret = np.empty(len(rew), np.float32), np.empty(len(rew), np.float32)
        for a, n in zip(starts, lengths):  # the return from each step to its episode's end, and the whole
            rtg[a:a + n] = np.cumsum(rew[a:a + n][::-1])[::-1]
            ret[a:a + n] = rtg[a]
        f.create_dataset("infos/rtg", data=rtg)
        f.create_dataset("infos/return", data=ret)
    os.replace(tmp, path)


def describe(path: str, top: float) -> dict:
    """The dataset's returns (closed episodes: mean, best, min, mean by phase), episode lengths (every
    episode, in file order), the share of actions that are the unbiased controller's, the observations'
    mean and standard deviation, and the episodes filtered behaviour cloning keeps (``selected``, one
    bool per episode: the best closed ones by return, earlier first among equals, until they hold
    ``top`` of the steps)."""
    import h5py
    from gear_mpi.datasets import split_episodes
    from scripts.data.make_dataset import cartpole_value

    with h5py.File(path, "r") as f:
        rew, obs, act = f["rewards"][:], f["observations"][:].astype(np.float64), f["actions"][:]
        phase = f["infos/phase"][:] if "infos/phase" in f else np.zeros(len(rew), np.int32)
        starts, lengths, open_last = split_episodes(f["terminals"][:], f["timeouts"][:])
    closed = len(starts) - int(open_last)
    rets = np.add.reduceat(rew.astype(np.float64), starts)[:closed]
    ph = phase[starts][:closed]
    selected = np.zeros(len(starts), bool)
    order = np.argsort(-rets, kind="stable")
    cut = int(np.searchsorted(np.cumsum(lengths[order]), top * len(rew))) + 1  # the first episodes reaching top
    selected[order[:cut]] = True
    controller = np.array([cartpole_value(o) > 0 for o in obs])
    return {"returns": rets, "lengths": lengths, "steps": len(rew), "open_last": open_last,
            "by_phase": [round(float(rets[ph == k].mean()), 1) for k in range(int(ph.max()) + 1) if (ph == k).any()],
            "controller_share": round(float(np.mean(controller == (act > 0))), 3),
            "selected": selected, "selected_min_return": float(rets[selected[:closed]].min()),
            "selected_steps": int(lengths[selected].sum()),
            "mean": obs.mean(0).astype(np.float32),
            "std": np.sqrt(np.maximum(obs.var(0), 1e-6)).astype(np.float32)}


# ---- the model -----------------------------------------------------------------------------------------

def build_model(cfg: Config, conditioned: bool = True):
    """The decision transformer (a torch module); ``conditioned=False``: the same model with its return-to-go
    input held at 0, behaviour cloning."""
    import torch
    import torch.nn as nn

    class DecisionTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            d = cfg.embed
            self.conditioned = conditioned
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

            Args: rtg ``[B, W]`` (scaled; ignored unless conditioned), obs ``[B, W, 4]`` (normalised),
            action ``[B, W]`` int64, timestep ``[B, W]`` int64.
            """
            b, w = rtg.shape
            if not self.conditioned:
                rtg = torch.zeros_like(rtg)
            t = self.embed_t(timestep)
            tokens = torch.stack([self.embed_r(rtg[..., None]) + t, self.embed_s(obs) + t,
                                  self.embed_a(action) + t], dim=2).reshape(b, 3 * w, -1)
            h = self.blocks(self.norm(tokens), mask=self.causal[:3 * w, :3 * w], is_causal=True)
            return self.head(h[:, 1::3])  # the state tokens: they see R_t, s_t and everything before

    return DecisionTransformer()


def evaluate(model, cfg: Config, target: float, seeds: list[int], mean: np.ndarray, std: np.ndarray) -> list[float]:
    """Returns of greedy episodes of ``model`` in CartPole-v1, conditioned on ``target`` (unless the model
    ignores returns), one per seed."""
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

def load_replays(cfg: Config, path: str, info: dict, world):
    """Both replays, collective: all the episodes, and the same with priority 0 outside the selected ones;
    each on a duplicate of ``world`` (their prefetch threads run collectives of their own)."""
    import gear_mpi as gm

    columns = ["observations", "actions", "infos/rtg", "infos/return", "infos/episode_step"]
    out = []
    for k, filtered in enumerate((False, True)):
        comm = world.Dup()
        sampler = gm.Prioritized(1.0, 0.0) if filtered or cfg.sampler == "length" else gm.Uniform()
        replay = gm.datasets.from_d4rl(path, comm, columns=columns, max_length=MAX_STEPS, sampler=sampler,
                                       seed=cfg.seed + k)
        loaded = replay.dataset_info
        mine = slice(loaded["first_episode"], loaded["first_episode"] + len(loaded["episode_keys"]))
        prio = (info["lengths"][mine] if cfg.sampler == "length" else np.ones(mine.stop - mine.start))
        if filtered:
            prio = prio * info["selected"][mine]
        if filtered or cfg.sampler == "length":
            replay.update_priorities(loaded["episode_keys"], prio.astype(np.float64))
        out.append((replay, comm))
    return out


def run(cfg: Config) -> dict:
    """Make and load the dataset, train and evaluate the three models on every rank of ``MPI.COMM_WORLD``;
    returns the run's figures (on every rank)."""
    from mpi4py import MPI
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    import gear_mpi as gm

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    t0 = time.time()
    gm.init_torch_process_group(world, "gloo")  # DDP's gloo group, its address agreed over MPI
    import torch.distributed as dist

    # the dataset: a D4RL-layout file made by rank 0 (or given), each rank loading its share of the episodes
    path, tmpdir, err, info = cfg.dataset, None, None, None
    if rank == 0:
        try:
            if not path:
                import tempfile
                tmpdir = tempfile.mkdtemp(prefix="gear_mpi_offline_dt_")  # /tmp: seen by both "hosts" too
                path = os.path.join(tmpdir, "cartpole-replay.hdf5")
            if not os.path.exists(path):
                make_file(cfg, path)
            info = describe(path, cfg.top)
        except Exception as e:  # noqa: BLE001 -- raised on every rank below
            err, info = repr(e), None
    path, info, err = world.bcast((path, info, err), 0)
    if err:
        raise RuntimeError(f"offline_dt: the dataset could not be made or read on rank 0: {err}")
    rets, mean, std = info["returns"], info["mean"], info["std"]
    dataset_mean, dataset_best = float(rets.mean()), float(rets.max())
    (replay, comm_all), (top, comm_top) = load_replays(cfg, path, info, world)
    world.Barrier()  # loaded on every rank: a temporary file is no longer needed
    if tmpdir is not None:
        import shutil
        shutil.rmtree(tmpdir, ignore_errors=True)
    loaded = replay.dataset_info
    total_steps = loaded["steps"]
    segments = world.allgather(replay.shard.shm_name) + world.allgather(top.shard.shm_name)
    gen_s = time.time() - t0
    n_sel = int(info["selected"].sum())
    if rank == 0:
        print(f"offline_dt: {size} ranks; dataset: {loaded['episodes']} CartPole-v1 episodes, {total_steps} steps "
              f"({path if cfg.dataset else 'a temporary file'}, gm.datasets.from_d4rl), phases {cfg.phases}: "
              f"return mean {dataset_mean:.1f}, best {dataset_best:g}, min {rets.min():g} over the {len(rets)} "
              f"ended episodes; mean by phase {info['by_phase']}; {100 * info['controller_share']:.1f}% of the "
              f"actions are the unbiased controller's; filtered behaviour cloning keeps {n_sel} episodes, "
              f"{info['selected_steps']} steps, returns >= {info['selected_min_return']:g} ({gen_s:.1f} s)",
              flush=True)

    models, ddps, opts, scheds = {}, {}, {}, {}
    for name in METHODS:
        torch.manual_seed(cfg.seed)  # the same initial weights for the three
        models[name] = build_model(cfg, conditioned=name == "dt")
        ddps[name] = nn.parallel.DistributedDataParallel(models[name])  # broadcasts rank 0's initial weights
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        scheds[name] = torch.optim.lr_scheduler.LambdaLR(opts[name], lambda s: min(1.0, (s + 1) / cfg.warmup))
    n_params = sum(p.numel() for p in models["dt"].parameters())
    mean_t, std_t = torch.from_numpy(mean), torch.from_numpy(std)
    targets = cfg.target_list()
    if rank == 0:
        print(f"offline_dt: 3 models of {cfg.layers} layers x {cfg.embed} dims x {cfg.heads} heads, context "
              f"{cfg.context}, {n_params} parameters each; {cfg.batch} windows per rank per step per replay, "
              f"sampler {replay.selector!r}; {cfg.steps} steps; decision transformer targets {targets}", flush=True)
        print(f"{'step':>6} " + " ".join(f"{m:>11}" for m in METHODS) + f" {'eval bc/fbc/dt':>17} {'wall_s':>7}",
              flush=True)

    def eval_seeds(count: int, base: int) -> list[int]:  # seeds unseen in the dataset, shared among the ranks
        return [10_000_000 + base + i for i in range(rank, count, size)]

    def evaluate_all(count: int, base: int, dt_targets: list[float]) -> dict[str, list[float]]:
        """Collective: ``count`` episodes per model and target, every rank's returns."""
        runs = [("bc", "bc", 0.0), ("filtered_bc", "filtered_bc", 0.0)]
        runs += [(f"dt@{x:g}", "dt", x) for x in dt_targets]
        got = {}
        for label, name, target in runs:
            mine = evaluate(models[name], cfg, target, eval_seeds(count, base), mean, std)
            got[label] = [x for r in world.allgather(mine) for x in r]
        return got

    def train_step(name: str, batch) -> float:
        mask = batch.mask
        obs = (batch["observations"] - mean_t) / std_t
        rtg = batch["infos/rtg"] / cfg.rtg_scale
        action, timestep = batch["actions"].long(), batch["infos/episode_step"].long()
        logits = ddps[name](rtg, obs, action, timestep)
        loss = F.cross_entropy(logits[mask], action[mask])
        opts[name].zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks
        nn.utils.clip_grad_norm_(models[name].parameters(), cfg.grad_clip)
        opts[name].step()
        scheds[name].step()
        return loss.item()

    losses: dict[str, list[float]] = {m: [] for m in METHODS}
    curve: dict[str, list[tuple[int, float]]] = {}  # label -> (step, mean evaluation return)
    curve_label = f"dt@{targets[0]:g}"

    def add_curve(step: int, got: dict[str, list[float]]) -> str:
        for label, r in got.items():
            curve.setdefault(label, []).append((step, float(np.mean(r))))
        return "/".join(f"{np.mean(got[k]):.0f}" for k in ("bc", "filtered_bc", curve_label))

    wall = 0.0
    filtered_min = float("inf")  # the lowest episode return in filtered behaviour cloning's batches
    t1 = next_log = time.time()
    step = 0
    if cfg.eval_every:  # the untrained models, for the curves' first points
        ev = add_curve(0, evaluate_all(cfg.eval_curve_episodes, 0, targets[:1]))
        if rank == 0:
            print(f"{0:>6} " + " ".join(f"{'':>11}" for _ in METHODS) + f" {ev:>17} {0.0:>7.1f}", flush=True)
    with replay.batches(cfg.batch, window=cfg.context, align="random", prefetch=2, limit=cfg.steps) as it, \
            top.batches(cfg.batch, window=cfg.context, align="random", prefetch=2, limit=cfg.steps) as top_it:
        for batch, top_batch in zip(it, top_it):
            step += 1
            for name in METHODS:  # dt and bc on the same windows, filtered_bc on the best episodes' windows
                losses[name].append(train_step(name, top_batch if name == "filtered_bc" else batch))
            filtered_min = min(filtered_min, float(top_batch["infos/return"][top_batch.mask].min()))
            ev = ""
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                ev = add_curve(step, evaluate_all(cfg.eval_curve_episodes, 1000 * step, targets[:1]))
            wall = world.bcast(time.time() - t1, 0)  # the same stop decision on every rank
            if rank == 0 and (time.time() >= next_log or ev):
                next_log = time.time() + cfg.log_every
                print(f"{step:>6} " + " ".join(f"{np.mean(losses[m][-50:]):>11.4f}" for m in METHODS)
                      + f" {ev:>17} {wall:>7.1f}", flush=True)
            if wall >= cfg.max_seconds:
                break  # leaving the with block closes the iterators on every rank
    train_s = time.time() - t1
    steps_done = world.allreduce(step, op=MPI.MIN)
    filtered_min = world.allreduce(filtered_min, op=MPI.MIN)
    t2 = time.time()
    final = evaluate_all(cfg.eval_episodes, 0, targets)
    eval_s = time.time() - t2
    add_curve(steps_done, {k: final[k] for k in ("bc", "filtered_bc", curve_label)})
    sampled = {"all": int(replay.stats()["total"].get("sampled", -1)),
               "filtered": int(top.stats()["total"].get("sampled", -1))}
    for r, c in ((top, comm_top), (replay, comm_all)):
        r.close()
        c.Free()
    dist.destroy_process_group()

    k = max(1, steps_done // 10)
    loss_mean, first, last = {}, {}, {}
    for m in METHODS:  # the ranks' mean, per step
        loss_mean[m] = np.mean(np.array(world.allgather(losses[m][:steps_done])), axis=0)
        first[m], last[m] = round(float(loss_mean[m][:k].mean()), 4), round(float(loss_mean[m][-k:].mean()), 4)
    return {"steps": steps_done, "train_s": round(train_s, 1), "eval_s": round(eval_s, 1), "data_s": round(gen_s, 1),
            "dataset_episodes": int(loaded["episodes"]), "dataset_ended_episodes": len(rets),
            "dataset_steps": int(total_steps), "dataset_mean_return": round(dataset_mean, 1),
            "dataset_best_return": dataset_best, "dataset_mean_by_phase": info["by_phase"],
            "dataset_controller_share": info["controller_share"],
            "filtered_episodes": n_sel, "filtered_steps": info["selected_steps"],
            "filtered_min_return": info["selected_min_return"], "filtered_sampled_min_return": filtered_min,
            "targets": targets, "eval_episodes": cfg.eval_episodes,
            "eval_mean_return": {k: round(float(np.mean(v)), 1) for k, v in final.items()},
            "eval_min_return": {k: float(np.min(v)) for k, v in final.items()}, "eval_returns": final,
            "loss_first10": first, "loss_last10": last,
            "loss_ratio": {m: round(last[m] / first[m], 3) for m in METHODS}, "sampled": sampled,
            "sampler": cfg.sampler, "model": [cfg.layers, cfg.embed, cfg.heads, cfg.context, n_params],
            "segments": segments, "curve": curve, "losses": {m: [round(float(x), 5) for x in v]
                                                            for m, v in loss_mean.items()}}


LABELS = {"dt": "decision transformer", "bc": "behaviour cloning", "filtered_bc": "filtered behaviour cloning"}
COLORS = {"dt": "tab:red", "bc": "tab:blue", "filtered_bc": "tab:green"}


def save_plot(path: str, result: dict, ranks: int) -> None:
    """Training losses, evaluation return vs step, and the final evaluation per model and target against the
    dataset's mean and best; needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("offline_dt: matplotlib is not installed; no plot", flush=True)
        return
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(15, 4.4))
    for m in METHODS:
        losses = np.array(result["losses"][m])
        w = min(25, len(losses))
        steps = np.arange(1, len(losses) + 1)
        ax1.plot(steps, losses, color=COLORS[m], alpha=0.2, lw=0.7)
        ax1.plot(steps[w - 1:], np.convolve(losses, np.ones(w) / w, mode="valid"), color=COLORS[m],
                 label=f"{LABELS[m]} (mean of {w} steps)")
    ax1.set_xlabel("training step")
    ax1.set_ylabel("action cross-entropy")
    ax1.set_title("training loss (mean of the ranks)", fontsize=10)
    ax1.legend(fontsize=8)
    dt_label = f"dt@{result['targets'][0]:g}"
    for label, m in (("bc", "bc"), ("filtered_bc", "filtered_bc"), (dt_label, "dt")):
        pts = result["curve"].get(label, [])
        name = LABELS[m] + (f", target {result['targets'][0]:g}" if m == "dt" else "")
        ax2.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=COLORS[m], label=name, ms=4)
    for ax in (ax2, ax3):
        ax.axhline(result["dataset_mean_return"], color="gray", ls="--", lw=1,
                   label=f"dataset mean ({result['dataset_mean_return']:g})")
        ax.axhline(result["dataset_best_return"], color="black", ls=":", lw=1,
                   label=f"dataset best ({result['dataset_best_return']:g})")
        ax.set_ylim(0, 540)
        ax.set_ylabel("evaluation return")
    ax2.set_xlabel("training step")
    ax2.set_title("evaluation return during training (last point: the final evaluation)", fontsize=10)
    ax2.legend(fontsize=7, loc="center right")
    labels = ["bc", "filtered_bc"] + [f"dt@{x:g}" for x in result["targets"]]
    names = ["behaviour\ncloning", f"filtered BC\n(best {result['filtered_episodes']} ep.)"]
    names += [f"DT\ntarget {x:g}" for x in result["targets"]]
    means = [result["eval_mean_return"][k] for k in labels]
    errs = [np.std(result["eval_returns"][k]) for k in labels]
    colors = [COLORS["bc"], COLORS["filtered_bc"]] + [COLORS["dt"]] * len(result["targets"])
    x = np.arange(len(labels))
    ax3.bar(x, means, yerr=errs, color=colors, alpha=0.8, capsize=3)
    for i, (v, e) in enumerate(zip(means, errs)):
        ax3.text(i, v + e + 8, f"{v:g}", ha="center", fontsize=8)
    for i, t in enumerate(result["targets"]):  # the target each decision transformer bar was asked for
        ax3.plot([x[2 + i] - 0.4, x[2 + i] + 0.4], [t, t], color="black", lw=2,
                 label="target return" if i == 0 else None)
    ax3.set_xticks(x, names, fontsize=8)
    ax3.set_title(f"final evaluation: mean and std of {result['eval_episodes']} episodes", fontsize=10)
    ax3.set_ylim(0, 600)
    ax3.legend(fontsize=7, loc="upper center", ncol=3)
    fig.suptitle(f"offline CartPole-v1 from a learning agent's {result['dataset_episodes']} episodes in gear_mpi: "
                 f"{ranks} DDP ranks, replay.batches(prefetch=2), {result['steps']} steps", fontsize=10)
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
        ev = result["eval_mean_return"]
        print(f"offline_dt: {result['steps']} steps in {result['train_s']} s; loss (first 10% -> last 10%) "
              + ", ".join(f"{m} {result['loss_first10'][m]} -> {result['loss_last10'][m]}" for m in METHODS)
              + f"; evaluation ({result['eval_episodes']} episodes each, {result['eval_s']} s): "
              + ", ".join(f"{k} {v}" for k, v in ev.items())
              + f"; dataset mean {result['dataset_mean_return']}, best {result['dataset_best_return']:g}", flush=True)
        summary = {k: v for k, v in result.items() if k not in ("curve", "losses")}
        print("RESULT " + json.dumps(summary), flush=True)
        if cfg.plot:
            save_plot(cfg.plot, result, MPI.COMM_WORLD.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
