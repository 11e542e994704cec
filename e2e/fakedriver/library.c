/*
 * gpu-dra fake driver root: the one source of every stub driver library (libcuda,
 * libnvidia-ptxjitcompiler, ...). Each library is this object linked under the real driver's
 * file name and SONAME; it exports one symbol naming what it is and does nothing else. It is not
 * NVIDIA software and drives no GPU. libnvidia-ml is not built from here (the NVML mock is).
 */
#ifndef FAKEDRIVER_VERSION
#error "build with -DFAKEDRIVER_VERSION=\"<driver version>\""
#endif

__attribute__((visibility("default")))
const char gpu_dra_fake_driver_library[] =
    "gpu-dra fake NVIDIA driver library " FAKEDRIVER_VERSION " (not NVIDIA software, no GPU)";
