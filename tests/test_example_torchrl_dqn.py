"""examples/torchrl_dqn.py learns, end to end: ``--quick`` on 2 DDP ranks (about 25-30 s here).

TorchRL's DQN recipe (collector, DQNLoss, target network) on a TensorDictReplayBuffer over gear_mpi's
GearStorage/GearSampler/GearWriter, one shard a rank, under ``mpiexec -n 2 python -m mpi4py`` with a hard
timeout. Asserted: it learns -- the greedy return and the last training episodes' mean well above a random
policy's (about 22; CartPole-v1 is not solved in this budget) -- every rank's collections reached its own
shard, and DDP kept one network on both ranks.
"""
from __future__ import annotations

import pytest

from example_util import run_example_job
from mpi_util import ROOT

EXAMPLE = ROOT / "examples" / "torchrl_dqn.py"
RANDOM_RETURN = 22.0
MIN_EVAL = 50.0    # quick run (64x64 net), greedy return: 237.7, 161.2, 206.7 (seeds 0-2); random play about 22
MIN_TRAIN = 60.0   # mean of the last 20 training episodes (epsilon 0.04): 120.0, 198.1, 182.2 (seeds 0-2)
TIMEOUT = 240.0


def test_torchrl_dqn_quick_learns():
    pytest.importorskip("torchrl")
    pytest.importorskip("gymnasium")
    r, out = run_example_job(EXAMPLE, "--quick", timeout=TIMEOUT)
    assert r["eval_mean"] >= MIN_EVAL and r["train_mean20"] >= MIN_TRAIN, \
        f"no better than random play (about {RANDOM_RETURN}): {r}\n{out[-3000:]}"
    assert r["env_steps"] >= 12_000 and r["updates"] > 0
    assert r["same_weights"], "DDP left different weights on the ranks"
    assert r["items_per_rank"] == [r["env_steps"] // 2] * 2 and r["replay_items"] == r["env_steps"], r
