"""Tests of gpu_dra.cli, the gpu-dra command line."""
