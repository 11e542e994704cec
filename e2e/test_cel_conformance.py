"""The CEL conformance table (tests/cel_conformance.py) against the real apiserver and scheduler.

- Compile errors: a DeviceClass with the case's selector is rejected by the apiserver (dry run);
  every other case's selector is accepted. The same for docs/cel.md's table of common mistakes
  (tests/cel_mistakes.py), whose suggestions must all be accepted.
- The rest: the table's devices are published as ResourceSlices on the e2e node under the test
  drivers of the table (gpu-dra's plugin is not involved: allocation is all that is observed),
  one device per case, marked with ``e2e.gpu-dra.test/case``. Each case gets a claim whose first
  selector picks its device by that mark (the scheduler evaluates a request's selectors in order
  and stops at the first false one) and whose second selector is the case's expression, and a pod
  using it. Match -> the claim is allocated that device; no match -> the pod's FailedScheduling
  event says "cannot allocate all claims"; runtime error -> the event carries the scheduler's
  "CEL runtime error" and the case's message.

All disagreements are collected and reported together. The pods never run (no plugin serves the
test drivers); they are force-deleted, and the slices and the DeviceClass are removed at the end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.exceptions import ApiException

from e2e import manifests as m
from e2e.cluster import versions
from e2e.kube import Kube, wait_for
from gpu_dra.driver.resourceapi import Device
from tests.cel_conformance import CASES, COMPILE, MATCH, NO_MATCH, RUNTIME, Case, devices
from tests.cel_mistakes import mistakes

pytestmark = pytest.mark.e2e

CLASS = "cel-conformance.gpu-dra.test"
MARK_DOMAIN = "e2e.gpu-dra.test"
POOL = "cel-conformance"
RESOURCE = "resource.k8s.io/v1"
# What the scheduler said per case (the last run), for reading messages and for docs/cel.md.
RECORD = (
    Path(os.environ.get("GPU_DRA_CACHE", Path.home() / ".cache" / "gpu-dra"))
    / "e2e-logs"
    / "cel-conformance.json"
)


def device_class(name: str, expression: str) -> dict[str, Any]:
    return {
        "apiVersion": RESOURCE,
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def test_apiserver_rejects_exactly_the_selectors_that_do_not_compile(kube: Kube) -> None:
    resource = kube.client.resources.get(api_version=RESOURCE, kind="DeviceClass")
    disagreements = []
    for index, case in enumerate(CASES):
        body = device_class(f"cel-conformance-{index:02d}", case.expression)
        try:
            resource.create(body=body, dry_run="All")
        except ApiException as error:
            if error.status != 422:
                raise
            message = _status_message(error)
            if case.expected != COMPILE:
                disagreements.append(
                    f"#{index:02d} rejected: {case.expression[:100]!r}: {message[:400]}"
                )
            elif case.message not in message:
                disagreements.append(
                    f"#{index:02d} message lacks {case.message!r}: {message[:400]}"
                )
            continue
        if case.expected == COMPILE:
            disagreements.append(f"#{index:02d} accepted: {case.expression[:100]!r}")
    assert not disagreements, "\n".join(disagreements)


def test_apiserver_agrees_with_the_table_of_common_mistakes(kube: Kube) -> None:
    """docs/cel.md's table of what `gpu-dra lint` teaches: a compile-error row is rejected with
    the table's words, a runtime-error row is accepted, and every suggestion is accepted."""
    resource = kube.client.resources.get(api_version=RESOURCE, kind="DeviceClass")
    disagreements = []
    for index, row in enumerate(mistakes()):
        for what, expression, rejected_with in (
            ("selector", row.selector, row.message if row.outcome == COMPILE else None),
            ("suggestion", row.suggestion, None),
        ):
            body = device_class(f"cel-mistake-{index:02d}", expression)
            try:
                resource.create(body=body, dry_run="All")
            except ApiException as error:
                if error.status != 422:
                    raise
                message = _status_message(error)
                if rejected_with is None:
                    disagreements.append(f"row {index} {what} rejected: {message[:400]}")
                elif rejected_with not in message:
                    disagreements.append(
                        f"row {index} {what}: message lacks {rejected_with!r}: {message[:400]}"
                    )
                continue
            if rejected_with is not None:
                disagreements.append(f"row {index} {what} accepted: {expression!r}")
    assert not disagreements, "\n".join(disagreements)


def _status_message(error: ApiException) -> str:
    """The apiserver's message from a Status body (JSON escapes such as \u003e decoded)."""
    try:
        return str(json.loads(error.body).get("message", ""))
    except (TypeError, ValueError):
        return str(error.body)


def _case_device(index: int, published: Device) -> Device:
    device = copy.deepcopy(published)
    device["name"] = f"c{index:02d}"
    device.setdefault("attributes", {})[f"{MARK_DOMAIN}/case"] = {"int": index}
    return device


def _slice(driver: str, pool_devices: list[Device]) -> dict[str, Any]:
    return {
        "apiVersion": RESOURCE,
        "kind": "ResourceSlice",
        "metadata": {"generateName": f"{POOL}-{driver}-"},
        "spec": {
            "driver": driver,
            "pool": {"name": POOL, "generation": 1, "resourceSliceCount": 1},
            "nodeName": versions.NODE_NAME,
            "devices": pool_devices,
        },
    }


@pytest.fixture
def published(kube: Kube) -> Iterator[dict[int, Case]]:
    """The ResourceSlices (one per test driver) and the DeviceClass; the cases they serve."""
    evaluated = {i: case for i, case in enumerate(CASES) if case.expected != COMPILE}
    by_driver: dict[str, list[Device]] = {}
    table = devices()
    for index, case in evaluated.items():
        driver, device = table[case.device]
        by_driver.setdefault(driver, []).append(_case_device(index, device))
    created = []
    try:
        kube.create(device_class(CLASS, f"'case' in device.attributes['{MARK_DOMAIN}']"))
        for driver, pool_devices in by_driver.items():
            created.append(kube.create(_slice(driver, pool_devices))["metadata"]["name"])
        yield evaluated
    finally:
        for name in created:
            kube.delete(RESOURCE, "ResourceSlice", name)
        kube.delete(RESOURCE, "DeviceClass", CLASS)


def _observed(kube: Kube, namespace: str, cases: dict[int, Case]) -> dict[int, tuple[str, str]]:
    """(outcome, detail) per case once the scheduler decided: allocated device, or the event."""
    seen: dict[int, tuple[str, str]] = {}

    def decided() -> bool:
        for claim in kube.list(RESOURCE, "ResourceClaim", namespace=namespace):
            index = int(claim["metadata"]["name"][1:])
            allocation = (claim.get("status") or {}).get("allocation")
            if allocation:
                results = allocation["devices"]["results"]
                seen[index] = (MATCH, ",".join(r["device"] for r in results))
        for event in kube.list("v1", "Event", namespace=namespace):
            name = event.get("involvedObject", {}).get("name", "")
            if event.get("reason") != "FailedScheduling" or not name.startswith("c"):
                continue
            index = int(name[1:])
            message = event.get("message", "")
            if index in seen and seen[index][0] == MATCH:
                continue
            if "CEL runtime error" in message:
                seen[index] = (RUNTIME, message)
            elif "cannot allocate all claims" in message:
                seen[index] = (NO_MATCH, message)
            else:
                seen.setdefault(index, ("other event", message))
        return set(seen) == set(cases) and all(o != "other event" for o, _ in seen.values())

    with contextlib.suppress(TimeoutError):  # undecided cases are reported one by one
        wait_for("the scheduler to decide every case", decided, timeout=300, interval=3)
    return seen


def test_scheduler_gives_every_case_its_outcome(
    kube: Kube, namespace: str, published: dict[int, Case]
) -> None:
    started = time.monotonic()
    disagreements = []
    for index, case in list(published.items()):
        selectors = [f"device.attributes['{MARK_DOMAIN}'].case == {index}", case.expression]
        spec = m.claim_spec([m.request(device_class=CLASS, selectors=selectors)])
        try:
            kube.create(m.claim(f"c{index:02d}", namespace, spec))
        except ApiException as error:
            disagreements.append(f"#{index:02d} claim rejected: {str(error.body)[:400]}")
            del published[index]
            continue
        kube.create(m.gpu_pod(f"c{index:02d}", namespace, claim=f"c{index:02d}"))
    try:
        seen = _observed(kube, namespace, published)
    finally:
        for index in published:
            kube.delete("v1", "Pod", f"c{index:02d}", namespace, grace_period_seconds=0)
    for index, case in published.items():
        outcome, detail = seen.get(index, ("undecided", ""))
        wanted = {
            MATCH: (MATCH, f"c{index:02d}"),
            NO_MATCH: (NO_MATCH, ""),
            RUNTIME: (RUNTIME, case.message),
        }[case.expected]
        if outcome != wanted[0] or wanted[1] not in detail:
            disagreements.append(
                f"#{index:02d} {case.expression[:100]!r} on {case.device}: expected "
                f"{case.expected} {case.message!r}, cluster: {outcome} {detail[:300]!r}"
            )
    print(f"scheduler decided {len(seen)} cases in {time.monotonic() - started:.0f}s")
    record = {
        f"{i:02d}": {"case": published[i].expression[:200], "cluster": seen.get(i)}
        for i in published
    }
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1))
    assert not disagreements, "\n".join(disagreements)
    wait_for(
        "the pods to be gone",
        lambda: not kube.list("v1", "Pod", namespace=namespace),
        timeout=120,
    )
