package main

// Every function nvml.h declares, as a weak symbol answering NVML_ERROR_NOT_SUPPORTED; the
// exports in exports.go replace those the library implements. Without them the library would
// have hundreds of undefined symbols (go-nvml's own cgo wrappers reference every NVML function)
// and dlopen(RTLD_NOW), which ctypes uses, would refuse it.

/*
#include <stdio.h>
#include <stdlib.h>

static int nvml_mock_unimplemented(const char *name) {
	if (getenv("GPU_DRA_NVML_MOCK_TRACE") != NULL) {
		fprintf(stderr, "nvml-mock: %s -> NVML_ERROR_NOT_SUPPORTED (not implemented)\n", name);
	}
	return 3; // NVML_ERROR_NOT_SUPPORTED
}

#include "nvml_mock_stubs.h"
*/
import "C"
