"""Client errors become typed `ApiError`s that say what failed."""

from __future__ import annotations

import json

import pytest
from kubernetes.client.exceptions import ApiException

from gpu_dra.kube import errors
from gpu_dra.kube.client import translate_api_exception


def status_body(reason: str, message: str = "") -> str:
    return json.dumps({"kind": "Status", "reason": reason, "message": message})


@pytest.mark.parametrize(
    ("status", "reason", "expected"),
    [
        (409, "Conflict", errors.ConflictError),
        (409, "AlreadyExists", errors.AlreadyExistsError),
        (404, "NotFound", errors.NotFoundError),
        (410, "Expired", errors.ResourceExpiredError),
        (422, "Invalid", errors.InvalidError),
        (403, "Forbidden", errors.ForbiddenError),
        (500, "InternalError", errors.ApiError),
    ],
)
def test_api_exceptions_become_typed_errors(
    status: int, reason: str, expected: type[errors.ApiError]
) -> None:
    error = translate_api_exception(
        "update ResourceSlice s1",
        ApiException(status=status, reason=reason, body=status_body(reason, "details here")),
    )

    assert type(error) is expected
    assert error.status == status
    assert "update ResourceSlice s1" in str(error)
    assert "details here" in str(error)


def test_invalid_and_forbidden_errors_are_not_retryable() -> None:
    assert not errors.InvalidError("x").retryable
    assert not errors.ForbiddenError("x").retryable
    assert errors.ConflictError("x").retryable
