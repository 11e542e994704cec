"""The right-sizing rule on realistic cases: needs with headroom, the smallest MIG profile of
the model, MPS share amounts (whole GiB, 5 % steps, at most half the GPU), the whole GPU, what
is recommended among what the cluster offers, and what is said when something is not known."""

from __future__ import annotations

import pytest

from gpu_dra.driver.rightsizing import (
    GIB,
    Advice,
    GpuShape,
    Held,
    Observed,
    advise,
    gpu_shape,
    offered_options,
)

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"


def shape(product: str) -> GpuShape:
    found = gpu_shape(product)
    assert found is not None
    return found


def kinds(advice: Advice) -> list[tuple[str, str | None]]:
    return [(o.kind, o.profile or o.text()) for o in advice.options]


def test_a100_at_6gib_and_12_percent() -> None:
    advice = advise(shape(A100), Observed(6 * GIB, 12, 1), Held("gpu"))
    assert advice.need_memory_bytes == pytest.approx(6.6 * GIB)
    assert advice.need_compute_percent == pytest.approx(13.2)
    assert kinds(advice) == [
        ("mig", "1g.10gb"),  # 9.5 GiB, 14 of 98 SMs (14.3 %)
        ("mps-share", "a 7Gi / 15 % MPS share"),
        ("gpu", "the whole GPU"),
    ]
    assert advice.recommended().profile == "1g.10gb"  # type: ignore[union-attr]
    assert advice.recommended({"gpu", "mps-share"}).kind == "mps-share"  # type: ignore[union-attr]
    assert advice.recommended(set()).profile == "1g.10gb"  # type: ignore[union-attr]
    assert advice.notes == ()
    assert not advice.unused


def test_more_headroom_moves_to_the_next_profile() -> None:
    advice = advise(shape(A100), Observed(6 * GIB, 12, 1), Held("gpu"), headroom_percent=25)
    # 15 % of compute is more than a 1g's 14.3 %: a 2g.20gb, larger than the 8Gi / 15 % share
    assert kinds(advice) == [
        ("mps-share", "a 8Gi / 15 % MPS share"),
        ("mig", "2g.20gb"),
        ("gpu", "the whole GPU"),
    ]


def test_h100_at_70gib_gets_the_whole_gpu_or_a_7g() -> None:
    advice = advise(shape(H100), Observed(70 * GIB, 60, 1), Held("gpu"))
    # 77 GiB: more than half the GPU, so no share; the 7g (79.25 GiB) and the GPU tie at 100 %
    assert kinds(advice) == [("gpu", "the whole GPU"), ("mig", "7g.80gb")]
    assert advice.recommended().kind == "gpu"  # type: ignore[union-attr]
    tight = advise(shape(H100), Observed(70 * GIB, 60, 1), Held("gpu"), headroom_percent=20)
    assert kinds(tight) == [("gpu", "the whole GPU")]
    assert "less than 20 % memory headroom even on the whole GPU" in tight.notes


def test_a_mig_claim_without_utilization_keeps_its_compute() -> None:
    h100 = shape(H100)
    (slice_1g20,) = [m for m in h100.mig if m.name == "1g.20gb"]
    advice = advise(h100, Observed(5 * GIB, None, 1), Held("mig", slice_1g20.compute_percent,
                                                           "1g.20gb"))  # fmt: skip
    assert not advice.compute_observed
    assert advice.need_compute_percent == pytest.approx(100 * 26 / 132)
    # 5.5 GiB fits a 1g.10gb, but it has 16 SMs, fewer than the 26 the claim holds
    assert kinds(advice) == [
        ("mps-share", "a 6Gi / 20 % MPS share"),
        ("mig", "1g.20gb"),
        ("gpu", "the whole GPU"),
    ]
    assert any("NVML reports no SM utilization on this MIG device" in note for note in advice.notes)


def test_an_unused_claim_is_said_so() -> None:
    advice = advise(shape(A100), Observed(0, 0, 0), Held("gpu"))
    assert advice.unused
    assert kinds(advice)[:2] == [("mps-share", "a 1Gi / 5 % MPS share"), ("mig", "1g.10gb")]
    assert any("unused" in note for note in advice.notes)
    busy_mig = advise(shape(H100), Observed(GIB, None, 1), Held("mig", 100.0, "7g.80gb"))
    assert not busy_mig.unused


def test_memory_never_read_gives_no_advice() -> None:
    advice = advise(shape(A100), Observed(None, 50, 1), Held("gpu"))
    assert advice.options == ()
    assert advice.recommended() is None
    assert advice.notes == ("its memory use was never read: no advice",)


def test_time_sliced_utilization_is_the_gpus() -> None:
    advice = advise(shape(A100), Observed(2 * GIB, 30, 1), Held("timeslicing"))
    assert any("all its claims together" in note for note in advice.notes)


def test_products_gpu_dra_does_not_know() -> None:
    assert gpu_shape("NVIDIA Future GPU") is None
    future = gpu_shape("NVIDIA Future GPU", 100 * GIB)
    assert future is not None
    assert future.mig == ()
    advice = advise(future, Observed(10 * GIB, 20, 1), Held("gpu"))
    assert kinds(advice) == [("mps-share", "a 11Gi / 25 % MPS share"), ("gpu", "the whole GPU")]
    l4 = shape("NVIDIA L4")  # known, no MIG
    assert l4.mig == ()


def test_offered_options_read_the_published_devices() -> None:
    def device(kind: str, **extra: object) -> dict[str, object]:
        attributes = {"type": {"string": kind}, "productName": {"string": H100}}
        if kind == "mig":
            attributes["profile"] = {"string": "1g.10gb"}
        return {"name": "d", "attributes": attributes, **extra}

    shared = device("gpu", allowMultipleAllocations=True, capacity={"compute": {"value": "100"}})
    capped = dict(shared, attributes={**shared["attributes"], "cappedShares": {"bool": True}})  # type: ignore[dict-item]
    other = {"name": "x", "attributes": {"type": {"string": "gpu"},
                                         "productName": {"string": A100}}}  # fmt: skip
    assert offered_options([device("gpu"), device("mig")], H100, "gpu.nvidia.com") == {
        "gpu",
        "mig:1g.10gb",
    }
    # offered as shares: share-only, not a whole GPU (nor a MIG device)
    assert offered_options([shared], H100, "gpu.nvidia.com") == {"mps-share"}
    shared_mig = device(
        "mig", allowMultipleAllocations=True, capacity={"compute": {"value": "100"}}
    )
    assert offered_options([shared_mig], H100, "gpu.nvidia.com") == set()
    assert offered_options([capped, other], H100, "gpu.nvidia.com") == set()


def test_a_hopper_mig_devices_utilization_is_scaled_to_the_gpu() -> None:
    h100 = shape(H100)
    (slice_3g,) = [m for m in h100.mig if m.name == "3g.40gb"]
    advice = advise(
        h100, Observed(5 * GIB, 40, 1), Held("mig", slice_3g.compute_percent, "3g.40gb")
    )
    # 40 % of the slice's 60 SMs: 18.2 % of the GPU's 132; with 10 % headroom 20 %
    assert advice.compute_observed
    assert advice.need_compute_percent == pytest.approx(40 * 60 / 132 * 1.1)
    assert kinds(advice) == [
        ("mps-share", "a 6Gi / 20 % MPS share"),
        ("mig", "2g.20gb"),
        ("gpu", "the whole GPU"),
    ]
    assert any("of its own SMs" in note for note in advice.notes)


def test_no_sm_activity_in_any_sample_is_unused() -> None:
    advice = advise(shape(H100), Observed(2 * GIB, 0, 1), Held("gpu"))
    assert advice.unused  # a notebook holding its context, never computing
