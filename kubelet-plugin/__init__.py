# ruff: noqa: N999  (the folder is kubelet-plugin; the import name is gpu_dra.kubelet_plugin)
