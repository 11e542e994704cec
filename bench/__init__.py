"""Benchmarks of the kubelet plugin and the slice publisher: reported numbers, not tests.

Run them all with ``bench/run``; each script also runs alone with ``python -m bench.<name>``
from the repository root. Method and results: ``docs/performance.md``.
"""
