"""Vendored kubelet plugin protos and the generator for ``gpu_dra.kubelet_plugin._generated``."""
