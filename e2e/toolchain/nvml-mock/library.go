package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/google/uuid"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxb200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh200"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
)

const (
	envMachine = "GPU_DRA_NVML_MOCK_MACHINE"
	envState   = "GPU_DRA_NVML_MOCK_STATE"
	envDevRoot = "GPU_DRA_NVML_MOCK_DEV_ROOT"
	envTrace   = "GPU_DRA_NVML_MOCK_TRACE"
	envDriver  = "GPU_DRA_NVML_MOCK_DRIVER"
)

// driverRelease is a driver the library can report instead of the mock server's
// (GPU_DRA_NVML_MOCK_DRIVER names it by branch), with what that driver has.
type driverRelease struct {
	version string // nvmlSystemGetDriverVersion
	nvml    string // nvmlSystemGetNVMLVersion
	cuda    int    // nvmlSystemGetCudaDriverVersion: 1000 * major + 10 * minor
	// memoryLimits: nvmlDeviceSet/GetMemoryLimits_v1 work (per-cgroup GPU memory limits).
	memoryLimits bool
}

// drivers are the releases GPU_DRA_NVML_MOCK_DRIVER takes. 615.71.09 (CUDA 13.4) is the
// driver NVIDIA's Dynamo documentation verified the cgroup memory limits on (docs/shares.md).
var drivers = map[string]driverRelease{
	"615": {version: "615.71.09", nvml: "13.615.71.09", cuda: 13040, memoryLimits: true},
}

func driverNames() string {
	names := make([]string, 0, len(drivers))
	for name := range drivers {
		names = append(names, name)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// machines are go-nvml's mock servers, by the name GPU_DRA_NVML_MOCK_MACHINE takes.
var machines = map[string]func() *server.Server{
	"dgxa100": dgxa100.New,
	"dgxh100": dgxh100.New,
	"dgxh200": dgxh200.New,
	"dgxb200": dgxb200.New,
}

func machineNames() string {
	names := make([]string, 0, len(machines))
	for name := range machines {
		names = append(names, name)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// uuidNamespace makes the GPU UUIDs a function of machine and index: go-nvml's mock draws a
// random one per device each time a server is made, and processes sharing a state file must
// agree on them. e2e/nvmlmock.py computes the same values (gpu_uuid).
var uuidNamespace = uuid.MustParse("6a1e3f0c-2b7d-5c41-9e8a-4d0f5b6c7a21")

func gpuUUID(machine string, index int) string {
	return "GPU-" + uuid.NewSHA1(uuidNamespace, []byte(fmt.Sprintf("%s/%d", machine, index))).String()
}

// newMigUUID mints a MIG device UUID, version-5 style like the real driver's, new for every
// compute instance (real NVML mints one per creation too).
func newMigUUID(parent string, gi, ci uint32) string {
	seed := fmt.Sprintf("%s/%d/%d/%s", parent, gi, ci, uuid.New().String())
	return "MIG-" + uuid.NewSHA1(uuidNamespace, []byte(seed)).String()
}

// config is what nvmlInit reads from the environment.
type config struct {
	machine   string
	statePath string
	devRoot   string
	driver    string // GPU_DRA_NVML_MOCK_DRIVER: a key of drivers, "" for the mock server's
	// devRootSet: GPU_DRA_NVML_MOCK_DEV_ROOT is set, so the capability nodes of the instances
	// this process creates are made there (makeCapNode).
	devRootSet bool
}

// readConfig reads the library's variables: the environment's, else those of the
// configuration file beside the library (conffile.go).
func readConfig() config {
	file := confFileValues()
	root := setting(envDevRoot, file)
	set := root != ""
	if !set {
		root = "/"
	}
	return config{
		machine:    setting(envMachine, file),
		statePath:  setting(envState, file),
		devRoot:    root,
		devRootSet: set,
		driver:     setting(envDriver, file),
	}
}

// gpu is one GPU of the mock server plus what the library keeps beside it.
type gpu struct {
	dev         *server.Device
	computeMode int
	migUUIDs    map[instanceKey]string
	// limits are the GPU memory limits per cgroup (full sysfs path), memorylimits.go.
	limits map[string]memoryLimit
}

type instanceKey struct{ gi, ci uint32 }

// library is the process-wide NVML state; every export holds mu.
type library struct {
	mu      sync.Mutex
	refs    int
	cfg     config
	machine string
	driver  string // the state's driver (config.driver, or the state file's)
	gpus    []*gpu
	server  *server.Server
	visible []int // indexes into gpus of the GPUs whose device node exists, NVML index order
	stamp   fileStamp
}

var lib = &library{}

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "libnvidia-ml (gpu-dra NVML mock): "+format+"\n", args...)
}

// initialize is nvmlInitWithFlags.
func (l *library) initialize() nvml.Return {
	if l.refs > 0 {
		l.refs++
		return nvml.SUCCESS
	}
	cfg := readConfig()
	if cfg.machine == "" && cfg.statePath == "" {
		logf("neither %s nor %s is set: no NVIDIA driver here", envMachine, envState)
		return nvml.ERROR_DRIVER_NOT_LOADED
	}
	if cfg.machine != "" {
		if _, ok := machines[cfg.machine]; !ok {
			logf("%s=%q is not a mock server (%s)", envMachine, cfg.machine, machineNames())
			return nvml.ERROR_DRIVER_NOT_LOADED
		}
	}
	if cfg.driver != "" {
		if _, ok := drivers[cfg.driver]; !ok {
			logf("%s=%q is not a driver the library knows (%s)", envDriver, cfg.driver, driverNames())
			return nvml.ERROR_DRIVER_NOT_LOADED
		}
	}
	// Kept across sessions with the same configuration: MIG instances outlive an NVML session.
	if l.server == nil || cfg.machine != l.cfg.machine || cfg.statePath != l.cfg.statePath ||
		cfg.driver != l.cfg.driver {
		l.server, l.gpus, l.stamp = nil, nil, fileStamp{}
		if err := l.load(cfg); err != nil {
			logf("%v", err)
			return nvml.ERROR_UNKNOWN
		}
	}
	l.cfg = cfg
	if err := l.refresh(); err != nil {
		logf("%v", err)
		return nvml.ERROR_UNKNOWN
	}
	l.visible = l.visible[:0]
	for index, g := range l.gpus {
		if exists(filepath.Join(cfg.devRoot, "dev", fmt.Sprintf("nvidia%d", g.dev.Minor))) {
			l.visible = append(l.visible, index)
		}
	}
	l.refs = 1
	return nvml.SUCCESS
}

func (l *library) shutdown() nvml.Return {
	if l.refs == 0 {
		return nvml.ERROR_UNINITIALIZED
	}
	l.refs--
	return nvml.SUCCESS
}

// load builds the server for cfg: from the state file when there is one (created with cfg's
// machine when missing), else pristine.
func (l *library) load(cfg config) error {
	l.cfg = cfg
	l.driver = cfg.driver
	if cfg.statePath == "" {
		return l.build(cfg.machine, nil)
	}
	doc, stamp, err := readState(cfg.statePath)
	if os.IsNotExist(err) {
		if cfg.machine == "" {
			return fmt.Errorf("%s=%s does not exist and %s is not set", envState, cfg.statePath, envMachine)
		}
		return l.createState(cfg)
	}
	if err != nil {
		return err
	}
	if cfg.machine != "" && cfg.machine != doc.Machine {
		return fmt.Errorf("%s=%s but the state file %s is of %s", envMachine, cfg.machine, cfg.statePath, doc.Machine)
	}
	if err := l.adoptDriver(doc); err != nil {
		return err
	}
	if err := l.build(doc.Machine, doc); err != nil {
		return fmt.Errorf("%s: %w", cfg.statePath, err)
	}
	l.stamp = stamp
	return nil
}

// adoptDriver takes the state file's driver: GPU_DRA_NVML_MOCK_DRIVER, where set, must be it.
func (l *library) adoptDriver(doc *stateDoc) error {
	if l.cfg.driver != "" && l.cfg.driver != doc.Driver {
		return fmt.Errorf("%s=%s but the state file %s is of driver %q", envDriver, l.cfg.driver, l.cfg.statePath, doc.Driver)
	}
	if doc.Driver != "" {
		if _, ok := drivers[doc.Driver]; !ok {
			return fmt.Errorf("state file %s: driver %q is not one the library knows (%s)", l.cfg.statePath, doc.Driver, driverNames())
		}
	}
	l.driver = doc.Driver
	return nil
}

// release is the driver the library reports in place of the mock server's (ok false: the
// mock server's own).
func (l *library) release() (driverRelease, bool) {
	release, ok := drivers[l.driver]
	return release, ok
}

// createState writes a pristine state file for cfg's machine, unless another process did first.
func (l *library) createState(cfg config) error {
	unlock, err := lockState(cfg.statePath)
	if err != nil {
		return err
	}
	defer unlock()
	doc, stamp, err := readState(cfg.statePath)
	if err == nil {
		if doc.Machine != cfg.machine {
			return fmt.Errorf("%s=%s but the state file %s is of %s", envMachine, cfg.machine, cfg.statePath, doc.Machine)
		}
		if err := l.adoptDriver(doc); err != nil {
			return err
		}
		l.stamp = stamp
		return l.build(doc.Machine, doc)
	}
	if !os.IsNotExist(err) {
		return err
	}
	if err := l.build(cfg.machine, nil); err != nil {
		return err
	}
	return l.save()
}

// build makes a fresh mock server of machine and replays doc (nil: nothing) through the mock's
// own MIG functions.
func (l *library) build(machine string, doc *stateDoc) error {
	newServer, ok := machines[machine]
	if !ok {
		return fmt.Errorf("%q is not a mock server (%s)", machine, machineNames())
	}
	srv := newServer()
	gpus := make([]*gpu, len(srv.Devices))
	for index, device := range srv.Devices {
		dev := device.(*server.Device)
		dev.UUID = gpuUUID(machine, index)
		gpus[index] = &gpu{dev: dev, migUUIDs: map[instanceKey]string{}, limits: map[string]memoryLimit{}}
	}
	if doc != nil {
		if len(doc.GPUs) != len(gpus) {
			return fmt.Errorf("state has %d GPUs, %s has %d", len(doc.GPUs), machine, len(gpus))
		}
		for index, saved := range doc.GPUs {
			if err := gpus[index].replay(saved); err != nil {
				return fmt.Errorf("GPU %d: %w", index, err)
			}
		}
	}
	l.machine, l.server, l.gpus = machine, srv, gpus
	return nil
}

// refresh reloads the state file when another process changed it since it was read.
func (l *library) refresh() error {
	if l.cfg.statePath == "" {
		return nil
	}
	stamp, err := statStamp(l.cfg.statePath)
	if os.IsNotExist(err) {
		if l.stamp == (fileStamp{}) {
			return nil
		}
		// Removed: the GPUs are as the mock server starts them.
		l.stamp = fileStamp{}
		return l.build(l.machine, nil)
	}
	if err != nil {
		return err
	}
	if stamp == l.stamp {
		return nil
	}
	doc, stamp, err := readState(l.cfg.statePath)
	if err != nil {
		return err
	}
	if doc.Machine != l.machine {
		return fmt.Errorf("state file %s changed machine from %s to %s", l.cfg.statePath, l.machine, doc.Machine)
	}
	if doc.Driver != l.driver {
		return fmt.Errorf("state file %s changed driver from %q to %q", l.cfg.statePath, l.driver, doc.Driver)
	}
	if err := l.build(doc.Machine, doc); err != nil {
		return fmt.Errorf("%s: %w", l.cfg.statePath, err)
	}
	l.stamp = stamp
	return nil
}

// mutate runs change with the state file locked and current; a successful change is saved.
func (l *library) mutate(change func() nvml.Return) nvml.Return {
	if l.cfg.statePath == "" {
		return change()
	}
	unlock, err := lockState(l.cfg.statePath)
	if err != nil {
		logf("%v", err)
		return nvml.ERROR_NO_PERMISSION
	}
	defer unlock()
	if err := l.refresh(); err != nil {
		logf("%v", err)
		return nvml.ERROR_UNKNOWN
	}
	ret := change()
	if ret != nvml.SUCCESS {
		return ret
	}
	if err := l.save(); err != nil {
		logf("%v", err)
		return nvml.ERROR_UNKNOWN
	}
	return ret
}

func (l *library) save() error {
	stamp, err := writeState(l.cfg.statePath, l.snapshot())
	if err != nil {
		return err
	}
	l.stamp = stamp
	return nil
}

func (l *library) snapshot() *stateDoc {
	doc := &stateDoc{Machine: l.machine, Driver: l.driver}
	for _, g := range l.gpus {
		doc.GPUs = append(doc.GPUs, g.snapshot())
	}
	return doc
}

// Device nodes, as the real driver's: a GPU is visible when /dev/nvidia<minor> exists under the
// dev root, a MIG device when both its GPU-instance and compute-instance capability nodes
// /dev/nvidia-caps/nvidia-cap<N> exist (N from /proc/driver/nvidia-caps/mig-minors).

// Minors of the nvidia-caps driver (open-gpu-kernel-modules kernel-open/nvidia/nv-caps.c): one
// table numbered from 0 in the order nvlink fabric-mgmt (0), mig config (1), mig monitor (2),
// then for each of 32 GPUs, for each GPU instance 0..14, the GI access file followed by the
// access files of its compute instances 0..7.
const (
	migCapsFirstMinor = 3
	migCapsPerGI      = 1 + 8
	migCapsGIs        = 15
	migCapsPerGPU     = migCapsPerGI * migCapsGIs
)

func migCapMinor(gpuMinor int, gi uint32, ci *uint32) int {
	minor := migCapsFirstMinor + gpuMinor*migCapsPerGPU + int(gi)*migCapsPerGI
	if ci != nil {
		minor += 1 + int(*ci)
	}
	return minor
}

func (l *library) capNodePath(minor int) string {
	return filepath.Join(l.cfg.devRoot, "dev", "nvidia-caps", "nvidia-cap"+strconv.Itoa(minor))
}

func (l *library) capNodeExists(minor int) bool {
	return exists(l.capNodePath(minor))
}

// On a real host the process that creates a GPU or compute instance sees its MIG device: with
// CAP_SYS_ADMIN it holds every nvidia-capability, and libnvidia-ml runs nvidia-modprobe, which
// makes the capability's /dev/nvidia-caps/nvidia-cap<N>. The library does the same in the dev
// root when GPU_DRA_NVML_MOCK_DEV_ROOT is set (the kubelet plugin's view of a host), and
// removes the node with the instance, so that the dev root holds the nodes of the instances
// that exist. A container leaves the variable unset: it sees only the nodes its CDI spec made.
// Replaying a state file makes no node (the process that created the instance did).

// capsMajor is the nvidia-caps character major: <dev root>/proc/devices (a fake driver root's),
// else /proc/devices; 0 when neither names it.
func (l *library) capsMajor() uint32 {
	for _, devices := range []string{filepath.Join(l.cfg.devRoot, "proc", "devices"), "/proc/devices"} {
		text, err := os.ReadFile(devices)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(text), "\n") {
			fields := strings.Fields(line)
			if len(fields) == 2 && fields[1] == "nvidia-caps" {
				if major, err := strconv.ParseUint(fields[0], 10, 32); err == nil {
					return uint32(major)
				}
			}
		}
	}
	return 0
}

// makeCapNode makes the capability node of GPU instance gi of the GPU with minor gpuMinor, or of
// its compute instance ci: a character device (mode 0444, the driver's for access files) when
// the nvidia-caps major is known and mknod is allowed, else an empty file (the library checks
// only that the node exists). An existing node is kept; a failure is logged, never an NVML error.
func (l *library) makeCapNode(gpuMinor int, gi uint32, ci *uint32) {
	if !l.cfg.devRootSet {
		return
	}
	minor := migCapMinor(gpuMinor, gi, ci)
	path := l.capNodePath(minor)
	if _, err := os.Lstat(path); err == nil {
		return
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		logf("capability node %s not made: %v", path, err)
		return
	}
	if major := l.capsMajor(); major != 0 {
		if err := syscall.Mknod(path, syscall.S_IFCHR|0o444, int(makedev(major, uint32(minor)))); err == nil {
			if err := os.Chmod(path, 0o444); err != nil {
				logf("capability node %s: %v", path, err)
			}
			return
		}
	}
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		logf("capability node %s not made: %v", path, err)
	}
}

// removeCapNode removes the node makeCapNode makes, when the instance is destroyed.
func (l *library) removeCapNode(gpuMinor int, gi uint32, ci *uint32) {
	if !l.cfg.devRootSet {
		return
	}
	path := l.capNodePath(migCapMinor(gpuMinor, gi, ci))
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		logf("capability node %s not removed: %v", path, err)
	}
}

// makedev is glibc's gnu_dev_makedev.
func makedev(major, minor uint32) uint64 {
	dev := uint64(major&0x00000fff) << 8
	dev |= uint64(major&0xfffff000) << 32
	dev |= uint64(minor & 0x000000ff)
	dev |= uint64(minor&0xffffff00) << 12
	return dev
}

func exists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

// Handles are opaque to NVML's clients; this library encodes what they name in them:
// kind, GPU minor, GPU instance id and compute instance id.
type handle uintptr

const (
	handleTag     = 0x4e56 << 32
	kindGPU       = 1
	kindMig       = 2
	kindGpuInst   = 3
	kindComputeIn = 4
)

func makeHandle(kind int, minor int, gi, ci uint32) handle {
	return handle(handleTag | uintptr(kind)<<24 | uintptr(minor&0xff)<<16 | uintptr(gi&0xff)<<8 | uintptr(ci&0xff))
}

func (h handle) decode() (kind, minor int, gi, ci uint32, ok bool) {
	if uintptr(h)&^0xffffffff != handleTag {
		return 0, 0, 0, 0, false
	}
	v := uintptr(h)
	return int(v >> 24 & 0xff), int(v >> 16 & 0xff), uint32(v >> 8 & 0xff), uint32(v & 0xff), true
}

func (l *library) gpuByMinor(minor int) *gpu {
	for _, g := range l.gpus {
		if g.dev.Minor == minor {
			return g
		}
	}
	return nil
}

// device resolves a device handle: the GPU, and the MIG device when it names one.
func (l *library) device(h handle) (*gpu, *migDevice, nvml.Return) {
	kind, minor, gi, ci, ok := h.decode()
	if !ok || (kind != kindGPU && kind != kindMig) {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	g := l.gpuByMinor(minor)
	if g == nil {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if kind == kindGPU {
		return g, nil, nvml.SUCCESS
	}
	m := g.migDevice(gi, ci)
	if m == nil {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return g, m, nvml.SUCCESS
}

// gpuOnly resolves a handle that must name a whole GPU (MIG handles: NOT_SUPPORTED).
func (l *library) gpuOnly(h handle) (*gpu, nvml.Return) {
	g, m, ret := l.device(h)
	if ret != nvml.SUCCESS {
		return nil, ret
	}
	if m != nil {
		return nil, nvml.ERROR_NOT_SUPPORTED
	}
	return g, nvml.SUCCESS
}

func (l *library) gpuInstance(h handle) (*gpu, *server.GpuInstance, nvml.Return) {
	kind, minor, gi, _, ok := h.decode()
	if !ok || kind != kindGpuInst {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	g := l.gpuByMinor(minor)
	if g == nil {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	instance := g.gpuInstanceByID(gi)
	if instance == nil {
		return nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return g, instance, nvml.SUCCESS
}

func (l *library) computeInstance(h handle) (*gpu, *server.GpuInstance, *server.ComputeInstance, nvml.Return) {
	kind, minor, gi, ci, ok := h.decode()
	if !ok || kind != kindComputeIn {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	g := l.gpuByMinor(minor)
	if g == nil {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	instance := g.gpuInstanceByID(gi)
	if instance == nil {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	compute := computeInstanceByID(instance, ci)
	if compute == nil {
		return nil, nil, nil, nvml.ERROR_INVALID_ARGUMENT
	}
	return g, instance, compute, nvml.SUCCESS
}

func (g *gpu) handle() handle { return makeHandle(kindGPU, g.dev.Minor, 0, 0) }

func (g *gpu) giHandle(gi *server.GpuInstance) handle {
	return makeHandle(kindGpuInst, g.dev.Minor, gi.Info.Id, 0)
}

func (g *gpu) ciHandle(gi *server.GpuInstance, ci *server.ComputeInstance) handle {
	return makeHandle(kindComputeIn, g.dev.Minor, gi.Info.Id, ci.Info.Id)
}

func (g *gpu) migHandle(gi *server.GpuInstance, ci *server.ComputeInstance) handle {
	return makeHandle(kindMig, g.dev.Minor, gi.Info.Id, ci.Info.Id)
}

// pciAddress is a GPU's PCI location, parsed from the mock's bus id ("0000:%02x:00.0").
type pciAddress struct{ domain, bus, device uint32 }

func parsePciBusID(id string) (pciAddress, error) {
	var a pciAddress
	var function uint32
	if _, err := fmt.Sscanf(id, "%x:%x:%x.%x", &a.domain, &a.bus, &a.device, &function); err != nil {
		return a, fmt.Errorf("PCI bus id %q: %w", id, err)
	}
	return a, nil
}

// busID is NVML's nvmlPciInfo_t.busId format, busIdLegacy its older one (nvml.h).
func (a pciAddress) busID() string {
	return fmt.Sprintf("%08X:%02X:%02X.0", a.domain, a.bus, a.device)
}

func (a pciAddress) legacy() string {
	return fmt.Sprintf("%04X:%02X:%02X.0", a.domain, a.bus, a.device)
}
