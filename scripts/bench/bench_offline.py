#!/usr/bin/env python
"""Offline-scale benchmarks (issue 13): run one part.

    python -m scripts.bench.bench_offline --part a [--quick]   # ingest: packed inserts vs TorchRL extend,
                                                             # dataset ingest (HDF5, npz) on 2 ranks
Part (a) lives in scripts/bench/offline_ingest.py (its docstring says what each case
measures); the remaining arguments are passed to it.
"""
from __future__ import annotations

import argparse
import sys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], add_help=False)
    ap.add_argument("--part", required=True, choices=["a"], help="a: ingest speed")
    args, rest = ap.parse_known_args()
    if args.part == "a":
        from scripts.bench import offline_ingest
        sys.argv = [sys.argv[0], *rest]
        offline_ingest.main()


if __name__ == "__main__":
    main()
