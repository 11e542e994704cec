package main

// GPU memory limits per cgroup (nvmlDeviceSetMemoryLimits_v1, nvmlDeviceGetMemoryLimits_v1),
// answered only with a driver that has them (GPU_DRA_NVML_MOCK_DRIVER=615); otherwise
// NOT_SUPPORTED, as the weak stubs answered before. Return codes as nvml.h documents them:
// a MIG handle NOT_SUPPORTED; Set needs root (NO_PERMISSION), soft <= hard and each limit at
// most the GPU's memory (INVALID_ARGUMENT; hard = NVML_DEVICE_MEMORY_LIMIT_MAX means none);
// a cgroup directory that cannot be opened OPERATING_SYSTEM; Get of a cgroup without limits
// NOT_FOUND. Soft 0 and hard MAX clear a cgroup's limits; so does removing the cgroup (its
// entry is dropped whenever the state is saved or read for it). The limits are kept per GPU
// and cgroup in the state file, so the hook that sets them and any reader agree. The mock
// allocates nothing, so currentUsed is 0.

/*
#include <stdint.h>
*/
import "C"

import (
	"os"
	"sort"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

const memoryLimitMax = ^uint64(0) // NVML_DEVICE_MEMORY_LIMIT_MAX

type memoryLimit struct{ soft, hard uint64 }

// limitStates are the GPU's limits of cgroups that still exist, by cgroup path.
func (g *gpu) limitStates() []limitState {
	states := []limitState{}
	for cgroup, limit := range g.limits {
		if !cgroupExists(cgroup) {
			continue
		}
		states = append(states, limitState{Cgroup: cgroup, Soft: limit.soft, Hard: limit.hard})
	}
	sort.Slice(states, func(i, j int) bool { return states[i].Cgroup < states[j].Cgroup })
	return states
}

func cgroupExists(path string) bool {
	info, err := os.Stat(path)
	return err == nil && info.IsDir()
}

// limitsGPU resolves the handle of a memory-limit call: NOT_SUPPORTED without a driver that
// has the functions, or for a MIG handle.
func limitsGPU(device C.uintptr_t) (*gpu, nvml.Return) {
	if release, ok := lib.release(); !ok || !release.memoryLimits {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	return lib.gpuOnly(handle(device))
}

//export nvmlDeviceSetMemoryLimits_v1
func nvmlDeviceSetMemoryLimits_v1(device C.uintptr_t, limits unsafe.Pointer) C.int {
	return session("nvmlDeviceSetMemoryLimits_v1", func() nvml.Return {
		g, ret := limitsGPU(device)
		if ret != nvml.SUCCESS {
			return ret
		}
		if limits == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		cgroup, soft, hard, ok := readSetMemoryLimits(limits)
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if os.Geteuid() != 0 {
			return nvml.ERROR_NO_PERMISSION
		}
		memory, ret := g.dev.GetMemoryInfo()
		if ret != nvml.SUCCESS {
			return ret
		}
		total := memory.Total
		if soft > hard || soft > total || (hard != memoryLimitMax && hard > total) {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if !cgroupExists(cgroup) {
			return nvml.ERROR_OPERATING_SYSTEM
		}
		return lib.mutate(func() nvml.Return {
			g, ret := lib.gpuOnly(handle(device))
			if ret != nvml.SUCCESS {
				return ret
			}
			if soft == 0 && hard == memoryLimitMax {
				delete(g.limits, cgroup)
			} else {
				g.limits[cgroup] = memoryLimit{soft: soft, hard: hard}
			}
			return nvml.SUCCESS
		})
	})
}

//export nvmlDeviceGetMemoryLimits_v1
func nvmlDeviceGetMemoryLimits_v1(device C.uintptr_t, limits unsafe.Pointer) C.int {
	return session("nvmlDeviceGetMemoryLimits_v1", func() nvml.Return {
		g, ret := limitsGPU(device)
		if ret != nvml.SUCCESS {
			return ret
		}
		if limits == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		cgroup, ok := getMemoryLimitsCgroup(limits)
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if !cgroupExists(cgroup) {
			return nvml.ERROR_OPERATING_SYSTEM
		}
		limit, ok := g.limits[cgroup]
		if !ok {
			return nvml.ERROR_NOT_FOUND
		}
		writeGetMemoryLimits(limits, limit.soft, limit.hard)
		return nvml.SUCCESS
	})
}
