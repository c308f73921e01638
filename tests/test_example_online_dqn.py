"""examples/online_dqn.py learns, end to end: ``--quick`` on 2 learner ranks x 2 actor processes; and its
stopping rule's greedy evaluation tells a controller that balances the pole from one that does not.

One run (about 20-30 s on 2 cores) under ``mpiexec -n 2 python -m mpi4py`` with a hard timeout:
the actors (spawned, without mpi4py) write CartPole-v1 transitions through ``gm.Writer``, the
learners sample them under a ``SampleToInsertRatio`` limiter and train with DDP. Asserted: the
mean return of the last 100 episodes is far above a random policy's (about 22), every actor's
data reached the replay, the limiter's band held, and nothing is left behind (processes of the
job's session, the example's shared-memory segments).
"""
from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

import gear_mpi as gm
from gear_mpi.warmup import warm_kernels
from example_util import run_example_job
from mpi_util import ROOT

EXAMPLE = ROOT / "examples" / "online_dqn.py"
RANDOM_POLICY_RETURN = 22.0  # CartPole-v1, uniform random actions
MIN_MEAN100 = 60.0  # quick run (12k steps, 64x64 net): 98.1, 96.2, 99.2 (seeds 0-2; 16k: 122-131); random: about 22
TIMEOUT = 300.0


def test_one_step_spec_warms_up_and_samples():
    """The example's items: one-step transitions, a spec of max_length=1 (Replay's construction warm-up
    once made a scratch shard too small for it)."""
    spec = gm.TrajectorySpec({"obs": ((4,), np.float32), "action": ((), np.int64), "reward": ((), np.float32),
                              "next_obs": ((4,), np.float32), "done": ((), np.float32)}, max_length=1)
    warm_kernels(spec, gm.Prioritized(0.6, 0.4))
    shard = gm.Shard(spec, 8, gm.Prioritized(0.6, 0.4))
    try:
        step = {"obs": np.arange(4, dtype=np.float32)[None], "action": np.array([1]), "reward": np.ones(1),
                "next_obs": np.ones((1, 4), np.float32), "done": np.zeros(1)}
        shard.insert_many([step] * 3, [1.0, 2.0, 3.0])
        batch = shard.sample(5, window=1)
        assert batch["obs"].shape == (5, 1, 4) and bool(batch.mask.all())
        assert np.array_equal(batch["obs"][:, 0].numpy(), np.tile(np.arange(4, dtype=np.float32), (5, 1)))
    finally:
        shard.close()


def _example_module():
    spec = importlib.util.spec_from_file_location("online_dqn_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks the module up
    before = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:  # it sets thread variables (NUMBA_NUM_THREADS=1, ...) for its own processes: not for this one,
        os.environ.clear()  # whose numba would otherwise start 1 worker, then refuse the restored default
        os.environ.update(before)
    return module


def test_greedy_evaluation_tells_a_controller_from_a_constant_policy():
    """The stopping rule's evaluation: 100 greedy episodes of a network on vectorized CartPole-v1. A network
    holding a linear controller (push towards where the pole falls) scores about 500; one that always
    pushes left scores about 9."""
    gym = pytest.importorskip("gymnasium")
    torch = pytest.importorskip("torch")
    example = _example_module()
    controller = torch.nn.Linear(4, 2)
    with torch.no_grad():
        controller.weight.copy_(torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.05, 0.5, 10.0, 1.0]]))
        controller.bias.zero_()
    left = torch.nn.Linear(4, 2)
    with torch.no_grad():
        left.weight.zero_()
        left.bias.copy_(torch.tensor([1.0, 0.0]))
    env = gym.make_vec("CartPole-v1", num_envs=100, vectorization_mode="vector_entry_point")
    try:
        good = example.greedy_returns(controller, env, 100, seed=7)
        bad = example.greedy_returns(left, env, 100, seed=7)
    finally:
        env.close()
    assert len(good) == len(bad) == 100
    assert np.mean(good) >= example.SOLVED, np.mean(good)
    assert max(bad) <= 20, bad


def test_greedy_rule_options_are_checked():
    example = _example_module()
    for bad in ("eval_passes=0", "eval_episodes=0"):
        with pytest.raises(SystemExit):
            example.parse_config(["--set", bad])
    cfg = example.parse_config(["--set", "eval_every=0", "--set", "eval_passes=0"])  # no evaluation: not used
    assert cfg.eval_every == 0


def test_online_dqn_quick_learns():
    pytest.importorskip("gymnasium")
    r, out = run_example_job(EXAMPLE, "--quick", timeout=TIMEOUT)

    # it learned
    assert r["episodes"] >= 100, r
    assert r["mean100"] >= MIN_MEAN100, (f"mean return of the last 100 episodes {r['mean100']} < {MIN_MEAN100} "
                                         f"(random policy: about {RANDOM_POLICY_RETURN}):\n{out[-3000:]}")
    # every actor of both learners ran to the end and fed the replay (none starved on a full staging ring)
    steps = [s for rank in r["actor_steps"] for s in rank]
    assert len(steps) == 4 and min(steps) >= 0.25 * sum(steps) / len(steps), r["actor_steps"]
    assert [c for rank in r["actor_exitcodes"] for c in rank] == [0, 0, 0, 0], r["actor_exitcodes"]
    # the rate limiter's band held: c - b <= inserted * spi - sampled <= c + b, c = min_size * spi
    spi, min_size, buffer = r["limiter"]
    diff = r["inserted"] * spi - r["sampled"]
    assert min_size * spi - buffer <= diff <= min_size * spi + buffer, r
    assert r["inserted"] >= 0.9 * r["env_steps"], r  # transitions staged, not yet ingested: a few per writer
    # tear-down: the weights block and every writer staging area are gone
    names = [n for rank in r["segments"] for n in rank]
    assert len(names) == 4
    leaked = sorted(n for n in os.listdir("/dev/shm") if any(n == x or n.startswith(x + "_w") for x in names))
    assert not leaked, f"shared-memory segments left behind: {leaked}"
