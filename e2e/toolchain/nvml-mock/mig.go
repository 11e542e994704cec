package main

import (
	"fmt"
	"math"
	"sort"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// MIG on top of go-nvml's mock. The mock creates and destroys the instances; in front of it
// the library adds what the real driver refuses and the mock does not check (reference:
// shared/reference/gpu-hardware.md section 3.4), so that clients see NVML's return codes:
//   - creating a GPU instance needs MIG mode on (NOT_SUPPORTED), a profile ID of the GPU
//     (INVALID_ARGUMENT), one of the profile's possible placements (INVALID_ARGUMENT), free
//     slices and fewer than instanceCount instances of the profile (INSUFFICIENT_RESOURCES);
//   - a GPU instance with compute instances cannot be destroyed (IN_USE), nor MIG mode turned
//     off while GPU instances exist (IN_USE);
//   - a compute instance needs a profile of its GPU instance (INVALID_ARGUMENT) and free slices
//     (INSUFFICIENT_RESOURCES).
// Instance ids are the lowest free ones (GPU instances 0..14, compute instances 0..7, the
// ranges of the driver's capability files) instead of the mock's ever-growing counters.

const (
	maxGpuInstanceID     = 14
	maxComputeInstanceID = 7
)

// giProfiles maps each GPU-instance profile index (NVML_GPU_INSTANCE_PROFILE_*) of the GPU to
// its info, as the mock's GetGpuInstanceProfileInfo answers it.
func (g *gpu) giProfiles() map[int]nvml.GpuInstanceProfileInfo {
	return g.dev.Config.MIGProfiles.GpuInstanceProfiles
}

func (g *gpu) giProfileByID(id uint32) (int, nvml.GpuInstanceProfileInfo, bool) {
	indexes := make([]int, 0, len(g.giProfiles()))
	for index := range g.giProfiles() {
		indexes = append(indexes, index)
	}
	sort.Ints(indexes)
	for _, index := range indexes {
		if info := g.giProfiles()[index]; info.Id == id {
			return index, info, true
		}
	}
	return 0, nvml.GpuInstanceProfileInfo{}, false
}

func ciProfileByID(gi *server.GpuInstance, id uint32) (nvml.ComputeInstanceProfileInfo, bool) {
	for _, info := range gi.MIGProfiles.ComputeInstanceProfiles[int(gi.Info.ProfileId)] {
		if info.Id == id {
			return info, true
		}
	}
	return nvml.ComputeInstanceProfileInfo{}, false
}

func (g *gpu) migEnabled() bool { return g.dev.MigMode == nvml.DEVICE_MIG_ENABLE }

// profileGB is go-nvlib's profile-name memory size: the profile's share of the GPU's memory,
// rounded up to eighths, times the GPU's memory in whole GiB.
func profileGB(totalBytes, memorySizeMB uint64) uint64 {
	const eighths = 8
	fraction := float64(memorySizeMB) * 1024 * 1024 / float64(totalBytes)
	fraction = math.Ceil(fraction*eighths) / eighths
	totalGB := float64((totalBytes + (1 << 30) - 1) >> 30)
	return uint64(math.Round(fraction * totalGB))
}

// profileSuffix is the name suffix of a GPU-instance profile index (nvml.h, go-nvlib).
func profileSuffix(index int) string {
	switch index {
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1:
		return "+me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
		return "+me.all"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_2_SLICE_GFX,
		nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_4_SLICE_GFX:
		return "+gfx"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_NO_ME:
		return "-me"
	}
	return ""
}

// profileName is "1g.10gb", or "1c.3g.20gb" for a compute instance smaller than its GPU
// instance (ciSlices 0: the whole GPU instance).
func (g *gpu) profileName(index int, info nvml.GpuInstanceProfileInfo, ciSlices uint32) string {
	gb := profileGB(g.dev.MemoryInfo.Total, info.MemorySizeMB)
	name := fmt.Sprintf("%dg.%dgb%s", info.SliceCount, gb, profileSuffix(index))
	if ciSlices != 0 && ciSlices != info.SliceCount {
		name = fmt.Sprintf("%dc.%s", ciSlices, name)
	}
	return name
}

// refusal is why a GPU instance of info cannot go at placement now, or SUCCESS.
func (g *gpu) refusal(info nvml.GpuInstanceProfileInfo, placement nvml.GpuInstancePlacement) nvml.Return {
	same := uint32(0)
	for gi := range g.dev.GpuInstances {
		taken := gi.Info.Placement
		if placement.Start < taken.Start+taken.Size && taken.Start < placement.Start+placement.Size {
			return nvml.ERROR_INSUFFICIENT_RESOURCES
		}
		if gi.Info.ProfileId == info.Id {
			same++
		}
	}
	if same >= info.InstanceCount {
		return nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return nvml.SUCCESS
}

// choosePlacement is where a GPU instance created without a placement goes: the highest free
// start, as the real driver chooses (the MIG guide's 19,19,14,9 example).
func (g *gpu) choosePlacement(info nvml.GpuInstanceProfileInfo) (nvml.GpuInstancePlacement, bool) {
	placements, _ := g.dev.GetGpuInstancePossiblePlacements(&info)
	sorted := append([]nvml.GpuInstancePlacement(nil), placements...)
	sort.Slice(sorted, func(i, j int) bool { return sorted[i].Start > sorted[j].Start })
	for _, placement := range sorted {
		if g.refusal(info, placement) == nvml.SUCCESS {
			return placement, true
		}
	}
	return nvml.GpuInstancePlacement{}, false
}

func (g *gpu) remainingCapacity(info nvml.GpuInstanceProfileInfo) uint32 {
	var created []*server.GpuInstance
	defer func() {
		for _, gi := range created {
			delete(g.dev.GpuInstances, gi)
		}
	}()
	count := uint32(0)
	for {
		placement, ok := g.choosePlacement(info)
		if !ok {
			return count
		}
		trial := &server.GpuInstance{Info: nvml.GpuInstanceInfo{ProfileId: info.Id, Placement: placement}}
		g.dev.GpuInstances[trial] = struct{}{}
		created = append(created, trial)
		count++
	}
}

func (g *gpu) createGpuInstance(profileID uint32, placement *nvml.GpuInstancePlacement) (*server.GpuInstance, nvml.Return) {
	if !g.migEnabled() {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	_, info, ok := g.giProfileByID(profileID)
	if !ok {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	var chosen nvml.GpuInstancePlacement
	if placement != nil {
		possible, _ := g.dev.GetGpuInstancePossiblePlacements(&info)
		valid := false
		for _, p := range possible {
			valid = valid || p == *placement
		}
		if !valid {
			return nil, nvml.ERROR_INVALID_ARGUMENT
		}
		if ret := g.refusal(info, *placement); ret != nvml.SUCCESS {
			return nil, ret
		}
		chosen = *placement
	} else {
		var found bool
		if chosen, found = g.choosePlacement(info); !found {
			return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
		}
	}
	id, ok := lowestFree(maxGpuInstanceID, func(id uint32) bool { return g.gpuInstanceByID(id) != nil })
	if !ok {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	g.dev.GpuInstanceCounter = id
	created, ret := g.dev.CreateGpuInstanceWithPlacement(&info, &chosen)
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	return created.(*server.GpuInstance), nvml.SUCCESS
}

func (g *gpu) destroyGpuInstance(gi *server.GpuInstance) nvml.Return {
	if len(gi.ComputeInstances) > 0 {
		return nvml.ERROR_IN_USE
	}
	return gi.Destroy()
}

func (g *gpu) createComputeInstance(gi *server.GpuInstance, profileID uint32) (*server.ComputeInstance, nvml.Return) {
	info, ok := ciProfileByID(gi, profileID)
	if !ok {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	_, giInfo, _ := g.giProfileByID(gi.Info.ProfileId)
	used, same := uint32(0), uint32(0)
	for ci := range gi.ComputeInstances {
		if existing, ok := ciProfileByID(gi, ci.Info.ProfileId); ok {
			used += existing.SliceCount
		}
		if ci.Info.ProfileId == profileID {
			same++
		}
	}
	if used+info.SliceCount > giInfo.SliceCount || same >= info.InstanceCount {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	id, ok := lowestFree(maxComputeInstanceID, func(id uint32) bool { return computeInstanceByID(gi, id) != nil })
	if !ok {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	gi.ComputeInstanceCounter = id
	created, ret := gi.CreateComputeInstance(&info)
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	g.migUUIDs[instanceKey{gi.Info.Id, id}] = newMigUUID(g.dev.UUID, gi.Info.Id, id)
	return created.(*server.ComputeInstance), nvml.SUCCESS
}

func (g *gpu) destroyComputeInstance(gi *server.GpuInstance, ci *server.ComputeInstance) nvml.Return {
	ret := ci.Destroy()
	if ret == nvml.SUCCESS {
		delete(g.migUUIDs, instanceKey{gi.Info.Id, ci.Info.Id})
	}
	return ret
}

func (g *gpu) setMigMode(mode int) (nvml.Return, nvml.Return) {
	if mode != nvml.DEVICE_MIG_ENABLE && mode != nvml.DEVICE_MIG_DISABLE {
		return nvml.SUCCESS, nvml.ERROR_INVALID_ARGUMENT
	}
	if mode == nvml.DEVICE_MIG_DISABLE && len(g.dev.GpuInstances) > 0 {
		return nvml.SUCCESS, nvml.ERROR_IN_USE
	}
	return g.dev.SetMigMode(mode)
}

func lowestFree(limit uint32, taken func(uint32) bool) (uint32, bool) {
	for id := uint32(0); id <= limit; id++ {
		if !taken(id) {
			return id, true
		}
	}
	return 0, false
}

// migDevice is one MIG device: a compute instance of a GPU instance.
type migDevice struct {
	gi *server.GpuInstance
	ci *server.ComputeInstance
}

func (g *gpu) migDevice(gi, ci uint32) *migDevice {
	instance := g.gpuInstanceByID(gi)
	if instance == nil {
		return nil
	}
	compute := computeInstanceByID(instance, ci)
	if compute == nil {
		return nil
	}
	return &migDevice{instance, compute}
}

// migDevices lists the MIG devices whose capability nodes exist, by (GI id, CI id).
func (l *library) migDevices(g *gpu) []*migDevice {
	var list []*migDevice
	if !g.migEnabled() {
		return list
	}
	for _, gi := range g.gpuInstances() {
		if !l.capNodeExists(migCapMinor(g.dev.Minor, gi.Info.Id, nil)) {
			continue
		}
		for _, ci := range computeInstances(gi) {
			id := ci.Info.Id
			if l.capNodeExists(migCapMinor(g.dev.Minor, gi.Info.Id, &id)) {
				list = append(list, &migDevice{gi, ci})
			}
		}
	}
	return list
}

// maxMigDevices is nvmlDeviceGetMaxMigDeviceCount: 0 with MIG off, else the most instances
// any GPU-instance profile allows (7 on these GPUs).
func (g *gpu) maxMigDevices() uint32 {
	if !g.migEnabled() {
		return 0
	}
	most := uint32(0)
	for _, info := range g.giProfiles() {
		most = max(most, info.InstanceCount)
	}
	return most
}

func (g *gpu) migName(m *migDevice) string {
	index, info, _ := g.giProfileByID(m.gi.Info.ProfileId)
	ciInfo, _ := ciProfileByID(m.gi, m.ci.Info.ProfileId)
	return g.dev.Config.Name + " MIG " + g.profileName(index, info, ciInfo.SliceCount)
}

func (g *gpu) migMemory(m *migDevice) nvml.Memory {
	_, info, _ := g.giProfileByID(m.gi.Info.ProfileId)
	total := info.MemorySizeMB * 1024 * 1024
	return nvml.Memory{Total: total, Free: total, Used: 0}
}
