"""Test doubles of external programs (never imported by gpu_dra); see each module's docstring."""
