"""examples/offline_dt.py trains, end to end: ``--quick`` on 2 ranks.

One run (30-40 s on 2 cores) under ``mpiexec -n 2 python -m mpi4py`` with a hard timeout:
rank 0 writes a learning agent's CartPole-v1 history (D4RL-layout HDF5, scripts/data/make_dataset.py
``phases``), every rank loads its share twice with gm.datasets.from_d4rl (all the episodes; the best
ones only, the others at priority 0), the ranks train a decision transformer, behaviour cloning and
filtered behaviour cloning side by side with DDP on windows from ``replay.batches(..., prefetch=2)``,
then evaluate each (the decision transformer at three targets). Asserted: the dataset is the mixture
the example needs (mostly poor episodes, the best ones a small share of the steps), filtered behaviour
cloning's batches held only the best episodes, every planned step ran for every model, each model's
training loss fell, every model and target was evaluated, and nothing is left behind (processes of the
job's session, the shards' shared-memory segments). The evaluation returns are reported, not asserted
(4 episodes, 60 steps; the full run's figures are in docs/guide/examples.md).
"""
from __future__ import annotations

import os

import pytest

from example_util import run_example_job
from mpi_util import ROOT

EXAMPLE = ROOT / "examples" / "offline_dt.py"
MAX_LOSS_RATIO = 0.8  # last 10% / first 10% of the quick run (seed 0): 0.49 (dt, bc), 0.34 (filtered_bc) here
TIMEOUT = 300.0


def test_offline_dt_quick_three_methods_train():
    pytest.importorskip("gymnasium")
    r, out = run_example_job(EXAMPLE, "--quick", timeout=TIMEOUT)

    # the dataset: mostly a leaning controller's episodes, the unbiased controller's (500) a small share of it
    assert r["dataset_episodes"] == 157 and r["dataset_steps"] == 21000 and r["dataset_best_return"] == 500.0, r
    assert r["dataset_mean_return"] < 0.4 * r["dataset_best_return"], r
    assert r["dataset_controller_share"] < 0.75, r  # the old noisy-controller dataset: 0.878
    assert r["filtered_min_return"] == 500.0 and r["filtered_steps"] <= 0.15 * r["dataset_steps"], r
    # filtered behaviour cloning's replay gave windows of the best episodes only (priority 0 elsewhere)
    assert r["filtered_sampled_min_return"] >= r["filtered_min_return"], r
    # every step ran (the wall-time budget did not cut it), every rank sampled its batches through both iterators
    assert r["steps"] == 60, r
    for name in ("all", "filtered"):  # plus up to prefetch=2 batches sampled ahead per rank
        assert r["sampled"][name] >= 2 * 64 * 60, r["sampled"]
    # each model learned: its loss fell
    for method, ratio in r["loss_ratio"].items():
        assert ratio < MAX_LOSS_RATIO, (f"{method}: loss {r['loss_first10'][method]} -> {r['loss_last10'][method]} "
                                        f"(ratio {ratio} >= {MAX_LOSS_RATIO}):\n{out[-3000:]}")
    assert sorted(r["loss_ratio"]) == ["bc", "dt", "filtered_bc"], r["loss_ratio"]
    # every model, and the decision transformer at every target, was evaluated over the whole job's episodes
    labels = ["bc", "filtered_bc"] + [f"dt@{t:g}" for t in r["targets"]]
    assert len(r["targets"]) >= 2 and sorted(r["eval_returns"]) == sorted(labels), r["eval_returns"]
    assert all(len(r["eval_returns"][k]) == r["eval_episodes"] == 4 for k in labels), r["eval_returns"]
    print(f"offline_dt --quick: loss ratios {r['loss_ratio']}, evaluation {r['eval_mean_return']} "
          f"over {r['eval_episodes']} episodes each, dataset mean {r['dataset_mean_return']}")
    # tear-down: the shards' segments (two replays) are gone
    assert len(r["segments"]) == 4, r["segments"]
    leaked = sorted(n for n in r["segments"] if n and os.path.exists(os.path.join("/dev/shm", n)))
    assert not leaked, f"shared-memory segments left behind: {leaked}"
