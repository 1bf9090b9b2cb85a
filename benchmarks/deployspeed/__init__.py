"""The parts of ``benchmarks/deploy_speed.py`` (its entry point) beyond the demo's run:
``timing`` (one engine's measurement, the rotating rounds, the CSV with its runs and ratios),
``cells`` (one trained checkpoint per cell of a depth-study plan) and ``shapes`` (untrained
WMT base shapes at a fixed output length)."""
