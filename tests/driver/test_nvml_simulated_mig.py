"""Simulated NVML MIG answers like libnvidia-ml through pynvml, per model, errors included.

Expected values are transcribed from shared/reference/gpu-hardware.md section 4 (not read from the
simulator's own gpu_models.json), so a wrong table entry fails here.
"""

from __future__ import annotations

import inspect
import re
from concurrent.futures import ThreadPoolExecutor

import pynvml
import pytest
import yaml

from gpu_dra.driver.nvml.interface import NvmlLibrary
from gpu_dra.driver.nvml.real import RealNvml
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.driver.nvml.simulated_profiles import ProfileError, load_profile, parse_profile

MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-5[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
ON, OFF = pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE

# (index constant, profile ID, name, sliceCount, instanceCount, memory MiB,
#  (SM, CE, DEC, ENC, JPEG, OFA), placement starts, placement size)
_A100_40GB = [
    (0, 19, "1g.5gb", 1, 7, 4864, (14, 1, 0, 0, 0, 0), (0, 1, 2, 3, 4, 5, 6), 1),
    (1, 14, "2g.10gb", 2, 3, 9856, (28, 2, 1, 0, 0, 0), (0, 2, 4), 2),
    (2, 9, "3g.20gb", 3, 2, 19968, (42, 3, 2, 0, 0, 0), (0, 4), 4),
    (3, 5, "4g.20gb", 4, 1, 19968, (56, 4, 2, 0, 0, 0), (0,), 4),
    (4, 0, "7g.40gb", 7, 1, 40192, (98, 7, 5, 0, 1, 1), (0,), 8),
    (7, 20, "1g.5gb+me", 1, 1, 4864, (14, 1, 1, 0, 1, 1), (0, 1, 2, 3, 4, 5, 6), 1),
    (9, 15, "1g.10gb", 1, 4, 9856, (14, 1, 1, 0, 0, 0), (0, 2, 4, 6), 2),
]
_A100_80GB = [
    (0, 19, "1g.10gb", 1, 7, 9728, (14, 1, 0, 0, 0, 0), (0, 1, 2, 3, 4, 5, 6), 1),
    (1, 14, "2g.20gb", 2, 3, 19968, (28, 2, 1, 0, 0, 0), (0, 2, 4), 2),
    (2, 9, "3g.40gb", 3, 2, 40192, (42, 3, 2, 0, 0, 0), (0, 4), 4),
    (3, 5, "4g.40gb", 4, 1, 40192, (56, 4, 2, 0, 0, 0), (0,), 4),
    (4, 0, "7g.80gb", 7, 1, 80896, (98, 7, 5, 0, 1, 1), (0,), 8),
    (7, 20, "1g.10gb+me", 1, 1, 9728, (14, 1, 1, 0, 1, 1), (0, 1, 2, 3, 4, 5, 6), 1),
    (9, 15, "1g.20gb", 1, 4, 19968, (14, 1, 1, 0, 0, 0), (0, 2, 4, 6), 2),
]
REFERENCE = {
    "A100-SXM4-40GB": _A100_40GB,
    "A100-PCIE-40GB": _A100_40GB,
    "A100-SXM4-80GB": _A100_80GB,
    "A100-PCIE-80GB": _A100_80GB,
    "A30": [
        (0, 14, "1g.6gb", 1, 4, 5952, (14, 1, 1, 0, 0, 0), (0, 1, 2, 3), 1),
        (1, 5, "2g.12gb", 2, 2, 11968, (28, 2, 2, 0, 0, 0), (0, 2), 2),
        (3, 0, "4g.24gb", 4, 1, 24000, (56, 4, 4, 0, 1, 1), (0,), 4),
        (7, 21, "1g.6gb+me", 1, 1, 5952, (14, 1, 1, 0, 1, 1), (0, 1, 2, 3), 1),
        (8, 6, "2g.12gb+me", 2, 1, 11968, (28, 2, 2, 0, 1, 1), (0, 2), 2),
    ],
    "H100-SXM5-80GB": [
        (0, 19, "1g.10gb", 1, 7, 9984, (16, 1, 1, 0, 1, 0), (0, 1, 2, 3, 4, 5, 6), 1),
        (1, 14, "2g.20gb", 2, 3, 20096, (32, 2, 2, 0, 2, 0), (0, 2, 4), 2),
        (2, 9, "3g.40gb", 3, 2, 40448, (60, 3, 3, 0, 3, 0), (0, 4), 4),
        (3, 5, "4g.40gb", 4, 1, 40448, (64, 4, 4, 0, 4, 0), (0,), 4),
        (4, 0, "7g.80gb", 7, 1, 81152, (132, 8, 7, 0, 7, 1), (0,), 8),
        (7, 20, "1g.10gb+me", 1, 1, 9984, (16, 1, 1, 0, 1, 1), (0, 1, 2, 3, 4, 5, 6), 1),
        (9, 15, "1g.20gb", 1, 4, 20096, (26, 1, 1, 0, 1, 0), (0, 2, 4, 6), 2),
    ],
    "H100-NVL": [
        (0, 19, "1g.12gb", 1, 7, 11008, (16, 1, 1, 0, 1, 0), (0, 1, 2, 3, 4, 5, 6), 1),
        (1, 14, "2g.24gb", 2, 3, 22144, (32, 2, 2, 0, 2, 0), (0, 2, 4), 2),
        (2, 9, "3g.47gb", 3, 2, 47488, (60, 3, 3, 0, 3, 0), (0, 4), 4),
        (3, 5, "4g.47gb", 4, 1, 47488, (64, 4, 4, 0, 4, 0), (0,), 4),
        (4, 0, "7g.94gb", 7, 1, 95360, (132, 8, 7, 0, 7, 1), (0,), 8),
        (7, 20, "1g.12gb+me", 1, 1, 11008, (16, 1, 1, 0, 1, 1), (0, 1, 2, 3, 4, 5, 6), 1),
        (9, 15, "1g.24gb", 1, 4, 22144, (26, 1, 1, 0, 1, 0), (0, 2, 4, 6), 2),
    ],
    "H200-141GB": [
        (0, 19, "1g.18gb", 1, 7, 16384, (16, 1, 1, 0, 1, 0), (0, 1, 2, 3, 4, 5, 6), 1),
        (1, 14, "2g.35gb", 2, 3, 33280, (32, 2, 2, 0, 2, 0), (0, 2, 4), 2),
        (2, 9, "3g.71gb", 3, 2, 71424, (60, 3, 3, 0, 3, 0), (0, 4), 4),
        (3, 5, "4g.71gb", 4, 1, 71424, (64, 4, 4, 0, 4, 0), (0,), 4),
        (4, 0, "7g.141gb", 7, 1, 143360, (132, 8, 7, 0, 7, 1), (0,), 8),
        (7, 20, "1g.18gb+me", 1, 1, 16384, (16, 1, 1, 0, 1, 1), (0, 1, 2, 3, 4, 5, 6), 1),
        (9, 15, "1g.35gb", 1, 4, 33280, (26, 1, 1, 0, 1, 0), (0, 2, 4, 6), 2),
    ],
}
MAX_MIG_DEVICES = {model: 4 if model == "A30" else 7 for model in REFERENCE}
AMPERE = [m for m in REFERENCE if m.startswith(("A100", "A30"))]
HOPPER = ["H100-SXM5-80GB", "H100-NVL", "H200-141GB"]


def _nvml(model: str = "H100-SXM5-80GB", **gpu: object) -> SimulatedNvml:
    doc = {
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpus": [{"model": model, "busId": "00000000:1B:00.0", **gpu}],
    }
    nvml = SimulatedNvml(parse_profile(doc, name="mig", node_name="node-a"))
    nvml.init()
    return nvml


def _mig_on(model: str = "H100-SXM5-80GB", **gpu: object) -> tuple[SimulatedNvml, object]:
    nvml = _nvml(model, migMode=[ON, ON], **gpu)
    return nvml, nvml.device_get_handle_by_index(0)


def _place(start: int, size: int) -> pynvml.c_nvmlGpuInstancePlacement_t:
    return pynvml.c_nvmlGpuInstancePlacement_t(start, size)


def _slice(nvml: SimulatedNvml, handle: object, profile_id: int, start: int) -> object:
    """GI at (start, the profile's size) plus its full CI; returns the CI handle."""
    size = next(
        p.size
        for p in nvml.device_get_gpu_instance_possible_placements(handle, profile_id)
        if p.start == start
    )
    gi = nvml.device_create_gpu_instance_with_placement(handle, profile_id, _place(start, size))
    slices = nvml.device_get_gpu_instance_profile_info(handle, _index_of(nvml, handle, profile_id))
    ci_profile = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices.sliceCount]
    return nvml.gpu_instance_create_compute_instance(gi, ci_profile)


def _index_of(nvml: SimulatedNvml, handle: object, profile_id: int) -> int:
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            if nvml.device_get_gpu_instance_profile_info(handle, index).id == profile_id:
                return index
        except pynvml.NVMLError_NotSupported:
            continue
    raise AssertionError(f"no profile index has ID {profile_id}")


def _layout(nvml: SimulatedNvml, handle: object) -> list[tuple[int, int]]:
    """(profile ID, start) of every GI, read back through NVML as the DRA driver would."""
    found = []
    for row in REFERENCE.get(nvml.profile.gpus[0].model.key, []):
        for gi in nvml.device_get_gpu_instances(handle, row[1]):
            info = nvml.gpu_instance_get_info(gi)
            found.append((info.profileId, info.placement.start))
    return sorted(found)


# Profiles, IDs and placements.


@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_profile_info_by_index_returns_the_real_profile_ids_and_sizes(model):
    nvml = _nvml(model)
    handle = nvml.device_get_handle_by_index(0)
    expected = {row[0]: row for row in REFERENCE[model]}
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        if index not in expected:
            with pytest.raises(pynvml.NVMLError_NotSupported):
                nvml.device_get_gpu_instance_profile_info(handle, index)
            continue
        _, profile_id, name, slices, instances, memory, engines, _, _ = expected[index]
        info = nvml.device_get_gpu_instance_profile_info(handle, index)
        assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
        assert (info.id, info.name, info.sliceCount, info.instanceCount) == (
            profile_id,
            f"MIG {name}",
            slices,
            instances,
        )
        assert info.memorySizeMB == memory
        assert info.isP2pSupported == 0
        assert (
            info.multiprocessorCount,
            info.copyEngineCount,
            info.decoderCount,
            info.encoderCount,
            info.jpegCount,
            info.ofaCount,
        ) == engines


@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_possible_placements_per_profile_id_match_the_reference(model):
    nvml = _nvml(model)  # MIG off: placements are listed whatever the mode
    handle = nvml.device_get_handle_by_index(0)
    for _, profile_id, _, _, _, _, _, starts, size in REFERENCE[model]:
        placements = nvml.device_get_gpu_instance_possible_placements(handle, profile_id)
        assert all(isinstance(p, pynvml.c_nvmlGpuInstancePlacement_t) for p in placements)
        assert [(p.start, p.size) for p in placements] == [(s, size) for s in starts]


def test_profile_index_and_profile_id_are_not_interchangeable():
    nvml, handle = _mig_on()
    # Index 4 (7_SLICE) is profile ID 0; ID 4 does not exist on an H100.
    assert nvml.device_get_gpu_instance_profile_info(handle, 4).id == 0
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_gpu_instance_possible_placements(handle, 4)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_create_gpu_instance_with_placement(handle, 4, _place(0, 8))


def test_profile_index_past_count_is_invalid_argument_and_version_1_has_no_name():
    nvml, handle = _mig_on()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_get_gpu_instance_profile_info(handle, pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT)
    info = nvml.device_get_gpu_instance_profile_info(handle, 0, version=1)
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_t)
    assert info.id == 19


# Creating and destroying instances.


def test_overlapping_placement_is_insufficient_resources_with_nvidia_smi_text():
    nvml, handle = _mig_on()
    nvml.device_create_gpu_instance_with_placement(handle, 9, _place(4, 4))  # 3g on slices 4-7
    with pytest.raises(pynvml.NVMLError) as raised:
        nvml.device_create_gpu_instance_with_placement(handle, 14, _place(4, 2))  # 2g on 4-5
    assert type(raised.value) is pynvml.NVMLError_InsufficientResources
    assert raised.value.value == pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES
    assert str(raised.value) == "Insufficient Resources"
    with pytest.raises(pynvml.NVMLError_InsufficientResources):  # same placement again
        nvml.device_create_gpu_instance_with_placement(handle, 9, _place(4, 4))
    nvml.device_create_gpu_instance_with_placement(handle, 14, _place(2, 2))  # free: fine
    assert _layout(nvml, handle) == [(9, 4), (14, 2)]


@pytest.mark.parametrize(("start", "size"), [(1, 2), (3, 4), (0, 2), (8, 4)])
def test_placement_not_in_the_profile_list_is_invalid_argument(start, size):
    nvml, handle = _mig_on()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_create_gpu_instance_with_placement(handle, 9, _place(start, size))


def test_instance_count_limits_media_extension_profiles_to_one():
    nvml, handle = _mig_on("A100-SXM4-80GB")
    nvml.device_create_gpu_instance_with_placement(handle, 20, _place(0, 1))
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.device_create_gpu_instance_with_placement(handle, 20, _place(3, 1))


def test_a30_has_one_media_extension_for_both_me_profiles():
    nvml, handle = _mig_on("A30")
    nvml.device_create_gpu_instance_with_placement(handle, 21, _place(0, 1))  # 1g.6gb+me
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.device_create_gpu_instance_with_placement(handle, 6, _place(2, 2))  # 2g.12gb+me
    nvml.device_create_gpu_instance_with_placement(handle, 5, _place(2, 2))  # plain 2g fits


def test_create_without_placement_reproduces_the_mig_guide_order_quirk():
    nvml, handle = _mig_on("A100-SXM4-40GB")
    for profile_id in (19, 19, 14):
        nvml.device_create_gpu_instance(handle, profile_id)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.device_create_gpu_instance(handle, 9)

    nvml, handle = _mig_on("A100-SXM4-40GB")
    for profile_id in (9, 19, 14, 19):
        nvml.device_create_gpu_instance(handle, profile_id)
    assert sorted(p for p, _ in _layout(nvml, handle)) == [9, 14, 19, 19]


def test_gpu_instances_need_mig_on():
    nvml = _nvml("H100-SXM5-80GB")
    handle = nvml.device_get_handle_by_index(0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_create_gpu_instance_with_placement(handle, 19, _place(0, 1))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_create_gpu_instance(handle, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_gpu_instances(handle, 19)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_gpu_instance_by_id(handle, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_get_gpu_instance_remaining_capacity(handle, 19)


def test_gi_ids_are_unique_and_follow_the_placement_size_not_the_position():
    nvml, handle = _mig_on()
    ids = []
    for start in (6, 0, 3, 1, 5, 2, 4):
        gi = nvml.device_create_gpu_instance_with_placement(handle, 19, _place(start, 1))
        ids.append(nvml.gpu_instance_get_info(gi).id)
    assert ids == list(range(7, 14))  # 1g level of the slice tree, in creation order
    nvml, handle = _mig_on()
    gi = nvml.device_create_gpu_instance_with_placement(handle, 19, _place(0, 1))
    assert nvml.gpu_instance_get_info(gi).id == 7  # the same id at another position

    nvml, handle = _mig_on()
    seven = nvml.device_create_gpu_instance_with_placement(handle, 0, _place(0, 8))
    assert nvml.gpu_instance_get_info(seven).id == 0
    nvml.gpu_instance_destroy(seven)
    late = nvml.device_create_gpu_instance_with_placement(handle, 9, _place(4, 4))
    early = nvml.device_create_gpu_instance_with_placement(handle, 9, _place(0, 4))
    assert (nvml.gpu_instance_get_info(late).id, nvml.gpu_instance_get_info(early).id) == (1, 2)


def test_gpu_instance_lookups_by_id_and_profile():
    nvml, handle = _mig_on()
    gi = nvml.device_create_gpu_instance_with_placement(handle, 14, _place(2, 2))
    info = nvml.gpu_instance_get_info(gi)
    assert info.device is handle
    assert (info.profileId, info.placement.start, info.placement.size) == (14, 2, 2)
    assert nvml.device_get_gpu_instance_by_id(handle, info.id) is gi
    assert nvml.device_get_gpu_instances(handle, 14) == [gi]
    assert nvml.device_get_gpu_instances(handle, 9) == []
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.device_get_gpu_instance_by_id(handle, (info.id + 1) % 15)


def test_remaining_capacity_counts_what_still_fits():
    nvml, handle = _mig_on()
    assert nvml.device_get_gpu_instance_remaining_capacity(handle, 19) == 7
    assert nvml.device_get_gpu_instance_remaining_capacity(handle, 9) == 2
    nvml.device_create_gpu_instance_with_placement(handle, 9, _place(0, 4))
    assert nvml.device_get_gpu_instance_remaining_capacity(handle, 19) == 3
    assert nvml.device_get_gpu_instance_remaining_capacity(handle, 0) == 0


def test_full_compute_instance_profile_matches_the_gpu_instance():
    nvml, handle = _mig_on()
    gi = nvml.device_create_gpu_instance_with_placement(handle, 9, _place(0, 4))
    info = nvml.gpu_instance_get_compute_instance_profile_info(
        gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, 0
    )
    assert isinstance(info, pynvml.c_nvmlComputeInstanceProfileInfo_v2_t)
    assert (info.id, info.sliceCount, info.instanceCount, info.name) == (2, 3, 1, "MIG 3g.40gb")
    assert (info.multiprocessorCount, info.sharedCopyEngineCount, info.sharedDecoderCount) == (
        60,
        3,
        3,
    )
    assert (info.sharedJpegCount, info.sharedOfaCount) == (3, 0)
    with pytest.raises(pynvml.NVMLError_NotSupported):  # 1c.3g: not simulated
        nvml.gpu_instance_get_compute_instance_profile_info(gi, 0, 0)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.gpu_instance_get_compute_instance_profile_info(gi, 2, 1)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.gpu_instance_get_compute_instance_profile_info(
            gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT, 0
        )


def test_compute_instances_get_per_gi_ids_and_only_one_full_ci_fits():
    nvml, handle = _mig_on()
    gi = nvml.device_create_gpu_instance_with_placement(handle, 5, _place(0, 4))
    ci = nvml.gpu_instance_create_compute_instance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE)
    info = nvml.compute_instance_get_info(ci)
    assert (info.id, info.profileId) == (0, 3)
    assert info.gpuInstance is gi
    assert nvml.gpu_instance_get_compute_instance_by_id(gi, 0) is ci
    assert nvml.gpu_instance_get_compute_instances(gi, 3) == [ci]
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.gpu_instance_get_compute_instance_by_id(gi, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.gpu_instance_create_compute_instance(gi, 3)


def test_destroying_a_gpu_instance_with_a_compute_instance_is_in_use():
    nvml, handle = _mig_on()
    ci = _slice(nvml, handle, 14, 0)
    gi = nvml.compute_instance_get_info(ci).gpuInstance
    with pytest.raises(pynvml.NVMLError) as raised:
        nvml.gpu_instance_destroy(gi)
    assert type(raised.value) is pynvml.NVMLError_InUse
    assert str(raised.value) == "In use by another client"
    assert _layout(nvml, handle) == [(14, 0)]
    nvml.compute_instance_destroy(ci)
    nvml.gpu_instance_destroy(gi)
    assert _layout(nvml, handle) == []
    with pytest.raises(pynvml.NVMLError_InvalidArgument):  # stale handle
        nvml.gpu_instance_destroy(gi)
    nvml.device_create_gpu_instance_with_placement(handle, 14, _place(0, 2))  # slices are free


def test_concurrent_creates_never_double_book_a_memory_slice():
    nvml, handle = _mig_on()

    def create(start: int) -> bool:
        try:
            nvml.device_create_gpu_instance_with_placement(handle, 15, _place(start, 2))
        except pynvml.NVMLError_InsufficientResources:
            return False
        return True

    with ThreadPoolExecutor(max_workers=16) as pool:
        created = list(pool.map(create, [0, 2, 4, 6] * 16))
    assert sum(created) == 4
    assert _layout(nvml, handle) == [(15, 0), (15, 2), (15, 4), (15, 6)]


# MIG devices.


@pytest.mark.parametrize("model", sorted(REFERENCE))
def test_max_mig_device_count_is_zero_with_mig_off_and_the_model_max_with_it_on(model):
    nvml = _nvml(model)
    assert nvml.device_get_max_mig_device_count(nvml.device_get_handle_by_index(0)) == 0
    nvml, handle = _mig_on(model)
    assert nvml.device_get_max_mig_device_count(handle) == MAX_MIG_DEVICES[model]


def test_mig_device_handles_by_index_follow_the_created_instances():
    nvml, handle = _mig_on()
    with pytest.raises(pynvml.NVMLError_NotFound):
        nvml.device_get_mig_device_handle_by_index(handle, 0)
    first = _slice(nvml, handle, 9, 4)
    second = _slice(nvml, handle, 19, 0)
    nvml.device_create_gpu_instance_with_placement(handle, 19, _place(1, 1))  # no CI: no device
    devices = [nvml.device_get_mig_device_handle_by_index(handle, i) for i in range(2)]
    by_gi = sorted(
        (nvml.compute_instance_get_info(ci) for ci in (first, second)),
        key=lambda info: nvml.gpu_instance_get_info(info.gpuInstance).id,
    )
    assert devices == [info.device for info in by_gi]
    for index in range(2, 7):
        with pytest.raises(pynvml.NVMLError_NotFound):
            nvml.device_get_mig_device_handle_by_index(handle, index)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_get_mig_device_handle_by_index(handle, 7)
    nvml.compute_instance_destroy(first)
    remaining = nvml.device_get_mig_device_handle_by_index(handle, 0)
    assert remaining == nvml.compute_instance_get_info(second).device


def test_mig_device_handle_answers_uuid_memory_ids_and_parent():
    nvml, handle = _mig_on("H100-NVL")
    ci = _slice(nvml, handle, 14, 2)
    info = nvml.compute_instance_get_info(ci)
    mig = info.device
    gi_id = nvml.gpu_instance_get_info(info.gpuInstance).id
    assert MIG_UUID.match(nvml.device_get_uuid(mig))
    memory = nvml.device_get_memory_info(mig)
    assert isinstance(memory, pynvml.c_nvmlMemory_t)
    assert memory.total == 22144 * 1024 * 1024
    assert nvml.device_is_mig_device_handle(mig) is True
    assert nvml.device_is_mig_device_handle(handle) is False
    assert nvml.device_get_gpu_instance_id(mig) == gi_id
    assert nvml.device_get_compute_instance_id(mig) == 0
    assert nvml.device_get_device_handle_from_mig_device_handle(mig) is handle
    assert nvml.device_get_handle_by_uuid(nvml.device_get_uuid(mig)) is mig
    for call in (
        nvml.device_get_gpu_instance_id,
        nvml.device_get_compute_instance_id,
        nvml.device_get_device_handle_from_mig_device_handle,
    ):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call(handle)
    nvml.compute_instance_destroy(ci)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_get_uuid(mig)


def test_mig_uuids_are_version_5_style_unique_and_new_when_a_slice_is_recreated():
    def run() -> list[str]:
        nvml, handle = _mig_on()
        uuids = []
        for _ in range(2):
            ci = _slice(nvml, handle, 9, 0)
            info = nvml.compute_instance_get_info(ci)
            uuids.append(nvml.device_get_uuid(info.device))
            nvml.compute_instance_destroy(ci)
            nvml.gpu_instance_destroy(info.gpuInstance)
        uuids.append(
            nvml.device_get_uuid(nvml.compute_instance_get_info(_slice(nvml, handle, 9, 4)).device)
        )
        return uuids

    uuids = run()
    assert all(MIG_UUID.match(u) for u in uuids), uuids
    assert len(set(uuids)) == 3
    assert run() == uuids  # deterministic
    assert not set(uuids) & {gpu.uuid for gpu in load_profile("hgx-h100", "node-a").gpus}


# MIG mode.


@pytest.mark.parametrize("model", HOPPER)
def test_hopper_toggles_mig_mode_at_once(model):
    nvml = _nvml(model)
    handle = nvml.device_get_handle_by_index(0)
    assert nvml.device_set_mig_mode(handle, ON) == pynvml.NVML_SUCCESS
    assert nvml.device_get_mig_mode(handle) == [ON, ON]
    ci = _slice(nvml, handle, 19, 0)
    with pytest.raises(pynvml.NVMLError_InUse):
        nvml.device_set_mig_mode(handle, OFF)
    assert nvml.device_get_mig_mode(handle) == [ON, ON]
    gi = nvml.compute_instance_get_info(ci).gpuInstance
    nvml.compute_instance_destroy(ci)
    nvml.gpu_instance_destroy(gi)
    assert nvml.device_set_mig_mode(handle, OFF) == pynvml.NVML_SUCCESS
    assert nvml.device_get_mig_mode(handle) == [OFF, OFF]
    assert nvml.device_get_max_mig_device_count(handle) == 0


@pytest.mark.parametrize("model", AMPERE)
def test_ampere_only_changes_the_pending_mode_until_a_gpu_reset(model):
    nvml = _nvml(model)
    handle = nvml.device_get_handle_by_index(0)
    assert nvml.device_set_mig_mode(handle, ON) == pynvml.NVML_ERROR_IN_USE
    assert nvml.device_get_mig_mode(handle) == [OFF, ON]
    with pytest.raises(pynvml.NVMLError_NotSupported):
        nvml.device_create_gpu_instance(handle, REFERENCE[model][0][1])
    nvml.reset_gpu(handle)
    assert nvml.device_get_mig_mode(handle) == [ON, ON]
    ci = _slice(nvml, handle, REFERENCE[model][0][1], 0)
    mig = nvml.compute_instance_get_info(ci).device

    # Turning MIG off is pending too: the instances live on until the reset.
    assert nvml.device_set_mig_mode(handle, OFF) == pynvml.NVML_ERROR_IN_USE
    assert nvml.device_get_mig_mode(handle) == [ON, OFF]
    assert nvml.device_get_mig_device_handle_by_index(handle, 0) is mig
    nvml.reset_gpu(handle)
    assert nvml.device_get_mig_mode(handle) == [OFF, OFF]
    assert nvml.device_get_max_mig_device_count(handle) == 0
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_get_uuid(mig)


def test_blackwell_toggles_like_hopper_but_has_no_simulated_profiles():
    nvml = _nvml("B200")
    handle = nvml.device_get_handle_by_index(0)
    assert nvml.device_set_mig_mode(handle, ON) == pynvml.NVML_SUCCESS
    assert nvml.device_get_mig_mode(handle) == [ON, ON]
    assert nvml.device_get_max_mig_device_count(handle) == 7
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.device_get_gpu_instance_profile_info(handle, index)


def test_setting_the_current_mode_again_is_success_and_bad_modes_invalid_argument():
    nvml, handle = _mig_on("A100-SXM4-40GB")
    assert nvml.device_set_mig_mode(handle, ON) == pynvml.NVML_SUCCESS
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        nvml.device_set_mig_mode(handle, 2)


@pytest.mark.parametrize("model", ["L4", "T4", "L40S"])
def test_mig_calls_are_not_supported_on_gpus_without_mig(model):
    nvml = _nvml(model)
    handle = nvml.device_get_handle_by_index(0)
    calls = [
        lambda: nvml.device_get_mig_mode(handle),
        lambda: nvml.device_set_mig_mode(handle, ON),
        lambda: nvml.device_get_gpu_instance_profile_info(handle, 0),
        lambda: nvml.device_get_gpu_instance_possible_placements(handle, 19),
        lambda: nvml.device_create_gpu_instance(handle, 19),
        lambda: nvml.device_create_gpu_instance_with_placement(handle, 19, _place(0, 1)),
        lambda: nvml.device_get_mig_device_handle_by_index(handle, 0),
    ]
    for call in calls:
        with pytest.raises(pynvml.NVMLError_NotSupported):
            call()
    assert nvml.device_get_max_mig_device_count(handle) == 0
    assert nvml.device_is_mig_device_handle(handle) is False


# Static MIG from a profile file.


STATIC = {
    "driverVersion": "580.95.05",
    "cudaDriverVersion": 13000,
    "gpus": [
        {
            "model": "H100-SXM5-80GB",
            "busId": "00000000:1B:00.0",
            "migDevices": [
                {"profileId": 9, "start": 4},
                {"profileId": 14, "start": 0},
                {"profileId": 19, "start": 2, "computeInstance": False},
            ],
        },
        {"model": "H100-SXM5-80GB", "busId": "00000000:43:00.0"},
    ],
}


def _static(tmp_path, doc=STATIC, node="node-a") -> SimulatedNvml:
    path = tmp_path / "static-mig.yaml"
    path.write_text(yaml.safe_dump(doc))
    nvml = SimulatedNvml(load_profile(str(path), node))
    nvml.init()
    return nvml


def test_static_mig_profile_starts_with_mig_on_and_its_devices_present(tmp_path):
    nvml = _static(tmp_path)
    handle = nvml.device_get_handle_by_index(0)
    assert nvml.device_get_mig_mode(handle) == [ON, ON]
    assert nvml.device_get_mig_mode(nvml.device_get_handle_by_index(1)) == [OFF, OFF]
    assert _layout(nvml, handle) == [(9, 4), (14, 0), (19, 2)]
    devices = [nvml.device_get_mig_device_handle_by_index(handle, i) for i in range(2)]
    with pytest.raises(pynvml.NVMLError_NotFound):  # the 1g has no CI, so no MIG device
        nvml.device_get_mig_device_handle_by_index(handle, 2)
    memory = sorted(nvml.device_get_memory_info(d).total // 2**20 for d in devices)
    assert memory == [20096, 40448]
    # The DRA driver's static-MIG walk: MIG handle -> GI id -> GI info.
    profiles = sorted(
        nvml.gpu_instance_get_info(
            nvml.device_get_gpu_instance_by_id(handle, nvml.device_get_gpu_instance_id(d))
        ).profileId
        for d in devices
    )
    assert profiles == [9, 14]
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        nvml.device_create_gpu_instance_with_placement(handle, 19, _place(2, 1))


def test_static_mig_uuids_are_stable_per_node_and_differ_between_nodes(tmp_path):
    def uuids(node: str) -> list[str]:
        nvml = _static(tmp_path, node=node)
        handle = nvml.device_get_handle_by_index(0)
        return [
            nvml.device_get_uuid(nvml.device_get_mig_device_handle_by_index(handle, i))
            for i in range(2)
        ]

    assert uuids("node-a") == uuids("node-a")
    assert all(MIG_UUID.match(u) for u in uuids("node-a"))
    assert not set(uuids("node-a")) & set(uuids("node-b"))


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ({"model": "L4", "migDevices": [{"profileId": 19, "start": 0}]}, "no MIG"),
        (
            {
                "model": "H100-SXM5-80GB",
                "migMode": [0, 0],
                "migDevices": [{"profileId": 19, "start": 0}],
            },
            "need MIG on",
        ),
        (
            {"model": "H100-SXM5-80GB", "migDevices": [{"profileId": 4, "start": 0}]},
            "no GPU-instance profile ID 4",
        ),
        (
            {"model": "H100-SXM5-80GB", "migDevices": [{"profileId": 9, "start": 2}]},
            "possible starts [0, 4]",
        ),
        (
            {
                "model": "H100-SXM5-80GB",
                "migDevices": [{"profileId": 9, "start": 0}, {"profileId": 5, "start": 0}],
            },
            "must not overlap",
        ),
        (
            {"model": "H100-SXM5-80GB", "migDevices": [{"profileId": 9, "begin": 0}]},
            "unknown fields",
        ),
    ],
)
def test_bad_static_mig_is_a_profile_error_saying_what_to_fix(gpu, message):
    doc = {
        "driverVersion": "580.95.05",
        "cudaDriverVersion": 13000,
        "gpus": [{"busId": "00000000:01:00.0", **gpu}],
    }
    with pytest.raises(ProfileError, match=re.escape(message)):
        parse_profile(doc, name="bad", node_name="node-a")


def test_faults_can_be_injected_into_mig_calls_of_one_gpu():
    nvml, handle = _mig_on(faults={"gpu_instance_create_compute_instance": "NO_PERMISSION"})
    gi = nvml.device_create_gpu_instance_with_placement(handle, 19, _place(0, 1))
    with pytest.raises(pynvml.NVMLError_NoPermission):
        nvml.gpu_instance_create_compute_instance(gi, 0)
    assert _layout(nvml, handle) == [(19, 0)]  # the GI stays: a half-made slice to clean up


# Backends stay in step with the Protocol.


@pytest.mark.parametrize("backend", [SimulatedNvml, RealNvml])
def test_backends_implement_every_nvml_call_with_the_protocol_parameters(backend):
    for name in (n for n in dir(NvmlLibrary) if not n.startswith("_")):
        expected = list(inspect.signature(getattr(NvmlLibrary, name)).parameters)
        assert list(inspect.signature(getattr(backend, name)).parameters) == expected, name
