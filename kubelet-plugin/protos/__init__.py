# ruff: noqa: N999  (the folder is kubelet-plugin; the import name is gpu_dra.kubelet_plugin)
"""Vendored kubelet plugin protos and the generator for ``gpu_dra.kubelet_plugin._generated``."""
