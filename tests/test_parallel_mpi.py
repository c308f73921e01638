"""Model-parallel groups, one batch per replica, and the activity counters under real mpiexec: one start of
tests/mpi/test_parallel.py (2 DP x 2 TP, 2 DP x 2 PP, 1 DP x 4 PP; both shardings of the replay) and
tests/mpi/test_activity.py (counters, rates, RateMeter) on 4 ranks; and the groups adopted from a torch
DeviceMesh, Megatron-core's parallel_state and a DeepSpeed-style mpu (tests/mpi/test_framework_groups.py, 4
ranks, torch.distributed over gloo); bad input to that layer (tests/mpi/test_distributed_audit.py, 2 ranks)."""
from __future__ import annotations

import importlib.util

from example_util import run_example_job
from mpi_util import ROOT, run_pytest_mpi


def test_parallel_and_activity_on_four_ranks():
    run = run_pytest_mpi(4, "test_parallel.py", "test_activity.py", timeout=300)
    ran = run.passed(0)
    for name in ("test_ranks_of_a_replica_receive_the_same_batch", "test_the_replicas_draw_the_exact_distribution"):
        assert sum(name in t for t in ran) == 4, (name, sorted(ran))
    assert any("test_a_late_rank_shows_as_the_others_waiting" in t for t in ran), sorted(ran)
    assert any("test_meter_by_seconds_agrees_on_the_steps" in t for t in ran), sorted(ran)


def test_groups_from_frameworks_on_four_ranks():
    # (a backstop for a hang: four ranks importing torch took 143 s of a loaded CI run, 2026-12-07)
    run = run_pytest_mpi(4, "test_framework_groups.py", timeout=480)
    ran = run.passed(0)
    for name in ("test_device_mesh_gives_what_parallel_groups_builds", "test_deepspeed_style_mpu",
                 "test_adopted_groups_drive_a_replica_sampler", "test_bad_input_fails_on_every_rank",
                 "test_mpi_ranks_in_another_order_than_torch_ranks"):
        assert any(name in t for t in ran), (name, sorted(ran))
    if importlib.util.find_spec("megatron") is not None:  # megatron-core installed: its test ran, not skipped
        assert sum("test_megatron_parallel_state" in t for t in ran) == 2, sorted(ran)


def test_bad_input_to_the_parallel_layer_on_two_ranks():
    """tests/mpi/test_distributed_audit.py: bad timeouts, specs, batches and reporter updates fail on every rank at
    once; a closed sampler says so."""
    run = run_pytest_mpi(2, "test_distributed_audit.py", timeout=180)
    ran = run.passed(0)
    for name in ("test_a_bad_timeout_fails_on_every_rank", "test_rank_0s_address_too_long_to_send_fails_on_every_rank",
                 "test_a_spec_that_is_no_spec_fails_on_every_rank",
                 "test_a_closed_sampler_says_so", "test_a_leaders_bad_batch_fails_on_every_member",
                 "test_a_reporters_bad_update_is_refused_on_every_rank"):
        assert any(name in t for t in ran), (name, sorted(ran))


def test_parallel_frameworks_example_on_four_ranks():
    """examples/integrations/parallel_frameworks.py (docs/guide/integrations/parallel_frameworks.md): the
    DeviceMesh run, and the Megatron-core one in the same job where megatron-core is installed."""
    frameworks = "mesh,megatron" if importlib.util.find_spec("megatron") is not None else "mesh"
    result, _ = run_example_job(ROOT / "examples" / "integrations" / "parallel_frameworks.py", "--framework",
                                frameworks, ranks=4, timeout=240)
    assert sorted(result) == sorted(frameworks.split(","))
    for framework, r in result.items():
        assert r == {"agreed": True, "order": "tp-dp-pp", "tensor": 2, "pipeline": 1, "data": 2}, framework
