"""Test doubles shared by the test suites (never imported by gpu_dra)."""
