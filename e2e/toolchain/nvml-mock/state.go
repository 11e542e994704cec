package main

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

// stateDoc is the JSON state file (GPU_DRA_NVML_MOCK_STATE): the machine, and per GPU (in the
// mock server's order) its MIG mode, compute mode and MIG instances. The UUIDs of the GPUs
// are written for readers; the library derives them from machine and index.
type stateDoc struct {
	Machine string `json:"machine"`
	// Driver is GPU_DRA_NVML_MOCK_DRIVER's value when the file was made ("" for the mock
	// server's driver; left out then, so that files stay as they were without the setting).
	Driver string     `json:"driver,omitempty"`
	GPUs   []gpuState `json:"gpus"`
}

type gpuState struct {
	UUID         string    `json:"uuid"`
	Minor        int       `json:"minor"`
	MigMode      int       `json:"migMode"`
	ComputeMode  int       `json:"computeMode"`
	GpuInstances []giState `json:"gpuInstances"`
	// MemoryLimits: the GPU memory limits set per cgroup (nvmlDeviceSetMemoryLimits_v1).
	MemoryLimits []limitState `json:"memoryLimits,omitempty"`
}

type limitState struct {
	Cgroup string `json:"cgroup"`
	Soft   uint64 `json:"softLimit"`
	Hard   uint64 `json:"hardLimit"`
}

type giState struct {
	ID               uint32    `json:"id"`
	ProfileID        uint32    `json:"profileId"`
	Start            uint32    `json:"start"`
	Size             uint32    `json:"size"`
	ComputeInstances []ciState `json:"computeInstances"`
}

type ciState struct {
	ID        uint32 `json:"id"`
	ProfileID uint32 `json:"profileId"`
	UUID      string `json:"uuid"`
}

// fileStamp tells whether the state file changed since it was read (it is replaced by rename).
type fileStamp struct {
	inode uint64
	mtime int64
	size  int64
}

func stampOf(info os.FileInfo) fileStamp {
	stamp := fileStamp{mtime: info.ModTime().UnixNano(), size: info.Size()}
	if sys, ok := info.Sys().(*syscall.Stat_t); ok {
		stamp.inode = sys.Ino
	}
	return stamp
}

func statStamp(path string) (fileStamp, error) {
	info, err := os.Stat(path)
	if err != nil {
		return fileStamp{}, err
	}
	return stampOf(info), nil
}

func readState(path string) (*stateDoc, fileStamp, error) {
	file, err := os.Open(path)
	if err != nil {
		return nil, fileStamp{}, err
	}
	defer file.Close()
	info, err := file.Stat()
	if err != nil {
		return nil, fileStamp{}, err
	}
	var doc stateDoc
	if err := json.NewDecoder(file).Decode(&doc); err != nil {
		return nil, fileStamp{}, fmt.Errorf("state file %s: %w", path, err)
	}
	return &doc, stampOf(info), nil
}

// writeState replaces the state file atomically (a temporary file renamed over it).
func writeState(path string, doc *stateDoc) (fileStamp, error) {
	data, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return fileStamp{}, err
	}
	temp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.tmp")
	if err != nil {
		return fileStamp{}, fmt.Errorf("state file %s: %w", path, err)
	}
	defer os.Remove(temp.Name())
	if _, err := temp.Write(append(data, '\n')); err != nil {
		temp.Close()
		return fileStamp{}, fmt.Errorf("state file %s: %w", path, err)
	}
	if err := temp.Chmod(0o644); err != nil {
		temp.Close()
		return fileStamp{}, err
	}
	if err := temp.Close(); err != nil {
		return fileStamp{}, err
	}
	if err := os.Rename(temp.Name(), path); err != nil {
		return fileStamp{}, fmt.Errorf("state file %s: %w", path, err)
	}
	return statStamp(path)
}

// lockState takes the exclusive flock of <path>.lock that every change of the state holds.
func lockState(path string) (func(), error) {
	file, err := os.OpenFile(path+".lock", os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, fmt.Errorf("cannot lock the state file: %w", err)
	}
	if err := syscall.Flock(int(file.Fd()), syscall.LOCK_EX); err != nil {
		file.Close()
		return nil, fmt.Errorf("cannot lock the state file %s: %w", path, err)
	}
	return func() {
		_ = syscall.Flock(int(file.Fd()), syscall.LOCK_UN)
		file.Close()
	}, nil
}

func (g *gpu) snapshot() gpuState {
	saved := gpuState{
		UUID:         g.dev.UUID,
		Minor:        g.dev.Minor,
		MigMode:      g.dev.MigMode,
		ComputeMode:  g.computeMode,
		GpuInstances: []giState{},
	}
	for _, gi := range g.gpuInstances() {
		savedGI := giState{
			ID:               gi.Info.Id,
			ProfileID:        gi.Info.ProfileId,
			Start:            gi.Info.Placement.Start,
			Size:             gi.Info.Placement.Size,
			ComputeInstances: []ciState{},
		}
		for _, ci := range computeInstances(gi) {
			savedGI.ComputeInstances = append(savedGI.ComputeInstances, ciState{
				ID:        ci.Info.Id,
				ProfileID: ci.Info.ProfileId,
				UUID:      g.migUUIDs[instanceKey{gi.Info.Id, ci.Info.Id}],
			})
		}
		saved.GpuInstances = append(saved.GpuInstances, savedGI)
	}
	saved.MemoryLimits = g.limitStates()
	return saved
}

// replay recreates a saved GPU through the mock's own functions (SetMigMode,
// CreateGpuInstanceWithPlacement, CreateComputeInstance), each instance with its saved id.
func (g *gpu) replay(saved gpuState) error {
	if saved.MigMode != g.dev.MigMode {
		if _, ret := g.dev.SetMigMode(saved.MigMode); ret != nvml.SUCCESS {
			return fmt.Errorf("SetMigMode(%d): %v", saved.MigMode, ret)
		}
	}
	g.computeMode = saved.ComputeMode
	for _, limit := range saved.MemoryLimits {
		g.limits[limit.Cgroup] = memoryLimit{soft: limit.Soft, hard: limit.Hard}
	}
	for _, savedGI := range saved.GpuInstances {
		_, info, ok := g.giProfileByID(savedGI.ProfileID)
		if !ok {
			return fmt.Errorf("GPU instance %d: no GPU-instance profile with ID %d", savedGI.ID, savedGI.ProfileID)
		}
		placement := nvml.GpuInstancePlacement{Start: savedGI.Start, Size: savedGI.Size}
		g.dev.GpuInstanceCounter = savedGI.ID
		created, ret := g.dev.CreateGpuInstanceWithPlacement(&info, &placement)
		if ret != nvml.SUCCESS {
			return fmt.Errorf("GPU instance %d: %v", savedGI.ID, ret)
		}
		gi := created.(*server.GpuInstance)
		for _, savedCI := range savedGI.ComputeInstances {
			ciInfo, ok := ciProfileByID(gi, savedCI.ProfileID)
			if !ok {
				return fmt.Errorf("GPU instance %d: no compute-instance profile with ID %d", savedGI.ID, savedCI.ProfileID)
			}
			gi.ComputeInstanceCounter = savedCI.ID
			if _, ret := gi.CreateComputeInstance(&ciInfo); ret != nvml.SUCCESS {
				return fmt.Errorf("GPU instance %d, compute instance %d: %v", savedGI.ID, savedCI.ID, ret)
			}
			g.migUUIDs[instanceKey{savedGI.ID, savedCI.ID}] = savedCI.UUID
		}
	}
	return nil
}

// gpuInstances lists the GPU's GPU instances by id (the mock keeps them in a map).
func (g *gpu) gpuInstances() []*server.GpuInstance {
	list := make([]*server.GpuInstance, 0, len(g.dev.GpuInstances))
	for gi := range g.dev.GpuInstances {
		list = append(list, gi)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Info.Id < list[j].Info.Id })
	return list
}

func computeInstances(gi *server.GpuInstance) []*server.ComputeInstance {
	list := make([]*server.ComputeInstance, 0, len(gi.ComputeInstances))
	for ci := range gi.ComputeInstances {
		list = append(list, ci)
	}
	sort.Slice(list, func(i, j int) bool { return list[i].Info.Id < list[j].Info.Id })
	return list
}

func (g *gpu) gpuInstanceByID(id uint32) *server.GpuInstance {
	for gi := range g.dev.GpuInstances {
		if gi.Info.Id == id {
			return gi
		}
	}
	return nil
}

func computeInstanceByID(gi *server.GpuInstance, id uint32) *server.ComputeInstance {
	for ci := range gi.ComputeInstances {
		if ci.Info.Id == id {
			return ci
		}
	}
	return nil
}
