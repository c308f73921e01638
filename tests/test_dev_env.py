"""scripts/dev_env.sh: valid bash, and honours the variables the README documents (dry run: nothing installed)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "dev_env.sh"
VARIABLES = ("PYTHON", "GEAR_MPI_TORCH_INDEX", "GEAR_MPI_TORCH_SPEC", "GEAR_MPI_DRY_RUN")


def dry_run(tmp_path: Path, args=("--dry-run",), **env) -> list[str]:
    """Run a copy of dev_env.sh in an empty checkout (no .venv) and return the commands it would run."""
    (tmp_path / "scripts").mkdir(exist_ok=True)
    shutil.copy(SCRIPT, tmp_path / "scripts" / "dev_env.sh")
    clean = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "dev_env.sh"), *args], env={**clean, **env},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert not (tmp_path / ".venv").exists(), "a dry run created .venv"
    return [line[2:] for line in r.stdout.splitlines() if line.startswith("+ ")]


def test_bash_syntax():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_default_keeps_todays_commands(tmp_path):
    cmds = dry_run(tmp_path)
    assert cmds == ["python3 -m venv .venv",
                    ".venv/bin/python -m pip install -q --upgrade pip",
                    ".venv/bin/python -m pip install -q torch==2.13.0",
                    ".venv/bin/python -m pip install -q torch",
                    ".venv/bin/python -m pip install -q -e .[mpi,test]",
                    ".venv/bin/python -m compileall -q -j 0 gear_mpi scripts tests examples",
                    ".venv/bin/python -m scripts.checks.warm_kernels"], cmds


def test_variables_are_honoured(tmp_path):
    cmds = dry_run(tmp_path, args=(), PYTHON=sys.executable, GEAR_MPI_DRY_RUN="1",
                   GEAR_MPI_TORCH_INDEX="https://torch.example/whl/cpu", GEAR_MPI_TORCH_SPEC="torch==2.9.1")
    assert cmds[0] == f"{sys.executable} -m venv .venv"
    torch_cmds = [c for c in cmds if re.search(r"install -q .*torch", c)]
    assert torch_cmds == [".venv/bin/python -m pip install -q --index-url https://torch.example/whl/cpu torch==2.9.1",
                          ".venv/bin/python -m pip install -q --index-url https://torch.example/whl/cpu torch"], cmds
    # the index is for torch alone: gear_mpi and its other dependencies come from pip's usual sources
    assert cmds[-3] == ".venv/bin/python -m pip install -q -e .[mpi,test]"


def test_every_variable_is_documented():
    text = SCRIPT.read_text()
    readme = (ROOT / "README.md").read_text()
    for name in VARIABLES:
        assert f"${{{name}" in text or f"{name}=" in text, f"{name} not read by dev_env.sh"
        assert name in readme, f"{name} not documented in README.md"


def test_unknown_argument_is_refused(tmp_path):
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "dev_env.sh")
    r = subprocess.run(["bash", str(tmp_path / "scripts" / "dev_env.sh"), "--dryrun"], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2 and "unknown argument" in r.stderr
    assert not (tmp_path / ".venv").exists()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_names_the_variables(flag):
    r = subprocess.run(["bash", str(SCRIPT), flag], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for name in VARIABLES:
        assert name in r.stdout


def test_kernel_warm_up_runs_and_reports():
    """scripts/checks/warm_kernels.py (dev_env.sh's last step): exits 0 and says how many kernels it compiled
    (seconds when dev_env.sh has run it already, about two minutes on a cold cache)."""
    r = subprocess.run([sys.executable, "-m", "scripts.checks.warm_kernels"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    n = int(re.match(r"warm_kernels: compiling gear_mpi's CPU kernels into numba's cache in (\d+) stages", lines[0])[1])
    stages = [re.fullmatch(r"warm_kernels: \[(\d+)/(\d+)\] .+ \([0-9.]+ s\)", line) for line in lines[1:-1]]
    assert all(stages) and [(int(m[1]), int(m[2])) for m in stages] == [(k, n) for k in range(1, n + 1)], r.stdout
    assert re.fullmatch(r"warm_kernels: \d+ kernels compiled into numba's cache, [0-9.]+ s", lines[-1]), r.stdout
