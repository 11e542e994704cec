/*
 * Link-time stand-in of libnvidia-ml.so.1 (SONAME libnvidia-ml.so.1): nvidia-smi is linked
 * against it so that its DT_NEEDED names libnvidia-ml.so.1 and the cached binary does not depend
 * on any one NVML build. It is never installed nor loaded: at run time the dynamic loader finds
 * the driver root's libnvidia-ml.so.1 (the NVML mock), as with NVIDIA's own stub libraries.
 */
#include "nvml_abi.h"

nvmlReturn_t nvmlInit_v2(void) { return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlShutdown(void) { return NVML_ERROR_UNKNOWN; }
const char *nvmlErrorString(nvmlReturn_t result) { (void)result; return "link stub"; }
nvmlReturn_t nvmlSystemGetDriverVersion(char *v, unsigned int n) { (void)v; (void)n; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *c) { (void)c; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) { (void)i; (void)d; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *s, unsigned int n) { (void)d; (void)s; (void)n; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *s, unsigned int n) { (void)d; (void)s; (void)n; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *c, unsigned int *p) { (void)d; (void)c; (void)p; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *c) { (void)d; (void)c; return NVML_ERROR_UNKNOWN; }
nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int i, nvmlDevice_t *m) { (void)d; (void)i; (void)m; return NVML_ERROR_UNKNOWN; }
