"""A CUDA client through ctypes on ``libcuda.so.1``: what an MPS client of a share does.

``python -m tests.real_gpu.cuda_client [--alloc MIB]... [--sleep S] [--then-alloc MIB]
[--then-work]`` retains device 0's primary context, allocates each ``--alloc`` (kept), sleeps,
allocates ``--then-alloc``, runs a memset and synchronizes (``--then-work``) and prints one
JSON line: every CUDA call's result by name, the device's multiprocessor count and free/total
memory as the context sees them.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Any

CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16


class Cuda:
    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.calls: list[dict[str, Any]] = []

    def name(self, code: int) -> str:
        text = ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(text)) != 0 or text.value is None:
            return f"CUDA error {code}"
        return text.value.decode()

    def call(self, what: str, function: str, *args: Any) -> int:
        started = time.monotonic()
        code = int(getattr(self.lib, function)(*args))
        self.calls.append(
            {
                "call": what,
                "result": self.name(code),
                "seconds": round(time.monotonic() - started, 3),
            }
        )
        return code


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--alloc", type=int, action="append", default=[])
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--then-alloc", type=int, default=0)
    parser.add_argument(
        "--then-work", action="store_true", help="memset + synchronize after the sleep"
    )
    args = parser.parse_args(argv)
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "uid": os.getuid(),
        "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_")},
    }
    try:
        cuda = Cuda()
    except OSError as error:
        report["error"] = f"libcuda.so.1: {error}"
        print(json.dumps(report), flush=True)
        return 2
    report["calls"] = cuda.calls
    try:
        if cuda.call("cuInit", "cuInit", 0) != 0:
            return 1
        device = ctypes.c_int()
        if cuda.call("cuDeviceGet 0", "cuDeviceGet", ctypes.byref(device), 0) != 0:
            return 1
        context = ctypes.c_void_p()
        retain = "cuDevicePrimaryCtxRetain"
        if cuda.call(retain, retain, ctypes.byref(context), device) != 0:
            return 1
        if cuda.call("cuCtxSetCurrent", "cuCtxSetCurrent", context) != 0:
            return 1
        count = ctypes.c_int()
        attribute = "cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)"
        cuda.call(
            attribute,
            "cuDeviceGetAttribute",
            ctypes.byref(count),
            CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            device,
        )
        report["multiprocessors"] = count.value
        report["memory"] = memory(cuda, "after context")
        for mib in args.alloc:
            pointer = ctypes.c_uint64()
            cuda.call(
                f"cuMemAlloc {mib} MiB",
                "cuMemAlloc_v2",
                ctypes.byref(pointer),
                ctypes.c_size_t(mib << 20),
            )
        if args.alloc:
            report["memory after allocs"] = memory(cuda, "after allocs")
        if args.sleep:
            time.sleep(args.sleep)
        if args.then_alloc:
            pointer = ctypes.c_uint64()
            cuda.call(
                f"cuMemAlloc {args.then_alloc} MiB after sleep",
                "cuMemAlloc_v2",
                ctypes.byref(pointer),
                ctypes.c_size_t(args.then_alloc << 20),
            )
        if args.then_work:
            pointer = ctypes.c_uint64()
            size = ctypes.c_size_t(64 << 20)
            if (
                cuda.call(
                    "cuMemAlloc 64 MiB for work", "cuMemAlloc_v2", ctypes.byref(pointer), size
                )
                == 0
            ):
                cuda.call("cuMemsetD8", "cuMemsetD8_v2", pointer, ctypes.c_ubyte(7), size)
                cuda.call("cuCtxSynchronize", "cuCtxSynchronize")
        return 0
    finally:
        print(json.dumps(report), flush=True)


def memory(cuda: Cuda, when: str) -> dict[str, int] | str:
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    code = cuda.call(
        f"cuMemGetInfo {when}", "cuMemGetInfo_v2", ctypes.byref(free), ctypes.byref(total)
    )
    if code != 0:
        return cuda.name(code)
    return {"freeMiB": free.value >> 20, "totalMiB": total.value >> 20}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
