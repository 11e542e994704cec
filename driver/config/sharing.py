"""How one device (or a config group of devices) is shared: time-slicing or MPS.

``GpuSharing`` belongs to `GpuConfig`, ``MigDeviceSharing`` to `MigDeviceConfig`; the MIG variant
has no ``timeSlicingConfig`` (MIG devices cannot change their time slice).
"""

from __future__ import annotations

import json
from typing import Annotated, Final, Literal

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError

from gpu_dra.driver.config.api import StrictModel
from gpu_dra.driver.config.quantity import QuantityError, parse_quantity

SharingStrategy = Literal["TimeSlicing", "MPS"]
STRATEGIES: Final = ("TimeSlicing", "MPS")

TimeSliceInterval = Literal["Default", "Short", "Medium", "Long"]
INTERVALS: Final = ("Default", "Short", "Medium", "Long")

# `nvidia-smi compute-policy --set-timeslice <value>` for each interval.
TIME_SLICE_VALUES: Final[dict[str, int]] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


def _quantity_text(value: object) -> str:
    """A quantity as given in JSON (a string or a number), checked and stripped of spaces."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise PydanticCustomError(
            "quantity_type",
            "expected a quantity such as 10Gi or 512Mi, got {got}",
            {"got": json.dumps(value)[:40]},
        )
    text = value.strip() if isinstance(value, str) else repr(value)
    try:
        parse_quantity(text)
    except QuantityError as error:
        raise PydanticCustomError("quantity", "{reason}", {"reason": str(error)}) from error
    return text


def _percentage(value: object) -> object:
    """Thread percentages outside 0..100 are refused with the allowed range in the message."""
    if isinstance(value, int) and not isinstance(value, bool) and not 0 <= value <= 100:
        raise PydanticCustomError(
            "percentage",
            "active thread percentage must be between 0 and 100 (percent of the GPU's SMs), "
            "got {got}",
            {"got": value},
        )
    return value


Quantity = Annotated[str, BeforeValidator(_quantity_text)]
"""A Kubernetes quantity, kept as the user wrote it (``"10Gi"``); JSON numbers become text."""

Percentage = Annotated[int, BeforeValidator(_percentage)]


class TimeSlicingConfig(StrictModel):
    """``timeSlicingConfig``: how long each process runs before the GPU switches."""

    interval: TimeSliceInterval | None = None

    def normalized(self) -> TimeSlicingConfig:
        """An omitted interval means ``Default``."""
        return TimeSlicingConfig(interval=self.interval or "Default")

    @property
    def nvidia_smi_value(self) -> int:
        """The ``--set-timeslice`` argument for this interval (``Default`` -> 0)."""
        return TIME_SLICE_VALUES[self.interval or "Default"]


class MpsConfig(StrictModel):
    """``mpsConfig``: defaults the claim's MPS control daemon applies to its clients.

    Pinned-memory limits are keyed by device UUID or by index into the config group's UUIDs in
    sorted order; they are turned into per-UUID limits by `pinned_memory_limits` at prepare
    time, when the group's UUIDs are known.
    """

    default_active_thread_percentage: Percentage | None = None
    default_pinned_device_memory_limit: Quantity | None = None
    default_per_device_pinned_memory_limit: dict[str, Quantity] | None = None
    multi_user: bool | None = None


class GpuSharing(StrictModel):
    """``sharing`` of a `GpuConfig`."""

    strategy: SharingStrategy
    time_slicing_config: TimeSlicingConfig | None = None
    mps_config: MpsConfig | None = None

    def normalized(self) -> GpuSharing:
        """Fill in the chosen strategy's settings: interval ``Default``, or an empty `MpsConfig`."""
        if self.strategy == "TimeSlicing":
            slicing = self.time_slicing_config or TimeSlicingConfig()
            return self.model_copy(update={"time_slicing_config": slicing.normalized()})
        return self.model_copy(update={"mps_config": self.mps_config or MpsConfig()})


class MigDeviceSharing(StrictModel):
    """``sharing`` of a `MigDeviceConfig` (no ``timeSlicingConfig``)."""

    strategy: SharingStrategy
    mps_config: MpsConfig | None = None

    def normalized(self) -> MigDeviceSharing:
        """MPS without ``mpsConfig`` gets an empty one; TimeSlicing has nothing to fill in."""
        if self.strategy == "MPS":
            return self.model_copy(update={"mps_config": self.mps_config or MpsConfig()})
        return self
