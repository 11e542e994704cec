"""Running `gpu-dra` in tests: `main(argv, environ={})` directly, so no subprocess, no cluster, no
GPU, and no GPU_DRA_* variable of the caller's shell leaks in."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import pytest
from kubernetes.client.exceptions import ApiException

from gpu_dra.cli.__main__ import main


def run(capsys: pytest.CaptureFixture[str], *argv: str, **environ: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `gpu-dra argv...` with only `environ` set."""
    code = main(list(argv), environ=environ)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table(text: str) -> list[list[str]]:
    """Rows of a table printed by the CLI (columns are separated by at least two spaces)."""
    return [re.split(r"\s{2,}", line.strip()) for line in text.splitlines()]


class FakeCoreV1:
    """`CoreV1Api` for the CLI's core reads (cli/cluster.py): the pods, events and
    ResourceQuotas the test puts in the class variables (all namespaces), as JSON responses."""

    pods: ClassVar[list[dict[str, Any]]] = []
    events: ClassVar[list[dict[str, Any]]] = []
    quotas: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, client: object) -> None:
        pass

    @staticmethod
    def _response(body: object) -> Any:
        return type("Response", (), {"data": json.dumps(body).encode()})()

    @staticmethod
    def _in(items: list[dict[str, Any]], namespace: str) -> list[dict[str, Any]]:
        return [i for i in items if i["metadata"]["namespace"] == namespace]

    def list_namespaced_pod(self, namespace: str, **_: Any) -> Any:
        return self._response({"items": self._in(self.pods, namespace)})

    def read_namespaced_pod(self, name: str, namespace: str, **_: Any) -> Any:
        for pod in self._in(self.pods, namespace):
            if pod["metadata"]["name"] == name:
                return self._response(pod)
        raise ApiException(status=404, reason="NotFound")

    def list_namespaced_event(self, namespace: str, field_selector: str = "", **_: Any) -> Any:
        name = field_selector.rpartition("involvedObject.name=")[2]
        items = [e for e in self._in(self.events, namespace)
                 if e["involvedObject"]["name"] == name]  # fmt: skip
        return self._response({"items": items})

    def list_namespaced_resource_quota(self, namespace: str, **_: Any) -> Any:
        return self._response({"items": self._in(self.quotas, namespace)})
