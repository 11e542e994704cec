"""Decisions of the validating admission webhook: an AdmissionReview v1 in, one out. Pure.

A CREATE or UPDATE of a ResourceClaim, ResourceClaimTemplate or DeviceClass (resource.k8s.io v1,
v1beta2, v1beta1) is denied (HTTP 422, reason Invalid) when one of its opaque config entries for
the driver does not decode or validate; the message is the kubelet plugin's, located by the
entry's path (`gpu_dra.driver.config.objects`). An UPDATE that leaves the config list unchanged
is allowed, so that old objects stay editable (finalizers). Other drivers' entries, subresources
and other operations are allowed; a resource this webhook does not know is denied (a
misconfigured webhook). The HTTPS shell is `gpu_dra.controller.webhook`;
docs/deployment.md#admission-webhook.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Final

from gpu_dra.driver import jsonbounds
from gpu_dra.driver.config.objects import check_config_list, config_list
from gpu_dra.driver.jsonbounds import describe

REVIEW_API_VERSION: Final = "admission.k8s.io/v1"
REVIEW_KIND: Final = "AdmissionReview"

GROUP: Final = "resource.k8s.io"
VERSIONS: Final = ("v1", "v1beta2", "v1beta1")
KINDS: Final[dict[str, str]] = {
    "resourceclaims": "ResourceClaim",
    "resourceclaimtemplates": "ResourceClaimTemplate",
    "deviceclasses": "DeviceClass",
}
"""Resource (plural) -> kind, of the resources validated."""

VALIDATED_OPERATIONS: Final = ("CREATE", "UPDATE")

_PLAIN: Final = re.compile(r"[a-z0-9.-]{0,63}")


class BadReviewError(ValueError):
    """The body is not an AdmissionReview v1 with a request: answered with HTTP 400."""


@dataclass(frozen=True)
class Verdict:
    """Whether the request is allowed, and if not why (``code`` and ``reason`` as in a Status)."""

    allowed: bool
    message: str = ""
    code: int = HTTPStatus.OK
    reason: str = ""

    def status(self) -> dict[str, Any]:
        """The response's ``status`` (a metav1.Status), for a denial."""
        return {"code": int(self.code), "reason": self.reason, "message": self.message}


ALLOWED: Final = Verdict(allowed=True)


def parse_review(body: bytes) -> Mapping[str, Any]:
    """The AdmissionReview in `body`; `BadReviewError` if it is not one of v1 with a request."""
    try:
        review = jsonbounds.loads(body)  # any depth or integer size: the config check refuses it
    except ValueError as error:  # json.JSONDecodeError, UnicodeDecodeError
        raise BadReviewError(f"the body is not valid JSON: {error}") from error
    if not isinstance(review, Mapping):
        raise BadReviewError("the body is not a JSON object")
    api_version, kind = review.get("apiVersion"), review.get("kind")
    if (api_version, kind) != (REVIEW_API_VERSION, REVIEW_KIND):
        raise BadReviewError(
            f"expected an {REVIEW_KIND} of {REVIEW_API_VERSION}, got kind {kind!r} of "
            f"apiVersion {api_version!r}"
        )
    request = review.get("request")
    if not isinstance(request, Mapping) or not isinstance(request.get("uid"), str):
        raise BadReviewError("the AdmissionReview has no request with a uid")
    return review


def decide(request: Mapping[str, Any], *, driver: str) -> Verdict:
    """The verdict on one admission request (``AdmissionReview.request``). Any JSON in it gets a
    verdict, never an exception: a ``resource`` that is no object of strings is denied as a
    resource this webhook does not validate."""
    resource = request.get("resource")
    if not isinstance(resource, Mapping):
        return _not_validated(driver, f"a resource that is {describe(resource)}")
    group, version, plural = (resource.get(key) for key in ("group", "version", "resource"))
    if (
        group != GROUP
        or not isinstance(version, str)
        or version not in VERSIONS
        or not isinstance(plural, str)
        or plural not in KINDS
    ):
        return _not_validated(driver, f"{_shown(group)}/{_shown(version)} {_shown(plural)}")
    if request.get("subResource") or request.get("operation") not in VALIDATED_OPERATIONS:
        return ALLOWED
    kind = KINDS[plural]
    obj = request.get("object")
    if not isinstance(obj, Mapping):
        return Verdict(
            allowed=False,
            code=HTTPStatus.BAD_REQUEST,
            reason="BadRequest",
            message=f"the {request.get('operation')} request carries no {kind} object",
        )
    old = request.get("oldObject")
    if (
        request.get("operation") == "UPDATE"
        and isinstance(old, Mapping)
        and config_list(kind, old) == config_list(kind, obj)
    ):
        return ALLOWED
    checks = check_config_list(kind, obj, driver=driver)
    errors = [check for check in checks if check.verdict == "ERROR"]
    if not errors:
        return ALLOWED
    return Verdict(
        allowed=False,
        code=HTTPStatus.UNPROCESSABLE_ENTITY,
        reason="Invalid",
        message="; ".join(str(check) for check in errors),
    )


def _not_validated(driver: str, what: str) -> Verdict:
    return Verdict(
        allowed=False,
        code=HTTPStatus.BAD_REQUEST,
        reason="BadRequest",
        message=f"the {driver} webhook does not validate {what}: it validates "
        f"{', '.join(KINDS)} of {GROUP} {', '.join(VERSIONS)}",
    )


def _shown(value: object) -> str:
    """A resource's group, version or plural for a message: as is when a short plain name
    (the empty core group too), else quoted and shortened, or its JSON type."""
    if isinstance(value, str) and _PLAIN.fullmatch(value):
        return value
    return describe(value)


def response(review: Mapping[str, Any], verdict: Verdict) -> dict[str, Any]:
    """The AdmissionReview answering `review` with `verdict`."""
    answer: dict[str, Any] = {"uid": review["request"]["uid"], "allowed": verdict.allowed}
    if not verdict.allowed:
        answer["status"] = verdict.status()
    return {"apiVersion": REVIEW_API_VERSION, "kind": REVIEW_KIND, "response": answer}


def review(body: bytes, *, driver: str) -> tuple[dict[str, Any], Verdict]:
    """The AdmissionReview answering the one in `body`, and the verdict in it; `BadReviewError` if
    `body` is not an AdmissionReview v1 with a request."""
    request_review = parse_review(body)
    verdict = decide(request_review["request"], driver=driver)
    return response(request_review, verdict), verdict
