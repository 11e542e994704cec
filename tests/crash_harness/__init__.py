"""Crash-injection harness: SIGKILL the kubelet plugin at every named crash point of every tier,
restart it, retry as the kubelet does, and check the node's real state after each restart.

`nodes` the simulated nodes, `plugin` the plugin process the harness forks and kills,
`invariants` the checks on the node's files and processes, `driver` the randomized driver.
Run: ``python -m tests.crash_harness --cycles 500 --seed 1`` (docs/development.md).
"""
