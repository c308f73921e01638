"""The documentation site builds: ``python -m mkdocs build --strict`` from the repository root (mkdocs.yml,
docs/, the API reference generated from gear_mpi's docstrings) succeeds, its key pages are there, and the
strict build's link validation really fails on a broken link or anchor."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mpi_util import ROOT

pytest.importorskip("mkdocs", reason="the docs extra (mkdocs, mkdocstrings[python]) is not installed")
pytest.importorskip("mkdocstrings_handlers.python", reason="mkdocstrings[python] is not installed")
yaml = pytest.importorskip("yaml")  # PyYAML: a dependency of mkdocs


def mkdocs_build(config: Path, site: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "--site-dir",
                           str(site)], cwd=cwd, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    r = mkdocs_build(ROOT / "mkdocs.yml", out, ROOT)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    return out


def text(site: Path, page: str) -> str:
    path = site / page
    assert path.is_file(), f"the site has no {page}"
    return path.read_text()


def test_key_pages_are_built(site):
    for page in ("index.html", "guide/install.html", "guide/quickstart.html", "guide/actors.html",
                 "guide/offline.html", "guide/training.html", "guide/collectives.html", "guide/statistics.html",
                 "guide/storage.html", "guide/gpu.html", "guide/clusters.html", "guide/slurm.html",
                 "guide/examples.html", "CHECKPOINTS.html", "TWO_HOSTS.html", "architecture.html",
                 "performance.html", "BENCHMARKS.html", "changelog.html", "api/index.html", "api/replay.html",
                 "api/storage.html", "api/selection.html", "api/distributed.html", "api/feeds.html",
                 "api/checkpoint.html", "api/kernels.html", "api/datasets.html", "img/replay_ranks.png"):
        assert (site / page).is_file(), f"the site has no {page}"


def test_api_reference_renders_the_docstrings(site):
    api = text(site, "api/replay.html")
    assert "Replay" in api and "Shard" in api
    # Replay.sample's docstring, its summary line and its Args section
    assert "windows drawn from the whole replay" in api
    assert "steps per window" in api
    # a method Replay takes from one of its parts (checkpoints), not defined in replay.py
    assert "save" in api and "writer_address" in api
    # Sphinx roles (:class:`~gear_mpi.shard.Shard`) come out as code, not as raw roles
    assert ":class:" not in api and ":mod:" not in api
    # each sub-package page renders its __init__ docstring and its modules
    storage = text(site, "api/storage.html")
    assert "Where a shard" in storage and "TrajectoryStore" in storage


def test_included_files_are_in_the_site(site):
    """Pages that include a file of the repository (snippets) show it: the README's Quick start, the
    changelog, slurm/README.md."""
    assert "TrajectorySpec" in text(site, "guide/quickstart.html")
    assert "Changelog" in text(site, "changelog.html")
    assert "Slurm jobs for gear_mpi" in text(site, "guide/slurm.html")


def minimal_project(tmp_path: Path, index: str) -> Path:
    """A one-page mkdocs project with the repository's validation settings (what --strict reports)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    (tmp_path / "docs").mkdir(parents=True)
    (tmp_path / "docs" / "index.md").write_text(index)
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## A heading\n")
    mine = {"site_name": "t", "docs_dir": "docs", "validation": config["validation"],
            "nav": [{"Home": "index.md"}, {"Other": "other.md"}]}
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(mine))
    return tmp_path / "mkdocs.yml"


def test_strict_build_accepts_good_links(tmp_path):
    ok = minimal_project(tmp_path, "# Home\n\n[fine](other.md#a-heading)\n")
    r = mkdocs_build(ok, tmp_path / "site", tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("link", ["[gone](missing.md)", "[gone](other.md#no-such-heading)",
                                  "[gone](../CHANGELOG.md)"])
def test_strict_build_fails_on_a_broken_link(tmp_path, link):
    """A page that does not exist, an anchor no heading has, a file outside docs/: each fails the build."""
    broken = minimal_project(tmp_path, f"# Home\n\n{link}\n")
    r = mkdocs_build(broken, tmp_path / "site", tmp_path)
    assert r.returncode != 0, f"a strict build accepted {link}:\n{r.stderr[-3000:]}"
    assert "WARNING" in r.stderr, r.stderr[-3000:]


def test_api_table_names_every_export():
    """docs/api/index.md's table names every name ``gear_mpi`` exports (docs/index.md promises "every name in
    one table"): a new export without a row fails here."""
    import re

    import gear_mpi
    table = (ROOT / "docs" / "api" / "index.md").read_text()
    missing = [n for n in gear_mpi.__all__ if not re.search(rf"\b{re.escape(n)}\b", table)]
    assert not missing, f"docs/api/index.md does not name these exports of gear_mpi: {missing}"
