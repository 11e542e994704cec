package main

// The NVML functions this library implements. Handles are uintptr_t and structs void* here
// (ABI-identical to nvml.h's pointer types); cstructs.go writes the structs.

/*
#include <stdint.h>
*/
import "C"

import (
	"strings"
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// call runs an NVML function body under the library lock; a panic (a mock function the
// library did not expect to be missing) becomes NVML_ERROR_UNKNOWN, never a crash.
func call(name string, body func() nvml.Return) (result C.int) {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	defer func() {
		if r := recover(); r != nil {
			logf("%s: %v", name, r)
			result = C.int(nvml.ERROR_UNKNOWN)
		}
		if getenv(envTrace) != "" {
			logf("%s -> %s", name, returnName(nvml.Return(result)))
		}
	}()
	return C.int(body())
}

// session is call for the functions that need nvmlInit: the state file is re-read first when
// another process changed it.
func session(name string, body func() nvml.Return) C.int {
	return call(name, func() nvml.Return {
		if lib.refs == 0 {
			return nvml.ERROR_UNINITIALIZED
		}
		if err := lib.refresh(); err != nil {
			logf("%v", err)
			return nvml.ERROR_UNKNOWN
		}
		return body()
	})
}

func putString(buffer *C.char, length C.uint, value string) nvml.Return {
	if buffer == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if uint(len(value))+1 > uint(length) {
		return nvml.ERROR_INSUFFICIENT_SIZE
	}
	out := unsafe.Slice((*byte)(unsafe.Pointer(buffer)), len(value)+1)
	copy(out, value)
	out[len(value)] = 0
	return nvml.SUCCESS
}

func putUint(out *C.uint, value uint32) nvml.Return {
	if out == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	*out = C.uint(value)
	return nvml.SUCCESS
}

func putHandle(out *C.uintptr_t, value handle) nvml.Return {
	if out == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	*out = C.uintptr_t(value)
	return nvml.SUCCESS
}

// ---- initialisation and system ----

//export nvmlInit_v2
func nvmlInit_v2() C.int {
	return call("nvmlInit_v2", lib.initialize)
}

//export nvmlInit
func nvmlInit() C.int {
	return call("nvmlInit", lib.initialize)
}

//export nvmlInitWithFlags
func nvmlInitWithFlags(flags C.uint) C.int {
	// NVML_INIT_FLAG_NO_GPUS changes nothing here: a node whose device nodes are all absent
	// initialises anyway and counts 0 GPUs, as the real library does in such a container.
	return call("nvmlInitWithFlags", lib.initialize)
}

//export nvmlShutdown
func nvmlShutdown() C.int {
	return call("nvmlShutdown", lib.shutdown)
}

//export nvmlErrorString
func nvmlErrorString(result C.int) *C.char {
	return errorCString(nvml.Return(result))
}

//export nvmlSystemGetDriverVersion
func nvmlSystemGetDriverVersion(version *C.char, length C.uint) C.int {
	return session("nvmlSystemGetDriverVersion", func() nvml.Return {
		if release, ok := lib.release(); ok {
			return putString(version, length, release.version)
		}
		value, ret := lib.server.SystemGetDriverVersion()
		if ret != nvml.SUCCESS {
			return ret
		}
		return putString(version, length, value)
	})
}

//export nvmlSystemGetNVMLVersion
func nvmlSystemGetNVMLVersion(version *C.char, length C.uint) C.int {
	return session("nvmlSystemGetNVMLVersion", func() nvml.Return {
		if release, ok := lib.release(); ok {
			return putString(version, length, release.nvml)
		}
		value, ret := lib.server.SystemGetNVMLVersion()
		if ret != nvml.SUCCESS {
			return ret
		}
		return putString(version, length, value)
	})
}

func cudaDriverVersion(out *C.int) nvml.Return {
	value, ret := lib.server.SystemGetCudaDriverVersion()
	if release, ok := lib.release(); ok {
		value, ret = release.cuda, nvml.SUCCESS
	}
	if ret != nvml.SUCCESS {
		return ret
	}
	if out == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	*out = C.int(value)
	return nvml.SUCCESS
}

//export nvmlSystemGetCudaDriverVersion
func nvmlSystemGetCudaDriverVersion(version *C.int) C.int {
	return session("nvmlSystemGetCudaDriverVersion", func() nvml.Return { return cudaDriverVersion(version) })
}

//export nvmlSystemGetCudaDriverVersion_v2
func nvmlSystemGetCudaDriverVersion_v2(version *C.int) C.int {
	return session("nvmlSystemGetCudaDriverVersion_v2", func() nvml.Return { return cudaDriverVersion(version) })
}

// ---- device enumeration ----

func deviceCount(count *C.uint) nvml.Return {
	return putUint(count, uint32(len(lib.visible)))
}

//export nvmlDeviceGetCount_v2
func nvmlDeviceGetCount_v2(count *C.uint) C.int {
	return session("nvmlDeviceGetCount_v2", func() nvml.Return { return deviceCount(count) })
}

//export nvmlDeviceGetCount
func nvmlDeviceGetCount(count *C.uint) C.int {
	return session("nvmlDeviceGetCount", func() nvml.Return { return deviceCount(count) })
}

func handleByIndex(index C.uint, device *C.uintptr_t) nvml.Return {
	if int(index) >= len(lib.visible) {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return putHandle(device, lib.gpus[lib.visible[index]].handle())
}

//export nvmlDeviceGetHandleByIndex_v2
func nvmlDeviceGetHandleByIndex_v2(index C.uint, device *C.uintptr_t) C.int {
	return session("nvmlDeviceGetHandleByIndex_v2", func() nvml.Return { return handleByIndex(index, device) })
}

//export nvmlDeviceGetHandleByIndex
func nvmlDeviceGetHandleByIndex(index C.uint, device *C.uintptr_t) C.int {
	return session("nvmlDeviceGetHandleByIndex", func() nvml.Return { return handleByIndex(index, device) })
}

//export nvmlDeviceGetHandleByUUID
func nvmlDeviceGetHandleByUUID(uuid *C.char, device *C.uintptr_t) C.int {
	return session("nvmlDeviceGetHandleByUUID", func() nvml.Return {
		if uuid == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		wanted := C.GoString(uuid)
		for _, index := range lib.visible {
			g := lib.gpus[index]
			if g.dev.UUID == wanted {
				return putHandle(device, g.handle())
			}
			for _, m := range lib.migDevices(g) {
				if g.migUUIDs[instanceKey{m.gi.Info.Id, m.ci.Info.Id}] == wanted {
					return putHandle(device, g.migHandle(m.gi, m.ci))
				}
			}
		}
		return nvml.ERROR_NOT_FOUND
	})
}

func handleByPciBusID(busID *C.char, device *C.uintptr_t) nvml.Return {
	if busID == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	wanted, err := parsePciBusID(C.GoString(busID))
	if err != nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	for _, index := range lib.visible {
		g := lib.gpus[index]
		if address, err := parsePciBusID(g.dev.PciBusID); err == nil && address == wanted {
			return putHandle(device, g.handle())
		}
	}
	return nvml.ERROR_NOT_FOUND
}

//export nvmlDeviceGetHandleByPciBusId_v2
func nvmlDeviceGetHandleByPciBusId_v2(busID *C.char, device *C.uintptr_t) C.int {
	return session("nvmlDeviceGetHandleByPciBusId_v2", func() nvml.Return { return handleByPciBusID(busID, device) })
}

//export nvmlDeviceGetHandleByPciBusId
func nvmlDeviceGetHandleByPciBusId(busID *C.char, device *C.uintptr_t) C.int {
	return session("nvmlDeviceGetHandleByPciBusId", func() nvml.Return { return handleByPciBusID(busID, device) })
}

// ---- device identity ----

//export nvmlDeviceGetName
func nvmlDeviceGetName(device C.uintptr_t, name *C.char, length C.uint) C.int {
	return session("nvmlDeviceGetName", func() nvml.Return {
		g, m, ret := lib.device(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		value, ret := g.dev.GetName()
		if ret != nvml.SUCCESS {
			return ret
		}
		if m != nil {
			value = g.migName(m)
		}
		return putString(name, length, value)
	})
}

//export nvmlDeviceGetUUID
func nvmlDeviceGetUUID(device C.uintptr_t, uuid *C.char, length C.uint) C.int {
	return session("nvmlDeviceGetUUID", func() nvml.Return {
		g, m, ret := lib.device(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		value, ret := g.dev.GetUUID()
		if ret != nvml.SUCCESS {
			return ret
		}
		if m != nil {
			value = g.migUUIDs[instanceKey{m.gi.Info.Id, m.ci.Info.Id}]
		}
		return putString(uuid, length, value)
	})
}

//export nvmlDeviceGetBrand
func nvmlDeviceGetBrand(device C.uintptr_t, brand *C.int) C.int {
	return session("nvmlDeviceGetBrand", func() nvml.Return {
		g, _, ret := lib.device(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		value, ret := g.dev.GetBrand()
		if ret != nvml.SUCCESS || brand == nil {
			return orInvalid(ret)
		}
		*brand = C.int(value)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetArchitecture
func nvmlDeviceGetArchitecture(device C.uintptr_t, arch *C.uint) C.int {
	return session("nvmlDeviceGetArchitecture", func() nvml.Return {
		g, _, ret := lib.device(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		value, ret := g.dev.GetArchitecture()
		if ret != nvml.SUCCESS {
			return ret
		}
		return putUint(arch, uint32(value))
	})
}

//export nvmlDeviceGetCudaComputeCapability
func nvmlDeviceGetCudaComputeCapability(device C.uintptr_t, major, minor *C.int) C.int {
	return session("nvmlDeviceGetCudaComputeCapability", func() nvml.Return {
		g, _, ret := lib.device(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		maj, mnr, ret := g.dev.GetCudaComputeCapability()
		if ret != nvml.SUCCESS || major == nil || minor == nil {
			return orInvalid(ret)
		}
		*major, *minor = C.int(maj), C.int(mnr)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetMinorNumber
func nvmlDeviceGetMinorNumber(device C.uintptr_t, minor *C.uint) C.int {
	return session("nvmlDeviceGetMinorNumber", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		value, ret := g.dev.GetMinorNumber()
		if ret != nvml.SUCCESS {
			return ret
		}
		return putUint(minor, uint32(value))
	})
}

//export nvmlDeviceGetIndex
func nvmlDeviceGetIndex(device C.uintptr_t, index *C.uint) C.int {
	return session("nvmlDeviceGetIndex", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		for position, visible := range lib.visible {
			if lib.gpus[visible] == g {
				return putUint(index, uint32(position))
			}
		}
		return nvml.ERROR_INVALID_ARGUMENT
	})
}

func pciInfo(device C.uintptr_t, pci unsafe.Pointer) nvml.Return {
	g, _, ret := lib.device(handle(device))
	if ret != nvml.SUCCESS {
		return ret
	}
	info, ret := g.dev.GetPciInfo()
	if ret != nvml.SUCCESS {
		return ret
	}
	address, err := parsePciBusID(g.dev.PciBusID)
	if err != nil {
		logf("%v", err)
		return nvml.ERROR_UNKNOWN
	}
	if pci == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	writePciInfo(pci, address, info.PciDeviceId)
	return nvml.SUCCESS
}

//export nvmlDeviceGetPciInfo_v3
func nvmlDeviceGetPciInfo_v3(device C.uintptr_t, pci unsafe.Pointer) C.int {
	return session("nvmlDeviceGetPciInfo_v3", func() nvml.Return { return pciInfo(device, pci) })
}

//export nvmlDeviceGetPciInfo_v2
func nvmlDeviceGetPciInfo_v2(device C.uintptr_t, pci unsafe.Pointer) C.int {
	return session("nvmlDeviceGetPciInfo_v2", func() nvml.Return { return pciInfo(device, pci) })
}

func memoryOf(device C.uintptr_t) (nvml.Memory, nvml.Return) {
	g, m, ret := lib.device(handle(device))
	if ret != nvml.SUCCESS {
		return nvml.Memory{}, ret
	}
	if m != nil {
		return g.migMemory(m), nvml.SUCCESS
	}
	return g.dev.GetMemoryInfo()
}

//export nvmlDeviceGetMemoryInfo
func nvmlDeviceGetMemoryInfo(device C.uintptr_t, memory unsafe.Pointer) C.int {
	return session("nvmlDeviceGetMemoryInfo", func() nvml.Return {
		value, ret := memoryOf(device)
		if ret != nvml.SUCCESS || memory == nil {
			return orInvalid(ret)
		}
		writeMemory(memory, value)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetMemoryInfo_v2
func nvmlDeviceGetMemoryInfo_v2(device C.uintptr_t, memory unsafe.Pointer) C.int {
	return session("nvmlDeviceGetMemoryInfo_v2", func() nvml.Return {
		value, ret := memoryOf(device)
		if ret != nvml.SUCCESS || memory == nil {
			return orInvalid(ret)
		}
		return writeMemoryV2(memory, value)
	})
}

// ---- compute mode (the mock has none; the library keeps it, in the state file) ----

//export nvmlDeviceGetComputeMode
func nvmlDeviceGetComputeMode(device C.uintptr_t, mode *C.int) C.int {
	return session("nvmlDeviceGetComputeMode", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS || mode == nil {
			return orInvalid(ret)
		}
		*mode = C.int(g.computeMode)
		return nvml.SUCCESS
	})
}

// nvmlDeviceGetTopologyCommonAncestor: the mock machines have no PCI tree, so two GPUs meet
// across the system (NVML_TOPOLOGY_SYSTEM, nvidia-smi topo's SYS) and a GPU with itself on its
// board (NVML_TOPOLOGY_INTERNAL); MIG handles are not supported, as in NVML. NVIDIA's device
// plugin calls it for every GPU pair to choose a preferred allocation.
//
//export nvmlDeviceGetTopologyCommonAncestor
func nvmlDeviceGetTopologyCommonAncestor(device1 C.uintptr_t, device2 C.uintptr_t, level *C.int) C.int {
	return session("nvmlDeviceGetTopologyCommonAncestor", func() nvml.Return {
		g1, ret := lib.gpuOnly(handle(device1))
		if ret != nvml.SUCCESS {
			return ret
		}
		g2, ret := lib.gpuOnly(handle(device2))
		if ret != nvml.SUCCESS || level == nil {
			return orInvalid(ret)
		}
		*level = C.int(nvml.TOPOLOGY_SYSTEM)
		if g1 == g2 {
			*level = C.int(nvml.TOPOLOGY_INTERNAL)
		}
		return nvml.SUCCESS
	})
}

//export nvmlDeviceSetComputeMode
func nvmlDeviceSetComputeMode(device C.uintptr_t, mode C.int) C.int {
	return session("nvmlDeviceSetComputeMode", func() nvml.Return {
		if _, ret := lib.gpuOnly(handle(device)); ret != nvml.SUCCESS {
			return ret
		}
		switch nvml.ComputeMode(mode) {
		case nvml.COMPUTEMODE_DEFAULT, nvml.COMPUTEMODE_PROHIBITED, nvml.COMPUTEMODE_EXCLUSIVE_PROCESS:
		default:
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return lib.mutate(func() nvml.Return {
			g, ret := lib.gpuOnly(handle(device))
			if ret != nvml.SUCCESS {
				return ret
			}
			g.computeMode = int(mode)
			return nvml.SUCCESS
		})
	})
}

// ---- MIG mode ----

//export nvmlDeviceGetMigMode
func nvmlDeviceGetMigMode(device C.uintptr_t, current, pending *C.uint) C.int {
	return session("nvmlDeviceGetMigMode", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		cur, pend, ret := g.dev.GetMigMode()
		if ret != nvml.SUCCESS || current == nil || pending == nil {
			return orInvalid(ret)
		}
		*current, *pending = C.uint(cur), C.uint(pend)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceSetMigMode
func nvmlDeviceSetMigMode(device C.uintptr_t, mode C.uint, activationStatus *C.int) C.int {
	return session("nvmlDeviceSetMigMode", func() nvml.Return {
		if _, ret := lib.gpuOnly(handle(device)); ret != nvml.SUCCESS {
			return ret
		}
		activation := nvml.Return(nvml.SUCCESS)
		ret := lib.mutate(func() nvml.Return {
			g, ret := lib.gpuOnly(handle(device))
			if ret != nvml.SUCCESS {
				return ret
			}
			activation, ret = g.setMigMode(int(mode))
			return ret
		})
		if activationStatus != nil {
			*activationStatus = C.int(activation)
		}
		return ret
	})
}

// ---- GPU-instance profiles and placements ----

func giProfileAt(device C.uintptr_t, index C.uint) (*gpu, int, nvml.GpuInstanceProfileInfo, nvml.Return) {
	g, ret := lib.gpuOnly(handle(device))
	if ret != nvml.SUCCESS {
		return nil, 0, nvml.GpuInstanceProfileInfo{}, ret
	}
	info, ret := g.dev.GetGpuInstanceProfileInfo(int(index))
	return g, int(index), info, ret
}

//export nvmlDeviceGetGpuInstanceProfileInfo
func nvmlDeviceGetGpuInstanceProfileInfo(device C.uintptr_t, profile C.uint, info unsafe.Pointer) C.int {
	return session("nvmlDeviceGetGpuInstanceProfileInfo", func() nvml.Return {
		_, _, value, ret := giProfileAt(device, profile)
		if ret != nvml.SUCCESS || info == nil {
			return orInvalid(ret)
		}
		writeGiProfileInfo(info, value)
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstanceProfileInfoV
func nvmlDeviceGetGpuInstanceProfileInfoV(device C.uintptr_t, profile C.uint, info unsafe.Pointer) C.int {
	return session("nvmlDeviceGetGpuInstanceProfileInfoV", func() nvml.Return {
		g, index, value, ret := giProfileAt(device, profile)
		if ret != nvml.SUCCESS || info == nil {
			return orInvalid(ret)
		}
		return writeGiProfileInfoV(info, value, "MIG "+g.profileName(index, value, 0))
	})
}

//export nvmlDeviceGetGpuInstanceProfileInfoByIdV
func nvmlDeviceGetGpuInstanceProfileInfoByIdV(device C.uintptr_t, profileID C.uint, info unsafe.Pointer) C.int {
	return session("nvmlDeviceGetGpuInstanceProfileInfoByIdV", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		index, value, ok := g.giProfileByID(uint32(profileID))
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if info == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return writeGiProfileInfoV(info, value, "MIG "+g.profileName(index, value, 0))
	})
}

func possiblePlacements(device C.uintptr_t, profileID C.uint, placements unsafe.Pointer, count *C.uint) nvml.Return {
	g, ret := lib.gpuOnly(handle(device))
	if ret != nvml.SUCCESS {
		return ret
	}
	_, info, ok := g.giProfileByID(uint32(profileID))
	if !ok {
		return nvml.ERROR_NOT_SUPPORTED
	}
	if count == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	list, ret := g.dev.GetGpuInstancePossiblePlacements(&info)
	if ret != nvml.SUCCESS {
		return ret
	}
	if placements == nil { // NULL: how many there are
		*count = C.uint(len(list))
		return nvml.SUCCESS
	}
	if int(*count) < len(list) {
		*count = C.uint(len(list))
		return nvml.ERROR_INSUFFICIENT_SIZE
	}
	writeGiPlacements(placements, list)
	*count = C.uint(len(list))
	return nvml.SUCCESS
}

//export nvmlDeviceGetGpuInstancePossiblePlacements_v2
func nvmlDeviceGetGpuInstancePossiblePlacements_v2(device C.uintptr_t, profileID C.uint, placements unsafe.Pointer, count *C.uint) C.int {
	return session("nvmlDeviceGetGpuInstancePossiblePlacements_v2", func() nvml.Return {
		return possiblePlacements(device, profileID, placements, count)
	})
}

//export nvmlDeviceGetGpuInstancePossiblePlacements
func nvmlDeviceGetGpuInstancePossiblePlacements(device C.uintptr_t, profileID C.uint, placements unsafe.Pointer, count *C.uint) C.int {
	return session("nvmlDeviceGetGpuInstancePossiblePlacements", func() nvml.Return {
		return possiblePlacements(device, profileID, placements, count)
	})
}

//export nvmlDeviceGetGpuInstanceRemainingCapacity
func nvmlDeviceGetGpuInstanceRemainingCapacity(device C.uintptr_t, profileID C.uint, count *C.uint) C.int {
	return session("nvmlDeviceGetGpuInstanceRemainingCapacity", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		if !g.migEnabled() {
			return nvml.ERROR_NOT_SUPPORTED
		}
		_, info, ok := g.giProfileByID(uint32(profileID))
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return putUint(count, g.remainingCapacity(info))
	})
}

// ---- GPU instances ----

func createGpuInstance(device C.uintptr_t, profileID C.uint, placement *nvml.GpuInstancePlacement, out *C.uintptr_t) nvml.Return {
	if _, ret := lib.gpuOnly(handle(device)); ret != nvml.SUCCESS {
		return ret
	}
	if out == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return lib.mutate(func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		gi, ret := g.createGpuInstance(uint32(profileID), placement)
		if ret != nvml.SUCCESS {
			return ret
		}
		lib.makeCapNode(g.dev.Minor, gi.Info.Id, nil)
		return putHandle(out, g.giHandle(gi))
	})
}

//export nvmlDeviceCreateGpuInstance
func nvmlDeviceCreateGpuInstance(device C.uintptr_t, profileID C.uint, gpuInstance *C.uintptr_t) C.int {
	return session("nvmlDeviceCreateGpuInstance", func() nvml.Return {
		return createGpuInstance(device, profileID, nil, gpuInstance)
	})
}

//export nvmlDeviceCreateGpuInstanceWithPlacement
func nvmlDeviceCreateGpuInstanceWithPlacement(device C.uintptr_t, profileID C.uint, placement *C.uint, gpuInstance *C.uintptr_t) C.int {
	return session("nvmlDeviceCreateGpuInstanceWithPlacement", func() nvml.Return {
		if placement == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		pair := unsafe.Slice(placement, 2) // nvmlGpuInstancePlacement_t {start, size}
		wanted := nvml.GpuInstancePlacement{Start: uint32(pair[0]), Size: uint32(pair[1])}
		return createGpuInstance(device, profileID, &wanted, gpuInstance)
	})
}

//export nvmlGpuInstanceDestroy
func nvmlGpuInstanceDestroy(gpuInstance C.uintptr_t) C.int {
	return session("nvmlGpuInstanceDestroy", func() nvml.Return {
		if _, _, ret := lib.gpuInstance(handle(gpuInstance)); ret != nvml.SUCCESS {
			return ret
		}
		return lib.mutate(func() nvml.Return {
			g, gi, ret := lib.gpuInstance(handle(gpuInstance))
			if ret != nvml.SUCCESS {
				return ret
			}
			id := gi.Info.Id
			if ret := g.destroyGpuInstance(gi); ret != nvml.SUCCESS {
				return ret
			}
			lib.removeCapNode(g.dev.Minor, id, nil)
			return nvml.SUCCESS
		})
	})
}

//export nvmlDeviceGetGpuInstances
func nvmlDeviceGetGpuInstances(device C.uintptr_t, profileID C.uint, gpuInstances *C.uintptr_t, count *C.uint) C.int {
	return session("nvmlDeviceGetGpuInstances", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		if !g.migEnabled() {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if _, _, ok := g.giProfileByID(uint32(profileID)); !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if count == nil || gpuInstances == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		var list []*server.GpuInstance
		for _, gi := range g.gpuInstances() {
			if gi.Info.ProfileId == uint32(profileID) {
				list = append(list, gi)
			}
		}
		out := unsafe.Slice(gpuInstances, len(list))
		for i, gi := range list {
			out[i] = C.uintptr_t(g.giHandle(gi))
		}
		*count = C.uint(len(list))
		return nvml.SUCCESS
	})
}

//export nvmlDeviceGetGpuInstanceById
func nvmlDeviceGetGpuInstanceById(device C.uintptr_t, id C.uint, gpuInstance *C.uintptr_t) C.int {
	return session("nvmlDeviceGetGpuInstanceById", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		if !g.migEnabled() {
			return nvml.ERROR_NOT_SUPPORTED
		}
		gi := g.gpuInstanceByID(uint32(id))
		if gi == nil {
			return nvml.ERROR_NOT_FOUND
		}
		return putHandle(gpuInstance, g.giHandle(gi))
	})
}

//export nvmlGpuInstanceGetInfo
func nvmlGpuInstanceGetInfo(gpuInstance C.uintptr_t, info unsafe.Pointer) C.int {
	return session("nvmlGpuInstanceGetInfo", func() nvml.Return {
		g, gi, ret := lib.gpuInstance(handle(gpuInstance))
		if ret != nvml.SUCCESS {
			return ret
		}
		value, ret := gi.GetInfo()
		if ret != nvml.SUCCESS || info == nil {
			return orInvalid(ret)
		}
		writeGiInfo(info, g.handle(), value.Id, value.ProfileId, value.Placement)
		return nvml.SUCCESS
	})
}

// ---- compute instances ----

func ciProfileAt(gpuInstance C.uintptr_t, profile, engProfile C.uint) (*gpu, *server.GpuInstance, nvml.ComputeInstanceProfileInfo, nvml.Return) {
	g, gi, ret := lib.gpuInstance(handle(gpuInstance))
	if ret != nvml.SUCCESS {
		return nil, nil, nvml.ComputeInstanceProfileInfo{}, ret
	}
	info, ret := gi.GetComputeInstanceProfileInfo(int(profile), int(engProfile))
	return g, gi, info, ret
}

//export nvmlGpuInstanceGetComputeInstanceProfileInfo
func nvmlGpuInstanceGetComputeInstanceProfileInfo(gpuInstance C.uintptr_t, profile, engProfile C.uint, info unsafe.Pointer) C.int {
	return session("nvmlGpuInstanceGetComputeInstanceProfileInfo", func() nvml.Return {
		_, _, value, ret := ciProfileAt(gpuInstance, profile, engProfile)
		if ret != nvml.SUCCESS || info == nil {
			return orInvalid(ret)
		}
		writeCiProfileInfo(info, value)
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceGetComputeInstanceProfileInfoV
func nvmlGpuInstanceGetComputeInstanceProfileInfoV(gpuInstance C.uintptr_t, profile, engProfile C.uint, info unsafe.Pointer) C.int {
	return session("nvmlGpuInstanceGetComputeInstanceProfileInfoV", func() nvml.Return {
		g, gi, value, ret := ciProfileAt(gpuInstance, profile, engProfile)
		if ret != nvml.SUCCESS || info == nil {
			return orInvalid(ret)
		}
		index, giInfo, _ := g.giProfileByID(gi.Info.ProfileId)
		return writeCiProfileInfoV(info, value, "MIG "+g.profileName(index, giInfo, value.SliceCount))
	})
}

//export nvmlGpuInstanceGetComputeInstanceRemainingCapacity
func nvmlGpuInstanceGetComputeInstanceRemainingCapacity(gpuInstance C.uintptr_t, profileID C.uint, count *C.uint) C.int {
	return session("nvmlGpuInstanceGetComputeInstanceRemainingCapacity", func() nvml.Return {
		g, gi, ret := lib.gpuInstance(handle(gpuInstance))
		if ret != nvml.SUCCESS {
			return ret
		}
		info, ok := ciProfileByID(gi, uint32(profileID))
		if !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		_, giInfo, _ := g.giProfileByID(gi.Info.ProfileId)
		used, same := uint32(0), uint32(0)
		for ci := range gi.ComputeInstances {
			if existing, ok := ciProfileByID(gi, ci.Info.ProfileId); ok {
				used += existing.SliceCount
			}
			if ci.Info.ProfileId == uint32(profileID) {
				same++
			}
		}
		bySlices := (giInfo.SliceCount - min(used, giInfo.SliceCount)) / max(info.SliceCount, 1)
		return putUint(count, min(bySlices, info.InstanceCount-min(same, info.InstanceCount)))
	})
}

//export nvmlGpuInstanceGetComputeInstancePossiblePlacements
func nvmlGpuInstanceGetComputeInstancePossiblePlacements(gpuInstance C.uintptr_t, profileID C.uint, placements unsafe.Pointer, count *C.uint) C.int {
	return session("nvmlGpuInstanceGetComputeInstancePossiblePlacements", func() nvml.Return {
		_, gi, ret := lib.gpuInstance(handle(gpuInstance))
		if ret != nvml.SUCCESS {
			return ret
		}
		info, ok := ciProfileByID(gi, uint32(profileID))
		if !ok {
			return nvml.ERROR_NOT_SUPPORTED
		}
		if count == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		list, ret := gi.GetComputeInstancePossiblePlacements(&info)
		if ret != nvml.SUCCESS {
			return ret
		}
		if placements == nil {
			*count = C.uint(len(list))
			return nvml.SUCCESS
		}
		if int(*count) < len(list) {
			*count = C.uint(len(list))
			return nvml.ERROR_INSUFFICIENT_SIZE
		}
		writeCiPlacements(placements, list)
		*count = C.uint(len(list))
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceCreateComputeInstance
func nvmlGpuInstanceCreateComputeInstance(gpuInstance C.uintptr_t, profileID C.uint, computeInstance *C.uintptr_t) C.int {
	return session("nvmlGpuInstanceCreateComputeInstance", func() nvml.Return {
		if _, _, ret := lib.gpuInstance(handle(gpuInstance)); ret != nvml.SUCCESS {
			return ret
		}
		if computeInstance == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		return lib.mutate(func() nvml.Return {
			g, gi, ret := lib.gpuInstance(handle(gpuInstance))
			if ret != nvml.SUCCESS {
				return ret
			}
			ci, ret := g.createComputeInstance(gi, uint32(profileID))
			if ret != nvml.SUCCESS {
				return ret
			}
			id := ci.Info.Id
			lib.makeCapNode(g.dev.Minor, gi.Info.Id, nil)
			lib.makeCapNode(g.dev.Minor, gi.Info.Id, &id)
			return putHandle(computeInstance, g.ciHandle(gi, ci))
		})
	})
}

//export nvmlComputeInstanceDestroy
func nvmlComputeInstanceDestroy(computeInstance C.uintptr_t) C.int {
	return session("nvmlComputeInstanceDestroy", func() nvml.Return {
		if _, _, _, ret := lib.computeInstance(handle(computeInstance)); ret != nvml.SUCCESS {
			return ret
		}
		return lib.mutate(func() nvml.Return {
			g, gi, ci, ret := lib.computeInstance(handle(computeInstance))
			if ret != nvml.SUCCESS {
				return ret
			}
			id := ci.Info.Id
			if ret := g.destroyComputeInstance(gi, ci); ret != nvml.SUCCESS {
				return ret
			}
			lib.removeCapNode(g.dev.Minor, gi.Info.Id, &id)
			return nvml.SUCCESS
		})
	})
}

//export nvmlGpuInstanceGetComputeInstances
func nvmlGpuInstanceGetComputeInstances(gpuInstance C.uintptr_t, profileID C.uint, instances *C.uintptr_t, count *C.uint) C.int {
	return session("nvmlGpuInstanceGetComputeInstances", func() nvml.Return {
		g, gi, ret := lib.gpuInstance(handle(gpuInstance))
		if ret != nvml.SUCCESS {
			return ret
		}
		if _, ok := ciProfileByID(gi, uint32(profileID)); !ok {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		if count == nil || instances == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		var list []*server.ComputeInstance
		for _, ci := range computeInstances(gi) {
			if ci.Info.ProfileId == uint32(profileID) {
				list = append(list, ci)
			}
		}
		out := unsafe.Slice(instances, len(list))
		for i, ci := range list {
			out[i] = C.uintptr_t(g.ciHandle(gi, ci))
		}
		*count = C.uint(len(list))
		return nvml.SUCCESS
	})
}

//export nvmlGpuInstanceGetComputeInstanceById
func nvmlGpuInstanceGetComputeInstanceById(gpuInstance C.uintptr_t, id C.uint, computeInstance *C.uintptr_t) C.int {
	return session("nvmlGpuInstanceGetComputeInstanceById", func() nvml.Return {
		g, gi, ret := lib.gpuInstance(handle(gpuInstance))
		if ret != nvml.SUCCESS {
			return ret
		}
		ci := computeInstanceByID(gi, uint32(id))
		if ci == nil {
			return nvml.ERROR_NOT_FOUND
		}
		return putHandle(computeInstance, g.ciHandle(gi, ci))
	})
}

func computeInstanceInfo(computeInstance C.uintptr_t, info unsafe.Pointer) nvml.Return {
	g, gi, ci, ret := lib.computeInstance(handle(computeInstance))
	if ret != nvml.SUCCESS {
		return ret
	}
	value, ret := ci.GetInfo()
	if ret != nvml.SUCCESS || info == nil {
		return orInvalid(ret)
	}
	// The device of a compute instance is its MIG device (NVML; the DRA driver reads the MIG
	// UUID from it), not the parent GPU the mock records.
	writeCiInfo(info, g.migHandle(gi, ci), g.giHandle(gi), value.Id, value.ProfileId, value.Placement)
	return nvml.SUCCESS
}

//export nvmlComputeInstanceGetInfo_v2
func nvmlComputeInstanceGetInfo_v2(computeInstance C.uintptr_t, info unsafe.Pointer) C.int {
	return session("nvmlComputeInstanceGetInfo_v2", func() nvml.Return { return computeInstanceInfo(computeInstance, info) })
}

//export nvmlComputeInstanceGetInfo
func nvmlComputeInstanceGetInfo(computeInstance C.uintptr_t, info unsafe.Pointer) C.int {
	return session("nvmlComputeInstanceGetInfo", func() nvml.Return { return computeInstanceInfo(computeInstance, info) })
}

// ---- MIG devices ----

//export nvmlDeviceIsMigDeviceHandle
func nvmlDeviceIsMigDeviceHandle(device C.uintptr_t, isMig *C.uint) C.int {
	return session("nvmlDeviceIsMigDeviceHandle", func() nvml.Return {
		_, m, ret := lib.device(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		value := uint32(0)
		if m != nil {
			value = 1
		}
		return putUint(isMig, value)
	})
}

func migOnly(device C.uintptr_t) (*gpu, *migDevice, nvml.Return) {
	g, m, ret := lib.device(handle(device))
	if ret != nvml.SUCCESS {
		return nil, nil, ret
	}
	if m == nil {
		return nil, nil, nvml.ERROR_NOT_SUPPORTED
	}
	return g, m, nvml.SUCCESS
}

//export nvmlDeviceGetGpuInstanceId
func nvmlDeviceGetGpuInstanceId(device C.uintptr_t, id *C.uint) C.int {
	return session("nvmlDeviceGetGpuInstanceId", func() nvml.Return {
		_, m, ret := migOnly(device)
		if ret != nvml.SUCCESS {
			return ret
		}
		return putUint(id, m.gi.Info.Id)
	})
}

//export nvmlDeviceGetComputeInstanceId
func nvmlDeviceGetComputeInstanceId(device C.uintptr_t, id *C.uint) C.int {
	return session("nvmlDeviceGetComputeInstanceId", func() nvml.Return {
		_, m, ret := migOnly(device)
		if ret != nvml.SUCCESS {
			return ret
		}
		return putUint(id, m.ci.Info.Id)
	})
}

//export nvmlDeviceGetDeviceHandleFromMigDeviceHandle
func nvmlDeviceGetDeviceHandleFromMigDeviceHandle(migDevice C.uintptr_t, device *C.uintptr_t) C.int {
	return session("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", func() nvml.Return {
		g, _, ret := migOnly(migDevice)
		if ret != nvml.SUCCESS {
			return ret
		}
		return putHandle(device, g.handle())
	})
}

//export nvmlDeviceGetMaxMigDeviceCount
func nvmlDeviceGetMaxMigDeviceCount(device C.uintptr_t, count *C.uint) C.int {
	return session("nvmlDeviceGetMaxMigDeviceCount", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		return putUint(count, g.maxMigDevices())
	})
}

//export nvmlDeviceGetMigDeviceHandleByIndex
func nvmlDeviceGetMigDeviceHandleByIndex(device C.uintptr_t, index C.uint, migDevice *C.uintptr_t) C.int {
	return session("nvmlDeviceGetMigDeviceHandleByIndex", func() nvml.Return {
		g, ret := lib.gpuOnly(handle(device))
		if ret != nvml.SUCCESS {
			return ret
		}
		if uint32(index) >= g.maxMigDevices() {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		list := lib.migDevices(g)
		if int(index) >= len(list) {
			return nvml.ERROR_NOT_FOUND
		}
		m := list[index]
		return putHandle(migDevice, g.migHandle(m.gi, m.ci))
	})
}

//export nvmlDeviceGetAttributes_v2
func nvmlDeviceGetAttributes_v2(device C.uintptr_t, attributes unsafe.Pointer) C.int {
	return session("nvmlDeviceGetAttributes_v2", func() nvml.Return {
		g, m, ret := migOnly(device)
		if ret != nvml.SUCCESS {
			return ret
		}
		if attributes == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
		_, giInfo, _ := g.giProfileByID(m.gi.Info.ProfileId)
		ciInfo, _ := ciProfileByID(m.gi, m.ci.Info.ProfileId)
		writeAttributes(attributes, giInfo, ciInfo)
		return nvml.SUCCESS
	})
}

func orInvalid(ret nvml.Return) nvml.Return {
	if ret != nvml.SUCCESS {
		return ret
	}
	return nvml.ERROR_INVALID_ARGUMENT
}

// ---- return codes ----

// errorStrings are nvmlErrorString's texts: those pynvml carries for the real library, the two
// the reference quotes from nvidia-smi (IN_USE, INSUFFICIENT_RESOURCES), and for the rest the
// code's name in words.
var errorStrings = map[nvml.Return]string{
	nvml.SUCCESS:                         "Success",
	nvml.ERROR_UNINITIALIZED:             "Uninitialized",
	nvml.ERROR_INVALID_ARGUMENT:          "Invalid Argument",
	nvml.ERROR_NOT_SUPPORTED:             "Not Supported",
	nvml.ERROR_NO_PERMISSION:             "Insufficient Permissions",
	nvml.ERROR_ALREADY_INITIALIZED:       "Already Initialized",
	nvml.ERROR_NOT_FOUND:                 "Not Found",
	nvml.ERROR_INSUFFICIENT_SIZE:         "Insufficient Size",
	nvml.ERROR_INSUFFICIENT_POWER:        "Insufficient External Power",
	nvml.ERROR_DRIVER_NOT_LOADED:         "Driver Not Loaded",
	nvml.ERROR_TIMEOUT:                   "Timeout",
	nvml.ERROR_IRQ_ISSUE:                 "Interrupt Request Issue",
	nvml.ERROR_LIBRARY_NOT_FOUND:         "NVML Shared Library Not Found",
	nvml.ERROR_FUNCTION_NOT_FOUND:        "Function Not Found",
	nvml.ERROR_CORRUPTED_INFOROM:         "Corrupted infoROM",
	nvml.ERROR_GPU_IS_LOST:               "GPU is lost",
	nvml.ERROR_RESET_REQUIRED:            "GPU requires restart",
	nvml.ERROR_OPERATING_SYSTEM:          "The operating system has blocked the request.",
	nvml.ERROR_LIB_RM_VERSION_MISMATCH:   "RM has detected an NVML/RM version mismatch.",
	nvml.ERROR_IN_USE:                    "In use by another client",
	nvml.ERROR_MEMORY:                    "Insufficient Memory",
	nvml.ERROR_NO_DATA:                   "No data",
	nvml.ERROR_VGPU_ECC_NOT_SUPPORTED:    "vGPU ECC not supported",
	nvml.ERROR_INSUFFICIENT_RESOURCES:    "Insufficient Resources",
	nvml.ERROR_FREQ_NOT_SUPPORTED:        "Frequency not supported",
	nvml.ERROR_ARGUMENT_VERSION_MISMATCH: "Argument version mismatch",
	nvml.ERROR_DEPRECATED:                "Deprecated",
	nvml.ERROR_NOT_READY:                 "Not ready",
	nvml.ERROR_GPU_NOT_FOUND:             "GPU not found",
	nvml.ERROR_INVALID_STATE:             "Invalid state",
	nvml.ERROR_RESET_TYPE_NOT_SUPPORTED:  "Reset type not supported",
	nvml.ERROR_UNKNOWN:                   "Unknown Error",
}

var errorCStrings = map[nvml.Return]*C.char{}

// errorCString returns a C string that lives as long as the process (NVML's are static too).
func errorCString(ret nvml.Return) *C.char {
	lib.mu.Lock()
	defer lib.mu.Unlock()
	text, ok := errorStrings[ret]
	if !ok {
		ret, text = nvml.ERROR_UNKNOWN, errorStrings[nvml.ERROR_UNKNOWN]
	}
	if cached, ok := errorCStrings[ret]; ok {
		return cached
	}
	cached := C.CString(text)
	errorCStrings[ret] = cached
	return cached
}

// returnName is the NVML_* name of a return code, for traces and logs.
func returnName(ret nvml.Return) string {
	if ret == nvml.SUCCESS {
		return "NVML_SUCCESS"
	}
	if text, ok := errorStrings[ret]; ok {
		return "NVML_" + strings.ToUpper(strings.ReplaceAll(ret.Error(), " ", "_")) + " (" + text + ")"
	}
	return "NVML return " + ret.Error()
}
