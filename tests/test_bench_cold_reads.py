"""``python -m scripts.bench.bench_cold_reads`` runs on a tiny file: every method delivers the file's bytes
(the script asserts it) and prints one row each; O_DIRECT's methods are left out where the file system
refuses it."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "scripts.bench.bench_cold_reads", "--size-gb", "0.02",
                           "--reps", "2", "--batch", "8", "--depth", "4", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split()[0] for line in proc.stdout.splitlines() if line.strip() and not line.startswith("#")}
    expected = {"willneed", "buffered"}
    if "O_DIRECT refused" not in proc.stdout:
        expected |= {"direct+copy", "direct-overlap", "direct-floor"}
    assert rows == expected, proc.stdout
    assert not os.listdir(tmp_path)  # the file is removed without --keep
