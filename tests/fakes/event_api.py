"""An in-memory Kubernetes Event API (`gpu_dra.kube.events.EventApi`)."""

from __future__ import annotations

from typing import Any

from gpu_dra.kube import errors


class RecordingEventApi:
    """Keeps every Event it is given (each must live in its object's namespace, as the API
    server requires); ``refuse`` makes every create fail with 403."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.refuse = False

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        if self.refuse:
            raise errors.ApiError("create Event: 403 Forbidden", status=403)
        assert event["metadata"]["namespace"] == namespace
        assert event["involvedObject"]["namespace"] == namespace
        self.events.append(event)
