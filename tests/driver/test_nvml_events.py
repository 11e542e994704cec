"""NVML events on the simulated GPUs: event sets, registration, waiting, injected XIDs, lost and
repaired GPUs, answered as libnvidia-ml answers through pynvml."""

from __future__ import annotations

import threading
import time

import pynvml
import pytest

from gpu_dra.driver.nvml.interface import (
    EVENT_TYPE_SIMULATED_RECOVERY,
    NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR,
    NVML_EVENT_TYPE_XID_CRITICAL_ERROR,
    NVML_NO_INSTANCE_ID,
)
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import load_profile

XID = NVML_EVENT_TYPE_XID_CRITICAL_ERROR
DBE = NVML_EVENT_TYPE_DOUBLE_BIT_ECC_ERROR


def _nvml(spec: str = "hgx-h100") -> SimulatedNvml:
    nvml = SimulatedNvml(load_profile(spec, "node-a"))
    nvml.init()
    return nvml


def _registered(nvml: SimulatedNvml, *gpus: int, types: int = XID | DBE) -> object:
    event_set = nvml.event_set_create()
    for index in gpus:
        nvml.device_register_events(nvml.device_get_handle_by_index(index), types, event_set)
    return event_set


def test_every_gpu_reports_xids_and_ecc_errors():
    nvml = _nvml()
    supported = nvml.device_get_supported_event_types(nvml.device_get_handle_by_index(3))
    assert supported & XID
    assert supported & DBE
    assert supported & NVML_EVENT_TYPE_SINGLE_BIT_ECC_ERROR


def test_wait_without_events_times_out_like_nvml():
    nvml = _nvml()
    event_set = _registered(nvml, 0)
    started = time.monotonic()
    with pytest.raises(pynvml.NVMLError_Timeout) as raised:
        nvml.event_set_wait(event_set, 50)
    assert raised.value.value == pynvml.NVML_ERROR_TIMEOUT
    assert time.monotonic() - started >= 0.04


def test_an_injected_xid_reaches_the_sets_the_gpu_is_registered_in():
    nvml = _nvml()
    watching_2 = _registered(nvml, 2)
    watching_0 = _registered(nvml, 0)
    assert nvml.inject_event(nvml.device_get_uuid(nvml.device_get_handle_by_index(2)), XID, 79) == 1
    event = nvml.event_set_wait(watching_2, 1000)
    assert nvml.device_get_uuid(event.device) == nvml.profile.gpus[2].uuid
    assert (event.eventType, event.eventData) == (XID, 79)
    assert event.gpuInstanceId == event.computeInstanceId == NVML_NO_INSTANCE_ID
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.event_set_wait(watching_0, 10)


def test_events_of_a_type_the_gpu_was_not_registered_for_are_not_reported():
    nvml = _nvml()
    event_set = _registered(nvml, 0, types=XID)
    assert nvml.inject_event(0, DBE) == 0
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.event_set_wait(event_set, 10)


def test_a_waiting_thread_wakes_up_for_an_event():
    nvml = _nvml()
    event_set = _registered(nvml, 1)
    got: list[int] = []
    waiter = threading.Thread(
        target=lambda: got.append(nvml.event_set_wait(event_set, 5000).eventData)
    )
    waiter.start()
    time.sleep(0.05)
    nvml.inject_event(1, XID, 48)
    waiter.join(2)
    assert got == [48]


def test_a_mig_device_event_carries_its_instance_ids_and_the_parent_gpu():
    nvml = _nvml("hgx-h100-mig")
    event_set = _registered(nvml, 1)
    mig = nvml.device_get_mig_device_handle_by_index(nvml.device_get_handle_by_index(1), 0)
    gi, ci = nvml.device_get_gpu_instance_id(mig), nvml.device_get_compute_instance_id(mig)
    nvml.inject_event(1, XID, 94, gpu_instance_id=gi, compute_instance_id=ci)
    event = nvml.event_set_wait(event_set, 1000)
    assert nvml.device_get_uuid(event.device) == nvml.profile.gpus[1].uuid
    assert (event.gpuInstanceId, event.computeInstanceId) == (gi, ci)


def test_injecting_for_a_mig_device_that_does_not_exist_is_refused():
    nvml = _nvml("hgx-h100-mig")
    with pytest.raises(ValueError, match="no MIG device"):
        nvml.inject_event(7, XID, 94, gpu_instance_id=1, compute_instance_id=0)
    with pytest.raises(ValueError, match="both"):
        nvml.inject_event(0, XID, 94, gpu_instance_id=1)
    with pytest.raises(ValueError, match="no simulated GPU"):
        nvml.inject_event("GPU-nope", XID, 94)


def test_a_lost_gpu_fails_its_calls_and_the_next_wait_once():
    nvml = _nvml()
    event_set = _registered(nvml, 0, 1)
    handle = nvml.device_get_handle_by_index(1)
    uuid = nvml.device_get_uuid(handle)
    nvml.lose_gpu(1)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        nvml.event_set_wait(event_set, 1000)
    with pytest.raises(pynvml.NVMLError_Timeout):
        nvml.event_set_wait(event_set, 10)
    for call in (
        lambda: nvml.device_get_uuid(handle),
        lambda: nvml.device_get_handle_by_index(1),
        lambda: nvml.device_get_handle_by_uuid(uuid),
    ):
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            call()
    assert nvml.device_get_uuid(nvml.device_get_handle_by_index(0)) != uuid  # others answer


def test_a_recovered_gpu_answers_again_and_reports_the_recovery():
    nvml = _nvml()
    event_set = _registered(nvml, 1)
    nvml.lose_gpu(1)
    assert nvml.recover_gpu(1) == 1
    event = nvml.event_set_wait(event_set, 1000)  # the loss was not reported before it ended
    assert event.eventType == EVENT_TYPE_SIMULATED_RECOVERY
    assert nvml.device_get_uuid(event.device) == nvml.profile.gpus[1].uuid


def test_registering_unsupported_types_is_not_supported():
    nvml = _nvml()
    event_set = nvml.event_set_create()
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_register_events(
            nvml.device_get_handle_by_index(0), pynvml.nvmlEventTypePState, event_set
        )


def test_a_freed_set_is_an_invalid_argument():
    nvml = _nvml()
    event_set = _registered(nvml, 0)
    nvml.event_set_free(event_set)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.event_set_wait(event_set, 10)
    assert nvml.inject_event(0, XID, 79) == 0


def test_event_calls_take_profile_faults():
    nvml = _nvml()
    nvml.set_fault("event_set_create", pynvml.NVML_ERROR_NOT_SUPPORTED)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.event_set_create()
    nvml.set_fault("event_set_create", None)
    event_set = nvml.event_set_create()
    nvml.set_fault("device_register_events", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=2)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_register_events(nvml.device_get_handle_by_index(2), XID, event_set)
