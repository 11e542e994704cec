package main

// The configuration file beside the library: a process that runs without the library's
// variables (an OCI hook, which runc starts with only the environment its spec names) reads
// them from <directory of the loaded library>/gpu-dra-nvml-mock.env, one NAME=value a line.
// A variable set in the environment wins over the file. A container gets the library file
// bind-mounted alone, never the file beside it, so only the host's processes see it.

/*
#cgo LDFLAGS: -ldl
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

static char *nvml_mock_self_path(void) {
	Dl_info info;
	if (dladdr((void *)nvml_mock_self_path, &info) == 0 || info.dli_fname == NULL) {
		return NULL;
	}
	return (char *)info.dli_fname;
}
*/
import "C"

import (
	"os"
	"path/filepath"
	"strings"
)

// confFileName is the file beside the library holding its settings.
const confFileName = "gpu-dra-nvml-mock.env"

// confFilePath is where the library looks for its configuration file ("" when its own path
// is unknown).
func confFilePath() string {
	self := C.nvml_mock_self_path()
	if self == nil {
		return ""
	}
	return filepath.Join(filepath.Dir(C.GoString(self)), confFileName)
}

// confFileValues reads the configuration file (no file: none). Lines are NAME=value; empty
// lines and lines starting with # are skipped; only GPU_DRA_NVML_MOCK_* names count.
func confFileValues() map[string]string {
	values := map[string]string{}
	path := confFilePath()
	if path == "" {
		return values
	}
	text, err := os.ReadFile(path)
	if err != nil {
		if !os.IsNotExist(err) {
			logf("configuration file %s: %v", path, err)
		}
		return values
	}
	for _, line := range strings.Split(string(text), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		name, value, ok := strings.Cut(line, "=")
		if !ok || !strings.HasPrefix(name, "GPU_DRA_NVML_MOCK_") {
			logf("configuration file %s: line %q ignored (not GPU_DRA_NVML_MOCK_<NAME>=<value>)", path, line)
			continue
		}
		values[name] = value
	}
	return values
}

// setting is a variable of the library: the environment's value, else the configuration file's.
func setting(name string, file map[string]string) string {
	if value := getenv(name); value != "" {
		return value
	}
	return file[name]
}
