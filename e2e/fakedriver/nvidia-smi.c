/*
 * gpu-dra fake driver root: nvidia-smi, linked against libnvidia-ml.so.1 (the driver root's NVML,
 * the mock built from NVIDIA's go-nvml data). Written by gpu-dra, not NVIDIA software; it prints
 * what the real nvidia-smi prints for the few things it does:
 *
 *   nvidia-smi -L | --list-gpus   "GPU <i>: <name> (UUID: <uuid>)", and under a GPU in MIG mode
 *                                 "  MIG <profile, 11 wide> Device <j, 2 wide>: (UUID: <uuid>)"
 *   nvidia-smi                    a short header with the driver version and one line per GPU
 *   nvidia-smi --version          the NVIDIA-SMI and driver version lines
 *
 * Exit codes as nvidia-smi(1) documents them: 0 success, 2 invalid arguments, 4 insufficient
 * permissions, 6 no devices (query unsuccessful), 9 driver not loaded (nvmlInit fails with
 * NVML_ERROR_DRIVER_NOT_LOADED), 255 any other error. Only the NVML calls declared in
 * nvml_abi.h are made; an NVML error is printed with nvmlErrorString, never taken for "none".
 */
#include <stdio.h>
#include <string.h>

#include "nvml_abi.h"

#ifndef FAKEDRIVER_VERSION
#error "build with -DFAKEDRIVER_VERSION=\"<driver version>\""
#endif

#define EXIT_INVALID_ARGUMENTS 2
#define EXIT_NO_PERMISSION 4
#define EXIT_NO_DEVICES 6
#define EXIT_DRIVER_NOT_LOADED 9
#define EXIT_OTHER 255
#define TABLE_WIDTH 87 /* between the two '|' of nvidia-smi's table */

static int init_nvml(void)
{
    nvmlReturn_t rc = nvmlInit_v2();
    if (rc == NVML_SUCCESS)
        return 0;
    if (rc == NVML_ERROR_DRIVER_NOT_LOADED) {
        printf("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
               "Make sure that the latest NVIDIA driver is installed and running.\n\n");
        return EXIT_DRIVER_NOT_LOADED;
    }
    printf("Failed to initialize NVML: %s\n", nvmlErrorString(rc));
    return rc == NVML_ERROR_NO_PERMISSION ? EXIT_NO_PERMISSION : EXIT_OTHER;
}

static int finish(int status)
{
    nvmlShutdown();
    return status;
}

/* The profile of a MIG device from its NVML name, "<GPU name> MIG <profile>". */
static const char *mig_profile(const char *name)
{
    const char *found = NULL;
    for (const char *at = strstr(name, "MIG "); at != NULL; at = strstr(at + 1, "MIG "))
        found = at;
    return found == NULL ? name : found + strlen("MIG ");
}

static int list_mig_devices(nvmlDevice_t gpu, unsigned int gpu_index)
{
    unsigned int current = 0, pending = 0, max_count = 0, listed = 0;
    nvmlReturn_t rc = nvmlDeviceGetMigMode(gpu, &current, &pending);
    if (rc == NVML_ERROR_NOT_SUPPORTED)
        return 0;
    if (rc != NVML_SUCCESS) {
        fprintf(stderr, "Unable to determine the MIG mode of GPU %u: %s\n", gpu_index,
                nvmlErrorString(rc));
        return EXIT_OTHER;
    }
    if (current != NVML_DEVICE_MIG_ENABLE)
        return 0;
    rc = nvmlDeviceGetMaxMigDeviceCount(gpu, &max_count);
    if (rc != NVML_SUCCESS) {
        fprintf(stderr, "Unable to determine the MIG device count of GPU %u: %s\n", gpu_index,
                nvmlErrorString(rc));
        return EXIT_OTHER;
    }
    int status = 0;
    for (unsigned int i = 0; i < max_count; i++) {
        nvmlDevice_t mig;
        char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
        char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        rc = nvmlDeviceGetMigDeviceHandleByIndex(gpu, i, &mig);
        if (rc == NVML_ERROR_NOT_FOUND)
            continue;
        if (rc == NVML_SUCCESS)
            rc = nvmlDeviceGetName(mig, name, sizeof name);
        if (rc == NVML_SUCCESS)
            rc = nvmlDeviceGetUUID(mig, uuid, sizeof uuid);
        if (rc != NVML_SUCCESS) {
            fprintf(stderr, "Unable to read MIG device %u of GPU %u: %s\n", i, gpu_index,
                    nvmlErrorString(rc));
            status = EXIT_OTHER;
            continue;
        }
        printf("  MIG %-11s Device %2u: (UUID: %s)\n", mig_profile(name), listed, uuid);
        listed++;
    }
    return status;
}

static int gpu_count(unsigned int *count)
{
    nvmlReturn_t rc = nvmlDeviceGetCount_v2(count);
    if (rc != NVML_SUCCESS) {
        fprintf(stderr, "Unable to determine the number of GPUs: %s\n", nvmlErrorString(rc));
        return EXIT_OTHER;
    }
    if (*count == 0) {
        printf("No devices were found\n");
        return EXIT_NO_DEVICES;
    }
    return 0;
}

static nvmlReturn_t gpu_name(unsigned int index, nvmlDevice_t *gpu, char *name, unsigned int size)
{
    nvmlReturn_t rc = nvmlDeviceGetHandleByIndex_v2(index, gpu);
    if (rc == NVML_SUCCESS)
        rc = nvmlDeviceGetName(*gpu, name, size);
    if (rc != NVML_SUCCESS)
        fprintf(stderr, "Unable to determine the device handle for GPU %u: %s\n", index,
                nvmlErrorString(rc));
    return rc;
}

static int list_gpus(void)
{
    unsigned int count = 0;
    int status = gpu_count(&count);
    if (status != 0)
        return status;
    for (unsigned int i = 0; i < count; i++) {
        nvmlDevice_t gpu;
        char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
        char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
        if (gpu_name(i, &gpu, name, sizeof name) != NVML_SUCCESS) {
            status = EXIT_OTHER;
            continue;
        }
        nvmlReturn_t rc = nvmlDeviceGetUUID(gpu, uuid, sizeof uuid);
        if (rc != NVML_SUCCESS) {
            fprintf(stderr, "Unable to determine the UUID of GPU %u: %s\n", i, nvmlErrorString(rc));
            status = EXIT_OTHER;
            continue;
        }
        printf("GPU %u: %s (UUID: %s)\n", i, name, uuid);
        if (list_mig_devices(gpu, i) != 0)
            status = EXIT_OTHER;
    }
    return status;
}

static int driver_version(char *version, unsigned int size)
{
    nvmlReturn_t rc = nvmlSystemGetDriverVersion(version, size);
    if (rc != NVML_SUCCESS) {
        fprintf(stderr, "Unable to determine the driver version: %s\n", nvmlErrorString(rc));
        return EXIT_OTHER;
    }
    return 0;
}

static void table_row(const char *text)
{
    printf("| %-*.*s |\n", TABLE_WIDTH - 2, TABLE_WIDTH - 2, text);
}

static void table_rule(void)
{
    char rule[TABLE_WIDTH + 1];
    memset(rule, '-', TABLE_WIDTH);
    rule[TABLE_WIDTH] = '\0';
    printf("+%s+\n", rule);
}

static int summary(void)
{
    char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char row[256];
    unsigned int count = 0;
    int status = driver_version(version, sizeof version);
    if (status != 0)
        return status;
    table_rule();
    snprintf(row, sizeof row, "NVIDIA-SMI %-22s Driver Version: %s", FAKEDRIVER_VERSION, version);
    table_row(row);
    table_rule();
    status = gpu_count(&count);
    if (status != 0)
        return status;
    table_row("GPU  Name                                                   MIG M.");
    for (unsigned int i = 0; i < count; i++) {
        nvmlDevice_t gpu;
        char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
        unsigned int current = 0, pending = 0;
        if (gpu_name(i, &gpu, name, sizeof name) != NVML_SUCCESS) {
            status = EXIT_OTHER;
            continue;
        }
        nvmlReturn_t rc = nvmlDeviceGetMigMode(gpu, &current, &pending);
        const char *mig = rc == NVML_ERROR_NOT_SUPPORTED ? "N/A"
                          : rc != NVML_SUCCESS           ? nvmlErrorString(rc)
                          : current == NVML_DEVICE_MIG_ENABLE ? "Enabled"
                                                              : "Disabled";
        snprintf(row, sizeof row, "%3u  %-54s %s", i, name, mig);
        table_row(row);
    }
    table_rule();
    return status;
}

static int version_lines(void)
{
    char version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    int status = driver_version(version, sizeof version);
    if (status != 0)
        return status;
    printf("NVIDIA-SMI version  : %s\n", FAKEDRIVER_VERSION);
    printf("DRIVER version      : %s\n", version);
    return 0;
}

int main(int argc, char **argv)
{
    int (*command)(void);
    if (argc == 1)
        command = summary;
    else if (argc == 2 && (strcmp(argv[1], "-L") == 0 || strcmp(argv[1], "--list-gpus") == 0))
        command = list_gpus;
    else if (argc == 2 && strcmp(argv[1], "--version") == 0)
        command = version_lines;
    else {
        printf("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.\n");
        printf("(gpu-dra fake driver root: only no arguments, -L/--list-gpus and --version)\n");
        return EXIT_INVALID_ARGUMENTS;
    }
    int status = init_nvml();
    if (status != 0)
        return status;
    return finish(command());
}
