"""Kubernetes API errors as gpu-dra sees them, independent of the client library.

Adapters translate client exceptions into these (`client.translated_errors`); callers only catch
these. `retryable` says whether the same request may succeed later without a change on our side
(conflicts and transport errors do; validation errors do not).
"""

from __future__ import annotations


class ApiError(Exception):
    """A Kubernetes API request failed."""

    retryable = True

    def __init__(self, message: str, *, status: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class ConflictError(ApiError):
    """409 Conflict: the object changed since we read it (stale resourceVersion or precondition)."""


class AlreadyExistsError(ApiError):
    """409 AlreadyExists: an object with that name exists (also a rare generateName collision)."""


class NotFoundError(ApiError):
    """404: the object (or the Node we look up) does not exist."""


class ResourceExpiredError(ApiError):
    """410 Gone: the watch's resourceVersion is too old; list again, then watch from the list."""


class InvalidError(ApiError):
    """400/422: the apiserver rejected the object; resending it unchanged cannot succeed."""

    retryable = False


class ForbiddenError(ApiError):
    """401/403: the service account lacks a permission (RBAC) or credentials."""

    retryable = False


class ClientConfigError(Exception):
    """No usable kubeconfig or in-cluster service account: the client cannot be built."""
