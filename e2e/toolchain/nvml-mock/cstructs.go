package main

// Writers of nvml.h's structs. Only this file includes nvml.h (through nvml_mock_api.h): exports.go declares the NVML
// functions with plain C types (handles as uintptr_t, structs as void*), which nvml.h's own
// prototypes would contradict.

/*
#cgo CFLAGS: -DNVML_NO_UNVERSIONED_FUNC_DEFS=1
#include <stdint.h>
#include <stdlib.h>
#include "nvml_mock_api.h"

static void nvml_mock_gi_info(nvmlGpuInstanceInfo_t *info, uintptr_t device, unsigned int id,
		unsigned int profileId, unsigned int start, unsigned int size) {
	info->device = (nvmlDevice_t)device;
	info->id = id;
	info->profileId = profileId;
	info->placement.start = start;
	info->placement.size = size;
}

static void nvml_mock_ci_info(nvmlComputeInstanceInfo_t *info, uintptr_t device,
		uintptr_t gpuInstance, unsigned int id, unsigned int profileId, unsigned int start,
		unsigned int size) {
	info->device = (nvmlDevice_t)device;
	info->gpuInstance = (nvmlGpuInstance_t)gpuInstance;
	info->id = id;
	info->profileId = profileId;
	info->placement.start = start;
	info->placement.size = size;
}
*/
import "C"

import (
	"unsafe"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Struct version words (NVML_STRUCT_VERSION: size | version << 24) the V functions accept.
var (
	memoryV2Version        = structVersion(C.sizeof_nvmlMemory_v2_t, 2)
	giProfileInfoV2Version = structVersion(C.sizeof_nvmlGpuInstanceProfileInfo_v2_t, 2)
	giProfileInfoV3Version = structVersion(C.sizeof_nvmlGpuInstanceProfileInfo_v3_t, 3)
	ciProfileInfoV2Version = structVersion(C.sizeof_nvmlComputeInstanceProfileInfo_v2_t, 2)
	ciProfileInfoV3Version = structVersion(C.sizeof_nvmlComputeInstanceProfileInfo_v3_t, 3)
)

// getenv reads the process's environment as it is now. Go's os.Getenv reads a copy taken
// when the library was loaded, which misses what the host program set since (Python's
// os.environ, for one).
func getenv(name string) string {
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	value := C.getenv(cname)
	if value == nil {
		return ""
	}
	return C.GoString(value)
}

func structVersion(size C.size_t, version uint32) uint32 {
	return uint32(size) | version<<24
}

// setChars writes s, NUL-terminated and truncated to fit, into a C char array.
func setChars(dst []C.char, s string) {
	n := min(len(s), len(dst)-1)
	for i := 0; i < n; i++ {
		dst[i] = C.char(s[i])
	}
	dst[n] = 0
}

func writePciInfo(p unsafe.Pointer, pci pciAddress, deviceID uint32) {
	info := (*C.nvmlPciInfo_t)(p)
	*info = C.nvmlPciInfo_t{}
	setChars(info.busIdLegacy[:], pci.legacy())
	setChars(info.busId[:], pci.busID())
	info.domain = C.uint(pci.domain)
	info.bus = C.uint(pci.bus)
	info.device = C.uint(pci.device)
	info.pciDeviceId = C.uint(deviceID)
}

func writeMemory(p unsafe.Pointer, m nvml.Memory) {
	info := (*C.nvmlMemory_t)(p)
	info.total = C.ulonglong(m.Total)
	info.free = C.ulonglong(m.Free)
	info.used = C.ulonglong(m.Used)
}

// writeMemoryV2 fills an nvmlMemory_v2_t whose version word the caller set.
func writeMemoryV2(p unsafe.Pointer, m nvml.Memory) nvml.Return {
	info := (*C.nvmlMemory_v2_t)(p)
	if uint32(info.version) != memoryV2Version {
		return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
	}
	info.total = C.ulonglong(m.Total)
	info.reserved = 0
	info.free = C.ulonglong(m.Free)
	info.used = C.ulonglong(m.Used)
	return nvml.SUCCESS
}

func writeGiProfileInfo(p unsafe.Pointer, info nvml.GpuInstanceProfileInfo) {
	out := (*C.nvmlGpuInstanceProfileInfo_t)(p)
	out.id = C.uint(info.Id)
	out.isP2pSupported = C.uint(info.IsP2pSupported)
	out.sliceCount = C.uint(info.SliceCount)
	out.instanceCount = C.uint(info.InstanceCount)
	out.multiprocessorCount = C.uint(info.MultiprocessorCount)
	out.copyEngineCount = C.uint(info.CopyEngineCount)
	out.decoderCount = C.uint(info.DecoderCount)
	out.encoderCount = C.uint(info.EncoderCount)
	out.jpegCount = C.uint(info.JpegCount)
	out.ofaCount = C.uint(info.OfaCount)
	out.memorySizeMB = C.ulonglong(info.MemorySizeMB)
}

// writeGiProfileInfoV fills a v2 or v3 struct, as its version word says.
func writeGiProfileInfoV(p unsafe.Pointer, info nvml.GpuInstanceProfileInfo, name string) nvml.Return {
	switch uint32((*C.nvmlGpuInstanceProfileInfo_v2_t)(p).version) {
	case giProfileInfoV2Version:
		out := (*C.nvmlGpuInstanceProfileInfo_v2_t)(p)
		out.id = C.uint(info.Id)
		out.isP2pSupported = C.uint(info.IsP2pSupported)
		out.sliceCount = C.uint(info.SliceCount)
		out.instanceCount = C.uint(info.InstanceCount)
		out.multiprocessorCount = C.uint(info.MultiprocessorCount)
		out.copyEngineCount = C.uint(info.CopyEngineCount)
		out.decoderCount = C.uint(info.DecoderCount)
		out.encoderCount = C.uint(info.EncoderCount)
		out.jpegCount = C.uint(info.JpegCount)
		out.ofaCount = C.uint(info.OfaCount)
		out.memorySizeMB = C.ulonglong(info.MemorySizeMB)
		setChars(out.name[:], name)
	case giProfileInfoV3Version:
		out := (*C.nvmlGpuInstanceProfileInfo_v3_t)(p)
		out.id = C.uint(info.Id)
		out.sliceCount = C.uint(info.SliceCount)
		out.instanceCount = C.uint(info.InstanceCount)
		out.multiprocessorCount = C.uint(info.MultiprocessorCount)
		out.copyEngineCount = C.uint(info.CopyEngineCount)
		out.decoderCount = C.uint(info.DecoderCount)
		out.encoderCount = C.uint(info.EncoderCount)
		out.jpegCount = C.uint(info.JpegCount)
		out.ofaCount = C.uint(info.OfaCount)
		out.memorySizeMB = C.ulonglong(info.MemorySizeMB)
		setChars(out.name[:], name)
		out.capabilities = 0
		if info.IsP2pSupported != 0 {
			out.capabilities = C.NVML_GPU_INSTANCE_PROFILE_CAPS_P2P
		}
	default:
		return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
	}
	return nvml.SUCCESS
}

func writeCiProfileInfo(p unsafe.Pointer, info nvml.ComputeInstanceProfileInfo) {
	out := (*C.nvmlComputeInstanceProfileInfo_t)(p)
	out.id = C.uint(info.Id)
	out.sliceCount = C.uint(info.SliceCount)
	out.instanceCount = C.uint(info.InstanceCount)
	out.multiprocessorCount = C.uint(info.MultiprocessorCount)
	out.sharedCopyEngineCount = C.uint(info.SharedCopyEngineCount)
	out.sharedDecoderCount = C.uint(info.SharedDecoderCount)
	out.sharedEncoderCount = C.uint(info.SharedEncoderCount)
	out.sharedJpegCount = C.uint(info.SharedJpegCount)
	out.sharedOfaCount = C.uint(info.SharedOfaCount)
}

func writeCiProfileInfoV(p unsafe.Pointer, info nvml.ComputeInstanceProfileInfo, name string) nvml.Return {
	switch uint32((*C.nvmlComputeInstanceProfileInfo_v2_t)(p).version) {
	case ciProfileInfoV2Version:
		out := (*C.nvmlComputeInstanceProfileInfo_v2_t)(p)
		out.id = C.uint(info.Id)
		out.sliceCount = C.uint(info.SliceCount)
		out.instanceCount = C.uint(info.InstanceCount)
		out.multiprocessorCount = C.uint(info.MultiprocessorCount)
		out.sharedCopyEngineCount = C.uint(info.SharedCopyEngineCount)
		out.sharedDecoderCount = C.uint(info.SharedDecoderCount)
		out.sharedEncoderCount = C.uint(info.SharedEncoderCount)
		out.sharedJpegCount = C.uint(info.SharedJpegCount)
		out.sharedOfaCount = C.uint(info.SharedOfaCount)
		setChars(out.name[:], name)
	case ciProfileInfoV3Version:
		out := (*C.nvmlComputeInstanceProfileInfo_v3_t)(p)
		out.id = C.uint(info.Id)
		out.sliceCount = C.uint(info.SliceCount)
		out.instanceCount = C.uint(info.InstanceCount)
		out.multiprocessorCount = C.uint(info.MultiprocessorCount)
		out.sharedCopyEngineCount = C.uint(info.SharedCopyEngineCount)
		out.sharedDecoderCount = C.uint(info.SharedDecoderCount)
		out.sharedEncoderCount = C.uint(info.SharedEncoderCount)
		out.sharedJpegCount = C.uint(info.SharedJpegCount)
		out.sharedOfaCount = C.uint(info.SharedOfaCount)
		setChars(out.name[:], name)
		out.capabilities = 0
	default:
		return nvml.ERROR_ARGUMENT_VERSION_MISMATCH
	}
	return nvml.SUCCESS
}

func writeGiInfo(p unsafe.Pointer, device handle, id, profileID uint32, placement nvml.GpuInstancePlacement) {
	C.nvml_mock_gi_info((*C.nvmlGpuInstanceInfo_t)(p), C.uintptr_t(device), C.uint(id),
		C.uint(profileID), C.uint(placement.Start), C.uint(placement.Size))
}

func writeCiInfo(p unsafe.Pointer, device, gpuInstance handle, id, profileID uint32, placement nvml.ComputeInstancePlacement) {
	C.nvml_mock_ci_info((*C.nvmlComputeInstanceInfo_t)(p), C.uintptr_t(device),
		C.uintptr_t(gpuInstance), C.uint(id), C.uint(profileID), C.uint(placement.Start),
		C.uint(placement.Size))
}

func writeGiPlacements(p unsafe.Pointer, placements []nvml.GpuInstancePlacement) {
	out := unsafe.Slice((*C.nvmlGpuInstancePlacement_t)(p), len(placements))
	for i, placement := range placements {
		out[i].start = C.uint(placement.Start)
		out[i].size = C.uint(placement.Size)
	}
}

func writeCiPlacements(p unsafe.Pointer, placements []nvml.ComputeInstancePlacement) {
	out := unsafe.Slice((*C.nvmlComputeInstancePlacement_t)(p), len(placements))
	for i, placement := range placements {
		out[i].start = C.uint(placement.Start)
		out[i].size = C.uint(placement.Size)
	}
}

// writeAttributes fills nvmlDeviceAttributes_t (nvmlDeviceGetAttributes_v2).
func writeAttributes(p unsafe.Pointer, gi nvml.GpuInstanceProfileInfo, ci nvml.ComputeInstanceProfileInfo) {
	out := (*C.nvmlDeviceAttributes_t)(p)
	out.multiprocessorCount = C.uint(ci.MultiprocessorCount)
	out.sharedCopyEngineCount = C.uint(gi.CopyEngineCount)
	out.sharedDecoderCount = C.uint(gi.DecoderCount)
	out.sharedEncoderCount = C.uint(gi.EncoderCount)
	out.sharedJpegCount = C.uint(gi.JpegCount)
	out.sharedOfaCount = C.uint(gi.OfaCount)
	out.gpuInstanceSliceCount = C.uint(gi.SliceCount)
	out.computeInstanceSliceCount = C.uint(ci.SliceCount)
	out.memorySizeMB = C.ulonglong(gi.MemorySizeMB)
}

// readSetMemoryLimits reads an nvmlSetMemoryLimits_v1_t (ok false: no cgroup path).
func readSetMemoryLimits(p unsafe.Pointer) (cgroup string, soft, hard uint64, ok bool) {
	in := (*C.nvmlSetMemoryLimits_v1_t)(p)
	if in.nameSpace == nil {
		return "", 0, 0, false
	}
	return C.GoString(in.nameSpace), uint64(in.softLimit), uint64(in.hardLimit), true
}

// getMemoryLimitsCgroup is the cgroup path of an nvmlGetMemoryLimits_v1_t (ok false: none).
func getMemoryLimitsCgroup(p unsafe.Pointer) (string, bool) {
	in := (*C.nvmlGetMemoryLimits_v1_t)(p)
	if in.nameSpace == nil {
		return "", false
	}
	return C.GoString(in.nameSpace), true
}

// writeGetMemoryLimits fills the outputs of an nvmlGetMemoryLimits_v1_t (the mock allocates
// nothing: currentUsed 0).
func writeGetMemoryLimits(p unsafe.Pointer, soft, hard uint64) {
	out := (*C.nvmlGetMemoryLimits_v1_t)(p)
	out.softLimit = C.ulonglong(soft)
	out.hardLimit = C.ulonglong(hard)
	out.currentUsed = 0
}
