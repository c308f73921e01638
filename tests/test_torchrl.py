"""gear_mpi.integrations.torchrl with the real TorchRL, on 1 and 2 ranks (each run a job of its own).

- tests/mpi/test_torchrl_adapter.py: the adapter's own tests (global draw, routed priorities, slice layout,
  state, refusals) -- what each checks is in its docstring.
- tests/mpi/torchrl_rb/: TorchRL's own replay-buffer tests (pytorch/rl v0.14.0, MIT), run on GearStorage,
  GearSampler, GearSliceSampler and GearWriter; which were copied, what was changed and which do not apply,
  and why, is in tests/mpi/torchrl_rb/conftest.py.
- docs/guide/integrations/torchrl.md's complete example runs on 2 ranks.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from mpi_util import ROOT, mpiexec_path, run_pytest_mpi

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


def test_the_guide_example_runs_on_two_ranks(tmp_path):
    """docs/guide/integrations/torchrl.md's complete example, as the page says to run it."""
    page = (ROOT / "docs" / "guide" / "integrations" / "torchrl.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", page, re.S | re.M)
    assert blocks, "no ```python block in the TorchRL guide"
    program = tmp_path / "torchrl_replay.py"
    program.write_text(blocks[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", str(program)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"the guide's example failed on 2 ranks:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    for rank in (0, 1):
        assert f"rank {rank}: 100 here, drew rows written by ranks [0, 1]" in r.stdout, r.stdout
