"""README.md's examples run as written: the Quick start program on 2 ranks under
``mpiexec -n 2 python -m mpi4py``, and every multi-rank command uses ``-m mpi4py``."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from mpi_util import ROOT, mpiexec_path

README = ROOT / "README.md"
#: documents whose mpiexec/srun command lines must start Python as ``python -m mpi4py``
DOCS = (README, ROOT / "slurm" / "README.md")


def section(title: str) -> str:
    """The text of the README section ``## title``, up to the next ``## `` heading."""
    text = README.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, f"README.md has no section '## {title}'"
    return m[1]


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.S | re.M)


def test_quick_start_runs_on_two_ranks(tmp_path):
    blocks = code_blocks(section("Quick start"), "python")
    assert blocks, "no ```python block in README's Quick start"
    program = tmp_path / "train.py"
    program.write_text(blocks[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    r = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "mpi4py", str(program)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, f"README's Quick start failed on 2 ranks:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert r.stdout.strip(), "the Quick start printed nothing (it prints replay.stats())"


def test_multi_rank_commands_use_mpi4py():
    """Every mpiexec/srun command line that starts Python in the READMEs runs it as ``python -m mpi4py``
    (an exception on one rank then aborts the job at once instead of stalling the others)."""
    for doc in DOCS:
        commands = re.findall(r"(?:mpiexec|srun) [^`\n]*?python\S*\s[^`\n]*", doc.read_text())
        assert commands, f"no mpiexec/srun command found in {doc.name}"
        for cmd in commands:
            assert re.search(r"python\S*\s+-m\s+mpi4py\b", cmd), f"{doc.relative_to(ROOT)}: without -m mpi4py: {cmd}"
