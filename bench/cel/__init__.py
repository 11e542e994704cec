"""bench/cel: DRA selector evaluation at cluster scale, Python vs the Kubernetes Go code.

``python -m bench.cel`` (or ``bench/run cel``); ``inventory.py`` renders the devices, ``go/`` is
the Go reference program. Method and numbers: docs/performance.md, "CEL selectors".
"""
