"""``python -m scripts.bench.bench_compression --quick``: every store's rows and the targets, in seconds."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ale_py")
pytest.importorskip("cv2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_json_rows():
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.bench_compression", "--quick", "--json",
                           "--transitions", "400"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    stores = {(r["case"], r["store"]) for r in rows if r["section"] == "store"}
    for s in ("gear raw", "gear frames-once", "torchrl CompressedListStorage", "torchrl LazyTensorStorage",
              "cpprb stack_compress+next_of"):
        assert ("Pong", s) in stores, stores
    assert ("hopper-like", "gear next-step") in stores
    once = [r for r in rows if r["section"] == "store" and r["store"] == "gear frames-once" and r["case"] == "Pong"]
    assert {(r["B"], r["W"]) for r in once} == {(32, 1), (256, 1), (32, 8), (256, 8)}
    # one frame a step instead of two stacks of four: about 8x less
    assert all(r["ratio_vs_raw_stacks"] > 6 and r["transitions_per_s"] > 0 for r in once)
    assert {r["B"] for r in rows if r["section"] == "targets"} == {32, 256}
    for codec in ("zstd", "lz4"):  # the compressed frame column's rows, and a target line for each B
        assert ("Pong", f"gear frames-once+{codec}") in stores, stores
        assert {r["B"] for r in rows if r["section"] == "targets" and r["store"] == f"gear frames-once+{codec}"} == {
            32, 256}
    assert all(r["memory_target_100x"] for r in rows if r["section"] == "targets")  # 100x less than raw stacks


def test_chunk_sweep_rows():
    """``python -m scripts.bench.bench_chunks``: a row per store with a median inside its spread."""
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.bench_chunks", "--transitions", "300", "--chunks", "2",
                           "--codecs", "lz4", "--repeats", "2", "--json"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["store"] for r in rows] == ["raw stacks", "frames once", "lz4 chunk 2"]
    for r in rows:
        for cell in ("B32W1", "B256W1", "B32W8", "B256W8"):
            med, lo, hi = r[cell]
            assert 0 < lo <= med <= hi
    assert rows[2]["bytes_per_transition"] * 50 < rows[0]["bytes_per_transition"]
