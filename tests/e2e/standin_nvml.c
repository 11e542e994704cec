/*
 * STAND-IN NVML for tests/e2e/test_driverroot.py only: NOT the NVML mock (which is built from
 * NVIDIA's go-nvml mock data) and not NVIDIA software. It answers the eleven calls the fake
 * nvidia-smi makes for a dgxh100-like machine: 8 GPUs "NVIDIA H100 80GB HBM3" with fixed UUIDs.
 *
 *   GPU_DRA_STANDIN_NVML_INIT_ERROR=<code>  nvmlInit_v2 returns <code>
 *   GPU_DRA_STANDIN_NVML_MIG_GPU=<index>    that GPU is in MIG mode with MIG devices at handle
 *                                           indexes 0, 1 and 3 (2 is NOT_FOUND) of 7
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "nvml_abi.h"

#define GPUS 8
#define MAX_MIG 7

struct gpu_dra_nvml_device {
    int gpu;
    int mig; /* -1: the GPU itself */
};

static struct gpu_dra_nvml_device gpus[GPUS];
static struct gpu_dra_nvml_device migs[GPUS][MAX_MIG];
static const char *const mig_profiles[MAX_MIG] = {"1g.10gb", "1g.10gb", NULL, "3g.40gb"};
static int initialised;

static int mig_gpu(void)
{
    const char *value = getenv("GPU_DRA_STANDIN_NVML_MIG_GPU");
    return value == NULL ? -1 : atoi(value);
}

static int copy(char *out, unsigned int length, const char *text)
{
    if (strlen(text) + 1 > length)
        return 7; /* NVML_ERROR_INSUFFICIENT_SIZE */
    strcpy(out, text);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void)
{
    const char *error = getenv("GPU_DRA_STANDIN_NVML_INIT_ERROR");
    if (error != NULL)
        return atoi(error);
    for (int g = 0; g < GPUS; g++) {
        gpus[g] = (struct gpu_dra_nvml_device){g, -1};
        for (int m = 0; m < MAX_MIG; m++)
            migs[g][m] = (struct gpu_dra_nvml_device){g, m};
    }
    initialised = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
    initialised = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case 1: return "Uninitialized";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case 18: return "RM has detected an NVML/RM version mismatch.";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    return initialised ? copy(version, length, "550.54.15") : 1;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    if (!initialised)
        return 1;
    *count = GPUS;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
    if (!initialised)
        return 1;
    if (index >= GPUS)
        return 2;
    *device = &gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
    char text[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    if (device->mig < 0)
        return copy(name, length, "NVIDIA H100 80GB HBM3");
    snprintf(text, sizeof text, "NVIDIA H100 80GB HBM3 MIG %s", mig_profiles[device->mig]);
    return copy(name, length, text);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
    char text[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    if (device->mig < 0)
        snprintf(text, sizeof text, "GPU-5a1d0c3e-0000-4000-8000-00000000%04d", device->gpu);
    else
        snprintf(text, sizeof text, "MIG-7b2e1d4f-%04d-5000-8000-00000000%04d", device->gpu,
                 device->mig);
    return copy(uuid, length, text);
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending)
{
    if (device->mig >= 0)
        return NVML_ERROR_NOT_SUPPORTED;
    *current = *pending = device->gpu == mig_gpu() ? NVML_DEVICE_MIG_ENABLE : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count)
{
    *count = device->gpu == mig_gpu() ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index,
                                                 nvmlDevice_t *mig_device)
{
    if (device->gpu != mig_gpu() || index >= MAX_MIG || mig_profiles[index] == NULL)
        return NVML_ERROR_NOT_FOUND;
    *mig_device = &migs[device->gpu][index];
    return NVML_SUCCESS;
}
