"""Throughput and latency benchmarks: the broker against godot_rl and a raw one-hop ceiling.

Entry point: ``python -m benchmarks.run --preset quick|full --out results.json`` (see docs/performance.md).
"""
