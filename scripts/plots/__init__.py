"""Figures from the benchmarks' JSON lines (``python -m scripts.plots.plot_results``)."""
