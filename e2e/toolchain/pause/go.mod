module github.com/gpu-dra/gpu-dra/e2e/toolchain/pause

go 1.24
