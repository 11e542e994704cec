"""Time-slice intervals of whole GPUs: the `TimeSlicer` seam, ``nvidia-smi`` and a recorded fake.

NVIDIA-compatible (``nvidia-compat.md`` §8): `NvidiaSmiTimeSlicer` runs ``nvidia-smi`` on real
GPUs (there is no NVML API for it); `RecordedTimeSlicer` changes nothing and records every call
in a JSON file (``<data-dir>/time-slicing.json`` on simulated nodes). "Not Supported" (exit
status 3) is `TimeSlicingNotSupportedError`, never retried; other failures are
`TimeSlicingError`, retryable. The time-slicing tier records the applied intervals in the claim's
checkpoint ``state`` (`tiers.state.TIME_SLICE_STATE_KEY`) before running the commands.
See docs/config.md#time-slicing.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from gpu_dra.driver.config.sharing import TIME_SLICE_VALUES
from gpu_dra.driver.nvml.real import LIBRARY_DIRS, NVML_LIBRARY_NAME, find_nvml_library
from gpu_dra.kubelet_plugin.atomic_file import write_atomically
from gpu_dra.kubelet_plugin.node_locks import acquire_blocking

log = logging.getLogger(__name__)

DEFAULT_INTERVAL: Final = 0
NOT_SUPPORTED_EXIT_STATUS: Final = 3
"""nvidia-smi's exit status for "the requested operation is not available on target device"."""
RECORD_FILE: Final = "time-slicing.json"
_OUTPUT_SHOWN: Final = 500
_CALLS_KEPT: Final = 1000

INTERVAL_NAMES: Final[dict[int, str]] = {value: name for name, value in TIME_SLICE_VALUES.items()}


def interval_name(value: int) -> str:
    """``3`` -> ``Long``."""
    return INTERVAL_NAMES.get(value, str(value))


class TimeSlicingError(Exception):
    """A time-slice command failed; the message names the GPU and what went wrong."""

    retryable: bool = True
    """Whether trying again later can succeed (the kubelet retries)."""


class TimeSlicingNotSupportedError(TimeSlicingError):
    """The GPU does not support time-slice intervals ("Not Supported", exit status 3)."""

    retryable = False

    def __init__(self, uuid: str, product: str | None = None, detail: str = "") -> None:
        self.uuid = uuid
        self.product = product
        self.detail = detail
        gpu = f"GPU {uuid} ({product})" if product else f"GPU {uuid}"
        message = (
            f"{gpu} does not support time-slice intervals; remove timeSlicingConfig or use Default"
        )
        super().__init__(f"{message} (nvidia-smi: {detail})" if detail else message)

    def for_product(self, product: str) -> TimeSlicingNotSupportedError:
        """The same error, naming the GPU's product."""
        return TimeSlicingNotSupportedError(self.uuid, product, self.detail)


class TimeSlicingStateError(TimeSlicingError):
    """A checkpoint entry's time-slice state is not usable."""

    retryable = False


class TimeSlicer(Protocol):
    """Sets and resets the time-slice interval of a full GPU."""

    def set_interval(self, uuid: str, interval: int) -> None:
        """Compute mode ``DEFAULT``, then time-slice ``interval`` (0-3) on GPU ``uuid``."""
        ...

    def reset(self, uuid: str) -> None:
        """Time-slice interval back to ``Default`` (0); idempotent."""
        ...


def _check_interval(interval: int) -> None:
    if isinstance(interval, bool) or interval not in INTERVAL_NAMES:
        raise ValueError(f"time-slice interval must be 0, 1, 2 or 3, got {interval!r}")


def driver_tool_env(
    binary: Path, driver_root: Path, base_env: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The environment to run a driver tool (``nvidia-smi``) in: `base_env` (default: ours),
    plus, when `binary` lies under a `driver_root` other than ``/``, ``LD_PRELOAD`` of that
    root's ``libnvidia-ml.so.1``. The plugin's image has no NVIDIA libraries and its loader
    does not search the driver root, so a tool from the root would not start otherwise; only
    NVML is preloaded (as NVIDIA's plugin does), never the root's C library, so the image's
    glibc and the host's are not mixed. Raises `FileNotFoundError` when the root has no NVML
    library."""
    env = dict(os.environ if base_env is None else base_env)
    if driver_root == Path("/") or not binary.is_relative_to(driver_root):
        return env
    library = find_nvml_library(driver_root)
    if library is None:
        raise FileNotFoundError(
            f"{binary} is in driver root {driver_root}, which has no {NVML_LIBRARY_NAME} under "
            f"{', '.join(LIBRARY_DIRS)}"
        )
    preload = [str(library), *filter(None, env.get("LD_PRELOAD", "").split(":"))]
    env["LD_PRELOAD"] = ":".join(preload)
    return env


class NvidiaSmiTimeSlicer:
    """`TimeSlicer` running ``nvidia-smi`` (one command per step, each with a timeout); build
    `base_env` with `driver_tool_env` for an ``nvidia-smi`` from the driver root.
    """

    def __init__(
        self,
        binary: str | Path,
        *,
        base_env: Mapping[str, str] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.binary = str(binary)
        self.base_env = dict(os.environ if base_env is None else base_env)
        self.timeout_s = timeout_s

    def set_interval(self, uuid: str, interval: int) -> None:
        _check_interval(interval)
        self._run(uuid, ["-i", uuid, "-c", "DEFAULT"])
        self._run(uuid, ["compute-policy", "-i", uuid, "--set-timeslice", str(interval)])
        log.info("time-slice set uuid=%s interval=%s", uuid, interval_name(interval))

    def reset(self, uuid: str) -> None:
        self._run(uuid, ["compute-policy", "-i", uuid, "--set-timeslice", str(DEFAULT_INTERVAL)])
        log.info("time-slice reset uuid=%s", uuid)

    def _run(self, uuid: str, args: Sequence[str]) -> str:
        command = [self.binary, *args]
        shown = " ".join(command)
        try:
            done = subprocess.run(
                command,
                env=self.base_env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise TimeSlicingError(f"{shown}: no answer in {error.timeout}s") from error
        except OSError as error:
            raise TimeSlicingError(f"cannot run {self.binary}: {error}") from error
        output = (done.stderr.strip() or done.stdout.strip())[:_OUTPUT_SHOWN]
        if done.returncode == 0:
            return done.stdout
        combined = f"{done.stdout}\n{done.stderr}".lower()
        if done.returncode == NOT_SUPPORTED_EXIT_STATUS or "not supported" in combined:
            raise TimeSlicingNotSupportedError(uuid, detail=output or "Not Supported")
        raise TimeSlicingError(f"{shown} exited with {done.returncode}: {output}")


class RecordedTimeSlicer:
    """`TimeSlicer` for simulated nodes: changes nothing, records everything in ``path``.

    The file holds ``{"intervals": {uuid: value}, "calls": [...]}``: the interval each GPU
    would have now, and the calls in order (``{"call": "set_interval", "uuid", "interval"}``,
    ``{"call": "reset", "uuid"}``, with ``"result": "Not Supported"`` when refused; the last
    1000). GPUs in ``not_supported`` answer "Not Supported" as a Tesla P4 does.
    """

    def __init__(self, path: Path, *, not_supported: Collection[str] = ()) -> None:
        self.path = path
        self.not_supported = frozenset(not_supported)
        self._lock = threading.Lock()

    def set_interval(self, uuid: str, interval: int) -> None:
        _check_interval(interval)
        self._record({"call": "set_interval", "uuid": uuid, "interval": interval}, uuid, interval)

    def reset(self, uuid: str) -> None:
        self._record({"call": "reset", "uuid": uuid}, uuid, DEFAULT_INTERVAL)

    def read(self) -> dict[str, Any]:
        """The record: ``{"intervals": {...}, "calls": [...]}`` (empty ones when there is none)."""
        try:
            loaded = json.loads(self.path.read_text())
        except FileNotFoundError:
            loaded = {}
        except (OSError, ValueError) as error:
            log.warning("time-slicing record %s unreadable, starting afresh: %s", self.path, error)
            loaded = {}
        if not isinstance(loaded, dict):
            loaded = {}
        intervals = loaded.get("intervals")
        calls = loaded.get("calls")
        return {
            "intervals": intervals if isinstance(intervals, dict) else {},
            "calls": calls if isinstance(calls, list) else [],
        }

    def intervals(self) -> dict[str, int]:
        """``{uuid: value}`` as the GPUs would be set now."""
        return dict(self.read()["intervals"])

    def _record(self, call: dict[str, Any], uuid: str, interval: int) -> None:
        refused = uuid in self.not_supported
        if refused:
            call["result"] = "Not Supported"
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Another plugin instance on the node (a rolling update) records into the same file.
            held = acquire_blocking(self.path.with_name(f"{self.path.name}.lock"), timeout_s=30)
            try:
                record = self.read()
                record["calls"] = [*record["calls"], call][-_CALLS_KEPT:]
                if not refused:
                    record["intervals"][uuid] = interval
                data = (json.dumps(record, indent=2) + "\n").encode()
                write_atomically(self.path, data, mode=0o644)
            finally:
                held.release()
        if refused:
            raise TimeSlicingNotSupportedError(uuid, detail="Not Supported")
        log.info("time-slice recorded %s uuid=%s interval=%s", call["call"], uuid, interval)
