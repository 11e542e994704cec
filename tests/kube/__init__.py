"""Tests of gpu_dra.kube."""
