module github.com/gpu-dra/gpu-dra/e2e/toolchain/nvml-mock

go 1.26

require (
	github.com/NVIDIA/go-nvml v0.13.4-1
	github.com/google/uuid v1.6.0
)
