"""The admission webhook's decisions (`gpu_dra.controller.admission`): AdmissionReview v1 in and
out, every validated kind and version, the plugin's messages, and what is left alone."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_dra.controller.admission import (
    BadReviewError,
    decide,
    parse_review,
    response,
    review,
)
from gpu_dra.driver.config import ConfigError, resolve_configs
from gpu_dra.driver.config.objects import check_config_list

DRIVER = "gpu.nvidia.com"
REPO = Path(__file__).resolve().parents[2]
VERSIONS = ("v1", "v1beta2", "v1beta1")
BAD_STRATEGY = (
    "parameters.sharing.strategy: unknown GPU sharing strategy 'Often': supported are "
    "TimeSlicing, MPS"
)

Obj = dict[str, Any]


def entry(parameters: Obj, driver: str = DRIVER, requests: list[str] | None = None) -> Obj:
    item: Obj = {"opaque": {"driver": driver, "parameters": parameters}}
    if requests is not None:
        item["requests"] = requests
    return item


def gpu_config(**fields: Any) -> Obj:
    return {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", **fields}


def sharing(strategy: str) -> Obj:
    return gpu_config(sharing={"strategy": strategy})


def claim(*configs: Obj, version: str = "v1") -> Obj:
    request = (
        {"name": "gpu", "deviceClassName": DRIVER}  # v1beta1: the request is "exactly" inline
        if version == "v1beta1"
        else {"name": "gpu", "exactly": {"deviceClassName": DRIVER}}
    )
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a"},
        "spec": {"devices": {"requests": [request], "config": list(configs)}},
    }


def template(*configs: Obj, version: str = "v1") -> Obj:
    spec = claim(*configs, version=version)["spec"]
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "t", "namespace": "team-a"},
        "spec": {"spec": spec},
    }


def device_class(*configs: Obj, version: str = "v1") -> Obj:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceClass",
        "metadata": {"name": "shared.gpu.nvidia.com"},
        "spec": {"config": list(configs)},
    }


MAKERS = {
    "resourceclaims": (claim, "spec.devices.config"),
    "resourceclaimtemplates": (template, "spec.spec.devices.config"),
    "deviceclasses": (device_class, "spec.config"),
}


def request(
    obj: Obj | None,
    resource: str = "resourceclaims",
    version: str = "v1",
    operation: str = "CREATE",
    old: Obj | None = None,
    **extra: Any,
) -> Obj:
    metadata = (obj or old or {}).get("metadata", {})
    return {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": "resource.k8s.io", "version": version, "kind": "ResourceClaim"},
        "resource": {"group": "resource.k8s.io", "version": version, "resource": resource},
        "name": metadata.get("name"),
        "namespace": metadata.get("namespace"),
        "operation": operation,
        "userInfo": {"username": "alice"},
        "object": obj,
        "oldObject": old,
        "dryRun": False,
        **extra,
    }


def envelope(req: Obj) -> bytes:
    return json.dumps(
        {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}
    ).encode()


# ---- every validated kind and version -------------------------------------------------------
@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("resource", list(MAKERS))
def test_valid_configs_are_admitted_for_every_kind_and_version(resource: str, version: str) -> None:
    make, _ = MAKERS[resource]
    obj = make(
        entry(gpu_config()),
        entry(sharing("TimeSlicing")),
        entry(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {}})),
        version=version,
    )

    verdict = decide(request(obj, resource, version), driver=DRIVER)

    assert verdict.allowed, verdict.message


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("resource", list(MAKERS))
def test_an_unknown_sharing_strategy_is_denied_naming_entry_and_field(
    resource: str, version: str
) -> None:
    make, path = MAKERS[resource]
    obj = make(entry(gpu_config()), entry(sharing("Often")), version=version)

    verdict = decide(request(obj, resource, version), driver=DRIVER)

    assert not verdict.allowed
    assert (verdict.code, verdict.reason) == (422, "Invalid")
    assert verdict.message == f"{path}[1]: {BAD_STRATEGY}"


def test_the_message_is_the_kubelet_plugins_for_the_same_claim() -> None:
    # The plugin resolves the allocation's copy of the claim's configs at prepare; its event text
    # is "resource claim <ns>/<name>: " followed by what the webhook says.
    obj = claim(entry(gpu_config(), requests=["gpu"]), entry(sharing("Often"), requests=["gpu"]))
    allocated = [{"source": "FromClaim", **item} for item in obj["spec"]["devices"]["config"]]
    with pytest.raises(ConfigError) as plugin:
        resolve_configs(
            allocated,
            [],
            driver=DRIVER,
            claim="team-a/c",
            spec_configs=obj["spec"]["devices"]["config"],
        )

    verdict = decide(request(obj), driver=DRIVER)

    assert str(plugin.value) == f"resource claim team-a/c: {verdict.message}"


@pytest.mark.parametrize(
    ("parameters", "expected"),
    [
        (
            {"apiVersion": "resource.nvidia.com/v1", "kind": "GpuConfig"},
            "spec.devices.config[0]: parameters.apiVersion: unsupported apiVersion "
            "'resource.nvidia.com/v1': the supported one is resource.nvidia.com/v1beta1",
        ),
        (
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GPUConfig"},
            "spec.devices.config[0]: parameters.kind: unsupported kind 'GPUConfig' of apiVersion "
            "resource.nvidia.com/v1beta1: supported kinds are GpuConfig, MigDeviceConfig",
        ),
        (
            {"kind": "GpuConfig"},
            "spec.devices.config[0]: parameters.apiVersion: apiVersion is missing: set it to "
            "resource.nvidia.com/v1beta1",
        ),
        (
            gpu_config(sharng={"strategy": "MPS"}),
            "spec.devices.config[0]: parameters.sharng: unknown field "
            "(allowed here: apiVersion, kind, sharing)",
        ),
    ],
    ids=["wrong-api-version", "wrong-kind", "no-api-version", "unknown-field"],
)
def test_a_wrong_api_version_kind_or_field_is_denied_with_the_decoders_message(
    parameters: Obj, expected: str
) -> None:
    verdict = decide(request(claim(entry(parameters))), driver=DRIVER)

    assert not verdict.allowed
    assert verdict.message == expected


@pytest.mark.parametrize(
    ("parameters", "reason"),
    [
        ("{not json", "expected a JSON object with apiVersion and kind, got '{not json'"),
        ([1, 2], "expected a JSON object with apiVersion and kind, got an array"),
    ],
    ids=["json-in-a-string", "array"],
)
def test_parameters_that_are_not_a_json_object_are_denied(parameters: object, reason: str) -> None:
    verdict = decide(request(claim(entry(parameters))), driver=DRIVER)  # type: ignore[arg-type]

    assert not verdict.allowed
    assert verdict.message == f"spec.devices.config[0]: parameters: {reason}"


def test_every_bad_entry_is_reported_in_order() -> None:
    obj = claim(entry(sharing("Often")), entry(gpu_config()), entry({"kind": "GpuConfig"}))

    verdict = decide(request(obj), driver=DRIVER)

    assert verdict.message.startswith(f"spec.devices.config[0]: {BAD_STRATEGY}; ")
    assert "; spec.devices.config[2]: parameters.apiVersion: apiVersion is missing" in (
        verdict.message
    )
    assert "config[1]" not in verdict.message


def test_configs_of_other_drivers_are_ignored() -> None:
    obj = claim(entry({"mtu": "not ours to judge"}, driver="nic.example.com"), entry(gpu_config()))

    assert decide(request(obj), driver=DRIVER).allowed


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("resource", list(MAKERS))
@pytest.mark.parametrize("typo", ["gpu.nvidai.com", "gpu.nvidia.co", "mig.nvidia.com"])
def test_this_drivers_config_under_a_misspelt_driver_name_is_denied_with_did_you_mean(
    resource: str, version: str, typo: str
) -> None:
    # Without the webhook the entry is for no driver: the claim would run without the config.
    make, path = MAKERS[resource]
    obj = make(entry(gpu_config()), entry(sharing("TimeSlicing"), driver=typo), version=version)

    verdict = decide(request(obj, resource, version), driver=DRIVER)

    assert not verdict.allowed
    assert (verdict.code, verdict.reason) == (422, "Invalid")
    assert verdict.message == (
        f"{path}[1]: opaque.driver: {typo} is not gpu.nvidia.com, but the parameters are "
        "gpu.nvidia.com's GpuConfig: did you mean gpu.nvidia.com? As written, gpu.nvidia.com "
        "ignores this config"
    )


@pytest.mark.parametrize(
    ("driver", "parameters"),
    [
        # NVIDIA's other driver, with its own kinds of the same API group
        (
            "compute-domain.nvidia.com",
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomainChannelConfig"},
        ),
        ("gpu.example.com", gpu_config()),  # another GPU driver: not a near miss of ours
        ("gpu.nvidia.co", {"apiVersion": "nic.example.com/v1", "kind": "GpuConfig"}),
        ("gpu.nvidia.co", {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "NicConfig"}),
    ],
)
def test_other_drivers_configs_are_not_near_misses(driver: str, parameters: Obj) -> None:
    assert decide(request(claim(entry(parameters, driver=driver))), driver=DRIVER).allowed


def test_the_driver_name_selects_whose_configs_are_judged() -> None:
    obj = claim(entry(sharing("Often")))

    assert decide(request(obj), driver="gpu.example.com").allowed
    assert not decide(request(obj), driver=DRIVER).allowed


def test_an_entry_without_opaque_parameters_is_denied() -> None:
    obj = claim({"requests": ["gpu"]})

    verdict = decide(request(obj), driver=DRIVER)

    assert verdict.message == (
        "spec.devices.config[0]: only opaque parameters are supported by this driver"
    )


def test_objects_without_configs_are_admitted() -> None:
    bare = claim()
    del bare["spec"]["devices"]["config"]

    assert decide(request(bare), driver=DRIVER).allowed
    assert decide(request(device_class(), "deviceclasses"), driver=DRIVER).allowed


def test_the_shipped_catalog_is_admitted() -> None:
    # The webhook leaves the controller's own applies alone (match condition): the catalog must
    # pass on its own.
    files = sorted((REPO / "deviceclasses").glob("*.yaml"))
    assert files
    for path in files:
        obj = yaml.safe_load(path.read_text())
        checks = check_config_list("DeviceClass", obj, driver=DRIVER)
        assert all(c.verdict != "ERROR" for c in checks), (path.name, checks)
        assert decide(request(obj, "deviceclasses"), driver=DRIVER).allowed, path.name


# ---- updates, other operations, subresources, other resources -------------------------------
def test_an_update_that_keeps_a_bad_config_is_admitted() -> None:
    # A claim created before the webhook keeps its bad config; its finalizers must stay editable.
    old = claim(entry(sharing("Often")))
    new = copy.deepcopy(old)
    new["metadata"]["finalizers"] = []

    verdict = decide(request(new, operation="UPDATE", old=old), driver=DRIVER)

    assert verdict.allowed


def test_an_update_that_changes_a_config_is_judged() -> None:
    old = device_class(entry(gpu_config()))
    new = device_class(entry(sharing("Often")))

    verdict = decide(request(new, "deviceclasses", operation="UPDATE", old=old), driver=DRIVER)

    assert not verdict.allowed
    assert verdict.message == f"spec.config[0]: {BAD_STRATEGY}"


@pytest.mark.parametrize("operation", ["DELETE", "CONNECT"])
def test_other_operations_are_admitted(operation: str) -> None:
    bad = claim(entry(sharing("Often")))

    assert decide(request(None, operation=operation, old=bad), driver=DRIVER).allowed


def test_status_updates_are_admitted() -> None:
    bad = claim(entry(sharing("Often")))

    verdict = decide(
        request(bad, operation="UPDATE", old=claim(), subResource="status"), driver=DRIVER
    )

    assert verdict.allowed


@pytest.mark.parametrize(
    "resource",
    [
        {"group": "resource.k8s.io", "version": "v1", "resource": "resourceslices"},
        {"group": "resource.k8s.io", "version": "v1alpha3", "resource": "resourceclaims"},
        {"group": "", "version": "v1", "resource": "pods"},
    ],
    ids=["resourceslices", "v1alpha3", "pods"],
)
def test_a_resource_it_does_not_validate_is_denied_as_a_bad_request(resource: Obj) -> None:
    req = request(claim(entry(gpu_config())))
    req["resource"] = resource

    verdict = decide(req, driver=DRIVER)

    assert not verdict.allowed
    assert (verdict.code, verdict.reason) == (400, "BadRequest")
    assert "does not validate" in verdict.message
    assert resource["resource"] in verdict.message


LONG_GROUP = "resource.k8s.io\n" * 100


@pytest.mark.parametrize(
    ("resource", "shown"),
    [
        (["resourceclaims"], "a resource that is an array"),
        ("resourceclaims", "a resource that is 'resourceclaims'"),
        (None, "a resource that is null"),
        (
            {"group": "resource.k8s.io", "version": "v1", "resource": ["resourceclaims"]},
            "resource.k8s.io/v1 an array",
        ),
        (
            {"group": "resource.k8s.io", "version": {"v": 1}, "resource": "resourceclaims"},
            "resource.k8s.io/an object resourceclaims",
        ),
        (
            {"group": ["resource.k8s.io"], "version": 1, "resource": {}},
            "an array/number 1 an object",
        ),
        (
            {"group": LONG_GROUP, "version": "v1", "resource": "resourceclaims"},
            repr(LONG_GROUP[:37] + "...") + "/v1 resourceclaims",  # one line, shortened
        ),
    ],
    ids=["list", "string", "null", "plural-list", "version-object", "all-odd", "long-group"],
)
def test_a_resource_that_is_no_object_of_names_is_denied_as_a_bad_request(
    resource: object, shown: str
) -> None:
    req = request(claim(entry(gpu_config())))
    req["resource"] = resource

    verdict = decide(req, driver=DRIVER)

    assert not verdict.allowed
    assert (verdict.code, verdict.reason) == (400, "BadRequest")
    assert verdict.message == (
        f"the {DRIVER} webhook does not validate {shown}: it validates resourceclaims, "
        "resourceclaimtemplates, deviceclasses of resource.k8s.io v1, v1beta2, v1beta1"
    )


def test_a_create_without_an_object_is_denied() -> None:
    verdict = decide(request(None), driver=DRIVER)

    assert not verdict.allowed
    assert verdict.message == "the CREATE request carries no ResourceClaim object"


# ---- AdmissionReview in and out -------------------------------------------------------------
def test_the_answer_is_an_admission_review_with_the_requests_uid() -> None:
    req = request(claim(entry(sharing("Often"))))

    answer, verdict = review(envelope(req), driver=DRIVER)

    assert answer == {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "response": {
            "uid": req["uid"],
            "allowed": False,
            "status": {
                "code": 422,
                "reason": "Invalid",
                "message": f"spec.devices.config[0]: {BAD_STRATEGY}",
            },
        },
    }
    assert json.loads(json.dumps(answer)) == answer
    assert not verdict.allowed


def test_an_admitted_request_gets_no_status() -> None:
    req = request(claim(entry(gpu_config())))

    answer, _ = review(envelope(req), driver=DRIVER)

    assert answer["response"] == {"uid": req["uid"], "allowed": True}


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        (b"{not json", "the body is not valid JSON"),
        (b"\xff\xfe", "the body is not valid JSON"),
        (b"[]", "the body is not a JSON object"),
        (
            json.dumps({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}),
            "expected an AdmissionReview of admission.k8s.io/v1, got kind 'AdmissionReview' of "
            "apiVersion 'admission.k8s.io/v1beta1'",
        ),
        (
            json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}),
            "the AdmissionReview has no request with a uid",
        ),
    ],
    ids=["malformed-json", "not-utf8", "array", "v1beta1-review", "no-request"],
)
def test_a_body_that_is_not_an_admission_review_v1_is_a_bad_review(
    body: bytes | str, complaint: str
) -> None:
    raw = body.encode() if isinstance(body, str) else body
    with pytest.raises(BadReviewError) as error:
        parse_review(raw)

    assert str(error.value).startswith(complaint)


@pytest.mark.parametrize(
    ("parameters", "complaint"),
    [
        (
            '{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": '
            + '{"a": ' * 5000
            + "{}"
            + "}" * 5000
            + "}",
            "spec.devices.config[0]: parameters.sharing.a.a.a.a.a.a...(+25 more): nested too "
            "deeply: at most 32 levels of objects and arrays are allowed",
        ),
        (
            '{"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig", "sharing": '
            '{"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": ' + "9" * 5000 + "}}}",
            "spec.devices.config[0]: parameters.sharing.timeSlicingConfig.interval: ",
        ),
    ],
    ids=["deep", "huge-integer"],
)
def test_a_review_beyond_json_bounds_is_read_and_its_config_denied_naming_the_field(
    parameters: str, complaint: str
) -> None:
    """These raised RecursionError (a 500) or were a bad review (400) before: the bounded
    decoder reads them, and the config check names the field."""
    req = request(claim(entry({"placeholder": True})))
    body = envelope(req).replace(b'{"placeholder": true}', parameters.encode())

    answer, verdict = review(body, driver=DRIVER)

    assert not verdict.allowed
    assert (verdict.code, verdict.reason) == (422, "Invalid")
    assert verdict.message.startswith(complaint)
    assert "\n" not in verdict.message
    assert answer["response"]["uid"] == req["uid"]


def test_response_keeps_the_uid_of_the_review_it_answers() -> None:
    parsed = parse_review(envelope(request(claim())))

    assert response(parsed, decide(parsed["request"], driver=DRIVER))["response"]["uid"] == (
        "705ab4f5-6393-11e8-b7cc-42010a800002"
    )
