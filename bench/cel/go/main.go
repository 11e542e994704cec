// Command celref evaluates one DRA device selector over an inventory with the Kubernetes
// scheduler's own CEL code (k8s.io/dynamic-resource-allocation/cel), as the reference for
// bench/cel. It reads the inventory that bench/cel writes, JSON values one after the other (one
// per line): the selector, then every device with its driver,
//
//	{"selector": "..."}
//	{"driver": "...", "device": <resource.k8s.io/v1 Device>}
//	...
//
// decoded one at a time into the scheduler's dracel.Device (as an informer holds them: no copy of
// the file in memory),
// and prints one JSON object: compile time, the evaluation time of every repetition over all
// devices, the matched-device count and the runtime errors (count and the first message).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	dracel "k8s.io/dynamic-resource-allocation/cel"
)

type header struct {
	Selector string `json:"selector"`
}

type entry struct {
	Driver string             `json:"driver"`
	Device resourceapi.Device `json:"device"`
}

type report struct {
	Devices       int       `json:"devices"`
	CompileMs     float64   `json:"compile_ms"`
	EvalSeconds   []float64 `json:"eval_seconds"`
	Matched       int       `json:"matched"`
	Errors        int       `json:"errors"`
	FirstError    string    `json:"first_error,omitempty"`
	MaxRSSKiB     int64     `json:"max_rss_kib"`
	GoVersion     string    `json:"go_version"`
	DecodeSeconds float64   `json:"decode_seconds"`
}

func main() {
	path := flag.String("inventory", "", "inventory JSON written by bench/cel")
	repeat := flag.Int("repeat", 3, "evaluations of the selector over the whole inventory")
	flag.Parse()
	if err := run(*path, *repeat); err != nil {
		fmt.Fprintln(os.Stderr, "celref:", err)
		os.Exit(1)
	}
}

func run(path string, repeat int) error {
	started := time.Now()
	file, err := os.Open(path)
	if err != nil {
		return err
	}
	defer file.Close()
	decoder := json.NewDecoder(bufio.NewReaderSize(file, 1<<20))
	var head header
	if err := decoder.Decode(&head); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	var inputs []dracel.Device
	for {
		var e entry
		if err := decoder.Decode(&e); err == io.EOF {
			break
		} else if err != nil {
			return fmt.Errorf("%s: device %d: %w", path, len(inputs), err)
		}
		inputs = append(inputs, dracel.Device{
			Driver:                   e.Driver,
			AllowMultipleAllocations: e.Device.AllowMultipleAllocations,
			Attributes:               e.Device.Attributes,
			Capacity:                 e.Device.Capacity,
		})
	}
	out := report{Devices: len(inputs), DecodeSeconds: time.Since(started).Seconds()}

	started = time.Now()
	// The scheduler's compiler with the gates the e2e cluster enables (DRAConsumableCapacity).
	compiled := dracel.GetCompiler(dracel.Features{EnableConsumableCapacity: true}).
		CompileCELExpression(head.Selector, dracel.Options{})
	out.CompileMs = float64(time.Since(started).Microseconds()) / 1000
	if compiled.Error != nil {
		return fmt.Errorf("compile: %s", compiled.Error.Error())
	}

	ctx := context.Background()
	for r := 0; r < repeat; r++ {
		matched, errors, first := 0, 0, ""
		started = time.Now()
		for i := range inputs {
			ok, _, err := compiled.DeviceMatches(ctx, inputs[i])
			switch {
			case err != nil:
				errors++
				if first == "" {
					first = err.Error()
				}
			case ok:
				matched++
			}
		}
		out.EvalSeconds = append(out.EvalSeconds, time.Since(started).Seconds())
		out.Matched, out.Errors, out.FirstError = matched, errors, first
	}
	out.MaxRSSKiB = maxRSSKiB()
	out.GoVersion = goVersion()
	return json.NewEncoder(os.Stdout).Encode(out)
}
