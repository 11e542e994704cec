"""Tests of gpu_dra.controller."""
