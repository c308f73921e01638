"""Checkpoints (gear_mpi.checkpoint): exact restore, resharding, damaged checkpoints, the crash-recovery rule.

The multi-rank checks run tests/mpi_programs/check_checkpoint.py under mpiexec
(see its docstring): one 2-rank job saves, restores exactly and checks damaged
checkpoints, and leaves a checkpoint that jobs on 3 ranks and on 1 rank reshard.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest

from gear_mpi import checkpoint as ck
from gear_mpi.checkpoint import files
from mpi_util import expect_passes, run_mpi, run_single


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The 2-rank job: exact restores, replacement, the .old rule, damaged checkpoints; leaves DIR/shared."""
    base = tmp_path_factory.mktemp("checkpoints")
    proc = run_mpi(2, "check_checkpoint.py", "exact", str(base), timeout=240)
    return proc, base


def test_exact_restore_draws_the_same_samples(saved):
    proc, _ = saved
    expect_passes(proc, 2, [f"exact/{n}" for n in ("prio-dec", "uni-cen", "fifo-dec", "max-dec")])


def test_replace_and_recover_from_a_crash_between_renames(saved):
    expect_passes(saved[0], 2, ["replace-and-old"])


def test_damaged_checkpoints_raise_on_every_rank_naming_the_file(saved):
    proc, _ = saved
    expect_passes(proc, 2, ["damaged"])
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("damaged/")]
    kinds = {ln.split(":")[0] for ln in lines}
    assert kinds >= {"damaged/missing-file", "damaged/bad-checksum", "damaged/truncated", "damaged/wrong-version",
                     "damaged/corrupted-manifest", "damaged/missing-rank", "damaged/rank-mismatch",
                     "damaged/nothing"}, lines


def test_reshard_onto_more_ranks(saved):
    proc, base = saved
    expect_passes(proc, 2, ["shared"])
    expect_passes(run_mpi(3, "check_checkpoint.py", "reshard", str(base), timeout=180), 3, ["reshard/3"])


def test_reshard_onto_one_smaller_rank_drops_the_oldest(saved):
    proc, base = saved
    expect_passes(proc, 2, ["shared"])
    single = run_single("check_checkpoint.py", "reshard", str(base), "70")
    expect_passes(single, 1, ["reshard/1/cap70"])


def test_device_index_restores_onto_gpu_and_cpu_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("NUMBA_ENABLE_CUDASIM", "1")  # CUDA kernels on numba's simulator
    proc = run_single("check_checkpoint.py", "device", str(tmp_path))
    expect_passes(proc, 1, ["device/cuda", "device/cpu"])


def test_resolve_rule(tmp_path):
    path = tmp_path / "cp"
    with pytest.raises(ck.CheckpointError, match="no checkpoint there"):
        ck.resolve(path)
    (tmp_path / "cp.old").mkdir()
    assert ck.resolve(path) == str(path) + ".old"  # crashed between the two renames
    path.mkdir()
    assert ck.resolve(path) == str(path)  # path wins; path.old is stale debris
    (tmp_path / "file").write_text("x")
    with pytest.raises(ck.CheckpointError, match="not a directory"):
        ck.resolve(tmp_path / "file")
    with pytest.raises(ck.CheckpointError, match="MANIFEST.json: missing"):
        ck.read_manifest(path)


def test_remap():
    old = np.array([3, 7, 9], np.int64)
    new = np.array([30, -1, 90], np.int64)
    assert ck.remap((old, new), [9, 3, 7, 4]).tolist() == [90, 30, -1, -1]
    assert ck.remap((old[:0], new[:0]), [1]).tolist() == [-1]


def test_files_are_written_in_chunks_with_checksums(tmp_path):
    data = np.arange(1000, dtype=np.uint8)
    info = files.write_file(str(tmp_path / "f"), files.slices(data, 0, 1000, step=64))
    assert info == {"bytes": 1000, "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
    assert [len(p) for p in files.slices(data, 100, 300, step=64)] == [64, 64, 64, 8]
    with pytest.raises(FileExistsError):  # never overwrites
        files.write_file(str(tmp_path / "f"), [b"x"])
    assert os.path.getsize(tmp_path / "f") == 1000
    with files.CheckedFile(str(tmp_path / "f"), info) as c:  # reads back, checking size and sha256
        head = np.empty(10, np.uint8)
        c.read_into(head)
        assert head.tolist() == list(range(10))
        c.finish()
    with pytest.raises(ck.CheckpointError, match="sha256 does not match"):
        with files.CheckedFile(str(tmp_path / "f"), dict(info, sha256="0" * 64)) as c:
            c.finish()
    with pytest.raises(ck.CheckpointError, match="the manifest says 999"):
        files.CheckedFile(str(tmp_path / "f"), dict(info, bytes=999))


def test_public_names_and_layers():
    """The names of the old gear_mpi.checkpoint module still work; the package imports no replay code."""
    import gear_mpi as gm
    from gear_mpi.errors import CheckpointError
    assert ck.CheckpointError is CheckpointError and ck.MANIFEST == "MANIFEST.json" and ck.FORMAT_VERSION == 2
    assert ck.rank_dir(3) == "rank-00003"
    assert gm.save_checkpoint is ck.save and gm.load_checkpoint == gm.Replay.load
    with pytest.raises(TypeError, match="build"):
        ck.load("anywhere")  # the package cannot build a Replay by itself
    with pytest.raises(TypeError, match="unexpected keyword"):
        ck.load("anywhere", build=gm.Replay, colour="red")
    import ast
    import pathlib
    for source in pathlib.Path(ck.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").endswith("replay"), (source.name, node.module)
                names = {a.name for a in node.names}
                assert not names & {"replay", "Replay", "__version__"}, (source.name, names)
