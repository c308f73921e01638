"""gear_mpi.integrations.torchrl with the real TorchRL, on 1 and 2 ranks (each run a job of its own).

- tests/mpi/test_torchrl_adapter.py: the adapter's own tests (global draw, routed priorities, slice layout,
  state, refusals) -- what each checks is in its docstring.
- tests/mpi/torchrl_rb/: TorchRL's own replay-buffer tests (pytorch/rl v0.14.0, MIT), run on GearStorage,
  GearSampler, GearSliceSampler and GearWriter; which were copied, what was changed and which do not apply,
  and why, is in tests/mpi/torchrl_rb/conftest.py.
"""
from __future__ import annotations

import pytest

from mpi_util import run_pytest_mpi

pytest.importorskip("torchrl")

ADAPTER = "test_torchrl_adapter.py"
TORCHRL_TESTS = "tests/mpi/torchrl_rb"
#: TorchRL's tests that must pass (their names, less parameters), so that none can quietly stop running
MUST_PASS = {"TestComposableBuffers::" + t
             for t in ("test_rb_repr", "test_add", "test_extend", "test_sample", "test_pickable")} | \
            {"TestBuffers::" + t for t in ("test_add", "test_empty", "test_extend", "test_sample")} | \
            {"TestSamplers::test_slice_sampler_" + t for t in (
                "mask_present_when_short_trajs", "mask_shape_dtype", "mask_correctness", "mask_padded_obs_is_valid",
                "strict_length_no_mask", "pad_output_strict_length_raises", "pad_output_marks_slice_starts",
                "marks_slice_starts_no_pad", "pad_output_no_is_init_no_marker",
                "flat_sample_matches_batched_recurrent_module", "mask_all_long_trajs_no_mask",
                "truncated_marks_last_real_step")}


def _names(tests: set[str]) -> set[str]:
    return {t.split("[")[0].split("/")[-1] for t in tests}


@pytest.mark.parametrize("nprocs", [1, 2])
def test_torchrl_adapter_on_ranks(nprocs):
    run = run_pytest_mpi(nprocs, ADAPTER, mpiexec=nprocs > 1, timeout=300)
    ran = _names(run.passed(0))
    assert "test_torchrl_adapter::test_update_priority_reaches_the_owner" in ran, sorted(ran)
    assert len(ran) >= 14, sorted(ran)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_torchrls_own_replay_buffer_tests(nprocs):
    run = run_pytest_mpi(nprocs, TORCHRL_TESTS, mpiexec=nprocs > 1, timeout=300)
    passed = run.passed(0)
    missing = MUST_PASS - _names(passed)
    assert not missing, sorted(missing)
    if nprocs == 1:
        assert "TestStorages::test_storage_state_dict" in _names(passed)
    assert len(passed) >= 390, len(passed)
