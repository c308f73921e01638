"""Model-parallel groups, one batch per replica, and the activity counters under real mpiexec: one start of
tests/mpi/test_parallel.py (2 DP x 2 TP, 2 DP x 2 PP, 1 DP x 4 PP; both shardings of the replay) and
tests/mpi/test_activity.py (counters, rates, RateMeter) on 4 ranks; and the groups adopted from a torch
DeviceMesh, Megatron-core's parallel_state and a DeepSpeed-style mpu (tests/mpi/test_framework_groups.py, 4
ranks, torch.distributed over gloo)."""
from __future__ import annotations

import importlib.util

from mpi_util import run_pytest_mpi


def test_parallel_and_activity_on_four_ranks():
    run = run_pytest_mpi(4, "test_parallel.py", "test_activity.py", timeout=300)
    ran = run.passed(0)
    for name in ("test_ranks_of_a_replica_receive_the_same_batch", "test_the_replicas_draw_the_exact_distribution"):
        assert sum(name in t for t in ran) == 4, (name, sorted(ran))
    assert any("test_a_late_rank_shows_as_the_others_waiting" in t for t in ran), sorted(ran)
    assert any("test_meter_by_seconds_agrees_on_the_steps" in t for t in ran), sorted(ran)


def test_groups_from_frameworks_on_four_ranks():
    run = run_pytest_mpi(4, "test_framework_groups.py", timeout=240)
    ran = run.passed(0)
    for name in ("test_device_mesh_gives_what_parallel_groups_builds", "test_deepspeed_style_mpu",
                 "test_adopted_groups_drive_a_replica_sampler", "test_bad_input_fails_on_every_rank",
                 "test_mpi_ranks_in_another_order_than_torch_ranks"):
        assert any(name in t for t in ran), (name, sorted(ran))
    if importlib.util.find_spec("megatron") is not None:  # megatron-core installed: its test ran, not skipped
        assert sum("test_megatron_parallel_state" in t for t in ran) == 4, sorted(ran)
