// Command nvml-mock builds, with -buildmode=c-shared, a libnvidia-ml.so.1 whose GPUs are those of
// NVIDIA's go-nvml mock servers (pkg/nvml/mock/dgxa100, dgxh100, dgxh200, dgxb200). It exports
// the C ABI of NVML (struct layouts from go-nvml's nvml.h) so that pynvml, go-nvml (nvidia-ctk)
// and C programs load it as they load the real library.
//
// Configuration, read by nvmlInit (docs/real-nodes.md, "The NVML mock library"):
//
//	GPU_DRA_NVML_MOCK_MACHINE   dgxa100 | dgxh100 | dgxh200 | dgxb200: which mock server
//	GPU_DRA_NVML_MOCK_STATE     JSON file holding MIG mode, compute mode and MIG instances,
//	                            shared by every process using the library
//	GPU_DRA_NVML_MOCK_DEV_ROOT  directory holding dev/nvidia<minor> and dev/nvidia-caps (default /);
//	                            when set, the capability nodes of the GPU and compute instances
//	                            a process creates are made there (removed with them)
//	GPU_DRA_NVML_MOCK_DRIVER    615: report driver 615.71.09 (CUDA 13.4) instead of the mock
//	                            server's, with per-cgroup GPU memory limits
//	                            (nvmlDeviceSet/GetMemoryLimits_v1, kept in the state file)
//	GPU_DRA_NVML_MOCK_TRACE     when set, every NVML call is logged to stderr
//
// Each of the first four that the environment leaves unset is read from gpu-dra-nvml-mock.env
// beside the loaded library (NAME=value lines), if there is one: an OCI hook gets no other.
//
// The library is built by e2e/nvmlmock.py, which generates nvml_mock_stubs.h (internal/stubgen)
// and puts it and nvml.h on the include path.
package main

func main() {}
