"""Checks that need a real NVIDIA GPU, run on a lent machine (never in CI).

``tests/real_gpu/run <out dir>`` runs them all and writes what it found; docs/real-nodes.md
("On a real GPU") and docs/mps.md record the results. Nothing here changes MIG or compute mode.
"""
