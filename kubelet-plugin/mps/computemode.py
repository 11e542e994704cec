"""Compute mode of the full GPUs an MPS daemon serves: the `ComputeModeControl` seam.

NVIDIA's driver sets ``EXCLUSIVE_PROCESS`` on the full GPUs of an MPS group before it starts the
daemon and ``DEFAULT`` on teardown (``nvidia-compat.md`` §7, ``mps.md`` §5): then only the MPS
server can open the GPU, and a process that bypasses MPS fails instead of competing with it.
MIG devices are never touched: compute modes do not apply to MIG (``mps.md`` §8). gpu-dra does
it for the GPUs of shared daemons (MPS shares) by default, for every daemon or none as
configured (``--mps-exclusive-compute-mode``). Setting a compute mode needs root, and the mode
is not persistent (a reboot or a GPU reset makes it DEFAULT): daemon supervision reads it back
(`get_mode`) and sets it again. `NvmlComputeMode` goes through the `NvmlLibrary` interface, so
simulated nodes exercise the same calls and errors.
"""

from __future__ import annotations

import contextlib
from typing import Final, Protocol

from gpu_dra.driver.nvml.interface import (
    NVML_COMPUTEMODE_DEFAULT,
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_SUPPORTED,
    NVMLError,
    NvmlLibrary,
    return_code,
    return_code_name,
)
from gpu_dra.kubelet_plugin.mps.daemon_model import MpsError

EXCLUSIVE_PROCESS: Final = NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
DEFAULT: Final = NVML_COMPUTEMODE_DEFAULT


def is_full_gpu(uuid: str) -> bool:
    """Whether ``uuid`` names a full GPU (``GPU-``), not a MIG device (``MIG-``)."""
    return uuid.startswith("GPU-")


class ComputeModeError(MpsError):
    """NVML refused to read or change a GPU's compute mode."""

    def __init__(self, message: str, *, not_supported: bool = False) -> None:
        super().__init__(message)
        self.not_supported = not_supported
        self.retryable = not not_supported


class ComputeModeControl(Protocol):
    def set_mode(self, uuid: str, mode: int) -> None:
        """Set the compute mode of full GPU ``uuid``; `ComputeModeError` when NVML refuses."""
        ...

    def get_mode(self, uuid: str) -> int:
        """The compute mode of full GPU ``uuid``; `ComputeModeError` when NVML cannot say."""
        ...


def mode_name(mode: int) -> str:
    return {EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS", DEFAULT: "DEFAULT"}.get(mode, str(mode))


class NvmlComputeMode:
    """`ComputeModeControl` through NVML (one ``init``/``shutdown`` per call, thread-safe as
    NVML is)."""

    def __init__(self, nvml: NvmlLibrary) -> None:
        self._nvml = nvml

    def set_mode(self, uuid: str, mode: int) -> None:
        if not is_full_gpu(uuid):
            raise ComputeModeError(
                f"compute mode of {uuid}: only full GPUs have one, MIG devices are never changed",
                not_supported=True,
            )
        name = mode_name(mode)
        try:
            self._nvml.init()
        except NVMLError as error:
            raise ComputeModeError(f"cannot set compute mode {name} of {uuid}: {error}") from error
        try:
            handle = self._nvml.device_get_handle_by_uuid(uuid)
            self._nvml.device_set_compute_mode(handle, mode)
        except NVMLError as error:
            code = return_code(error)
            hint = (
                " (setting a compute mode needs root: run the plugin as root, or turn it off "
                "with --mps-exclusive-compute-mode=none)"
                if code == NVML_ERROR_NO_PERMISSION
                else ""
            )
            raise ComputeModeError(
                f"cannot set compute mode {name} of {uuid}: "
                f"{return_code_name(code) if code is not None else ''} {error}".replace("  ", " ")
                + hint,
                not_supported=code == NVML_ERROR_NOT_SUPPORTED,
            ) from error
        finally:
            with contextlib.suppress(NVMLError):
                self._nvml.shutdown()

    def get_mode(self, uuid: str) -> int:
        try:
            self._nvml.init()
        except NVMLError as error:
            raise ComputeModeError(f"cannot read the compute mode of {uuid}: {error}") from error
        try:
            return self._nvml.device_get_compute_mode(self._nvml.device_get_handle_by_uuid(uuid))
        except NVMLError as error:
            code = return_code(error)
            raise ComputeModeError(
                f"cannot read the compute mode of {uuid}: "
                f"{return_code_name(code) if code is not None else ''} {error}".replace("  ", " "),
                not_supported=code == NVML_ERROR_NOT_SUPPORTED,
            ) from error
        finally:
            with contextlib.suppress(NVMLError):
                self._nvml.shutdown()
