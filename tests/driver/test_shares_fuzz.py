"""Fuzzing how an allocation result's ``consumedCapacity`` is read as an MPS share (Hypothesis;
profiles in tests/fuzzing.py, docs/development.md): a share within the GPU, or a `ShareError`
naming the device, never another exception."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpu_dra.driver.model import Gpu
from gpu_dra.driver.shares import MIB, ShareError, consumed_share, whole_gpu
from tests.fuzzing import attempt, cases, hostile, json_values, mutated, texts

GPU = Gpu(
    index=0,
    minor=4,
    uuid="GPU-a75cda02-62ce-2c30-9150-555ef08935e2",
    product_name="NVIDIA H100 80GB HBM3",
    brand=14,
    architecture=9,
    cuda_compute_capability=(9, 0),
    driver_version="580.65.06",
    cuda_driver_version=13000,
    pci_bus_id="0000:65:00.0",
    pci_device_id=0x233010DE,
    memory_bytes=81559 * MIB,
)

amounts = st.one_of(
    st.integers(0, 90_000).map(lambda n: f"{n}Mi"),
    st.integers(0, 120).map(str),
    st.sampled_from(["80Gi", "1Gi", "0.5", "1e2", "100m", "-1", "1Ei", "nope"]),
    texts,
)
valid_consumed = st.fixed_dictionaries(
    {},
    optional={
        "memory": amounts,
        "compute": amounts,
        "gpu.nvidia.com/memory": amounts,
        "example.com/other": amounts,
    },
)
consumed = st.one_of(
    valid_consumed,
    mutated(valid_consumed, python=True).map(lambda change: change[0]),
    json_values(python=True),
    hostile(python=True),
)


@cases(ci=150, full=5_000)
@given(consumed)
def test_consumed_capacity_is_a_share_of_the_gpu_or_a_share_error(value: object) -> None:
    size = attempt(lambda: consumed_share(value, GPU), ShareError)
    if isinstance(size, ShareError):
        assert str(size).startswith("consumedCapacity of gpu-4: ")
        assert len(str(size)) < 400
        return
    whole = whole_gpu(GPU)
    assert 0 < size.memory_bytes <= whole.memory_bytes
    assert size.memory_bytes % MIB == 0
    assert 0 < size.compute_percent <= 100
