"""README.md says what is true: its two commands are the ones that run (the tests' command is the one
``.ci/run`` runs), the Quick start program runs on 2 ranks under ``mpiexec -n 2 python -m mpi4py``, its
relative links resolve, and every multi-rank command in it and in the documentation pages uses
``-m mpi4py``. The pages of docs/ are checked by ``mkdocs build --strict`` (tests/test_docs.py)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from mpi_util import ROOT, mpiexec_path

README = ROOT / "README.md"
#: documents whose mpiexec/srun command lines must start Python as ``python -m mpi4py``: the READMEs and the
#: documentation pages (but docs/CHECKPOINTS.md, whose one such command starts Python through ``sh -c`` on
#: purpose, to show MPICH's launcher leaving survivors alive)
DOCS = (README, ROOT / "slurm" / "README.md",
        *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "CHECKPOINTS.md"))


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


def test_the_two_commands():
    """The main job's command and the tests' command, as README's "The two commands" gives them: the scripts
    they name exist, and the tests' command is the one .ci/run runs."""
    blocks = code_blocks(section("The two commands"), "bash")
    assert blocks, "no ```bash block in README's 'The two commands'"
    commands = [line for line in blocks[0].splitlines() if line.strip() and not line.startswith("#")]
    main = ("bash scripts/dev_env.sh && .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py "
            "-m scripts.bench.bench_replay --quick")
    tests = "bash scripts/dev_env.sh && .venv/bin/python -m pytest -q tests"
    assert commands == [main, tests], commands
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert tests in ci, ".ci/run does not run the README's test command"
    assert (ROOT / "scripts" / "dev_env.sh").is_file()
    assert (ROOT / "scripts" / "bench" / "bench_replay.py").is_file()


def slug(heading: str) -> str:
    """The anchor of a heading as mkdocs' toc makes it (and, for plain headings, a repository browser)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def test_readme_links_resolve():
    """Every relative link of README.md names a file of the repository, and an anchor a heading of it."""
    links = re.findall(r"\]\(([^)\s]+)\)", README.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert len(local) >= 10, local  # the table of what it does points into the docs
    for link in local:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), f"README.md links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.*)$", target.read_text(), re.M)
            assert anchor in {slug(h) for h in headings}, f"README.md links to {link}: no such heading"


def test_multi_rank_commands_use_mpi4py():
    """Every mpiexec/srun command line that starts Python in the READMEs runs it as ``python -m mpi4py``
    (an exception on one rank then aborts the job at once instead of stalling the others)."""
    for doc in DOCS:
        commands = re.findall(r"(?:mpiexec|srun) [^`\n]*?python\S*\s[^`\n]*", doc.read_text())
        if doc.name == "README.md":  # the READMEs have such commands (a documentation page may have none)
            assert commands, f"no mpiexec/srun command found in {doc.relative_to(ROOT)}"
        for cmd in commands:
            assert re.search(r"python\S*\s+-m\s+mpi4py\b", cmd), f"{doc.relative_to(ROOT)}: without -m mpi4py: {cmd}"


def test_site_overview_matches_the_readme():
    """docs/index.md (the site's first page) has the README's "What it does" table, row for row, with the
    links made relative to docs/: a row added to one and not the other fails here."""
    def rows(text: str) -> list[str]:
        m = re.search(r"^## What it does\n(.*?)(?=^## )", text, re.S | re.M)
        assert m, "no section '## What it does'"
        return [line for line in m[1].splitlines() if line.startswith("| ")]
    readme = [row.replace("](docs/", "](").replace("](slurm/README.md)", "](guide/slurm.md)")
              for row in rows(README.read_text())]
    assert rows((ROOT / "docs" / "index.md").read_text()) == readme
