"""The shared client against a stub apiserver on localhost: the apiserver's version."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gpu_dra.kube.client import read_server_version
from tests.fakes.stub_apiserver import StubApiserver


@pytest.fixture
def stub() -> Iterator[StubApiserver]:
    """A vendor build's /version (gitVersion with a suffix, minor with a plus)."""
    with StubApiserver.running() as server:
        version = {"major": "1", "minor": "34+", "gitVersion": "v1.34.2-gke.1"}
        server.route("GET", "/version", (200, version))
        yield server


def test_server_version_is_read_from_slash_version(stub: StubApiserver) -> None:
    assert read_server_version(stub.client) == ("1", "34+")
    assert stub.requests[-1]["path"].rstrip("/") == "/version"
