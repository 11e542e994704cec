"""The admission webhook's HTTPS server (`gpu_dra.controller.webhook`): real TLS requests against
self-signed certificates made here with the openssl CLI, certificate rotation, setup errors,
and `serving` beside the controller's run loop."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import pytest

from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.controller.share_memory import ShareMemoryQuota
from gpu_dra.controller.webhook import (
    PATH,
    SHARE_MEMORY_PATH,
    ReloadingCertificate,
    WebhookServer,
    WebhookSetupError,
    serving,
)
from gpu_dra.driver.cluster.tier_quota import SHARE_MEMORY
from tests.controller.test_share_memory import CLASSES, FakeApi
from tests.controller.test_share_memory import claim_object as share_claim_object

DRIVER = "gpu.nvidia.com"
SERVICE_NAME = "gpu-dra-webhook.gpu-dra.svc"
T = TypeVar("T")


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path


def self_signed(directory: Path, name: str) -> Pair:
    """A self-signed P-256 certificate for the webhook's service name and 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = Pair(directory / f"{name}.crt", directory / f"{name}.key")
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-days", "1", "-subj", f"/CN={name}", "-keyout", str(pair.key),
            "-out", str(pair.cert), "-addext", f"subjectAltName=DNS:{SERVICE_NAME},IP:127.0.0.1",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    return pair


def install(pair: Pair, served: Pair) -> None:
    """Put `pair` where the server reads its files, each replaced in one rename as the kubelet
    swaps a Secret volume's files."""
    for source, target in ((pair.cert, served.cert), (pair.key, served.key)):
        staged = target.with_suffix(".new")
        staged.write_bytes(source.read_bytes())
        os.replace(staged, target)


@pytest.fixture
def certs(tmp_path: Path) -> tuple[Pair, Pair, Pair]:
    """Certificates `a` and `b`, and the served files (holding `a`)."""
    a, b = self_signed(tmp_path / "made", "a"), self_signed(tmp_path / "made", "b")
    served = Pair(tmp_path / "tls" / "tls.crt", tmp_path / "tls" / "tls.key")
    served.cert.parent.mkdir()
    install(a, served)
    return a, b, served


def trusting(pair: Pair) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(pair.cert))


def review_body(obj: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "uid-1",
                "resource": {
                    "group": "resource.k8s.io",
                    "version": "v1",
                    "resource": "resourceclaims",
                },
                "operation": "CREATE",
                "namespace": "team-a",
                "name": "c",
                "object": obj,
            },
        }
    ).encode()


def claim(strategy: str) -> dict[str, Any]:
    parameters = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": strategy},
    }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "c", "namespace": "team-a"},
        "spec": {"devices": {"config": [{"opaque": {"driver": DRIVER, "parameters": parameters}}]}},
    }


async def post(
    port: int,
    trust: ssl.SSLContext,
    body: bytes,
    content_type: str = "application/json",
    path: str = PATH,
) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"https://127.0.0.1:{port}{path}",
            data=body,
            headers={"Content-Type": content_type},
            ssl=trust,
        ) as reply,
    ):
        return reply.status, await reply.text()


async def get(port: int, trust: ssl.SSLContext, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"https://127.0.0.1:{port}{path}", ssl=trust) as reply,
    ):
        return reply.status, await reply.text()


def with_server(
    served: Pair, scenario: Callable[[WebhookServer], Awaitable[T]], **options: Any
) -> T:
    """Run `scenario` against a started server on a free port of 127.0.0.1, then stop it."""

    async def run() -> T:
        server = WebhookServer(
            ReloadingCertificate(served.cert, served.key),
            port=0,
            driver=DRIVER,
            host="127.0.0.1",
            **options,
        )
        await server.start()
        try:
            return await scenario(server)
        finally:
            await server.stop()

    return asyncio.run(run())


# ---- requests over TLS ----------------------------------------------------------------------
def test_a_claim_with_an_unknown_strategy_is_denied_over_https(
    certs: tuple[Pair, Pair, Pair],
) -> None:
    a, _, served = certs

    async def scenario(server: WebhookServer) -> tuple[tuple[int, str], tuple[int, str]]:
        bad = await post(server.port, trusting(a), review_body(claim("Often")))
        good = await post(server.port, trusting(a), review_body(claim("TimeSlicing")))
        return bad, good

    (bad_status, bad_text), (good_status, good_text) = with_server(served, scenario)

    assert bad_status == 200
    assert json.loads(bad_text)["response"] == {
        "uid": "uid-1",
        "allowed": False,
        "status": {
            "code": 422,
            "reason": "Invalid",
            "message": "spec.devices.config[0]: parameters.sharing.strategy: unknown GPU sharing "
            "strategy 'Often': supported are TimeSlicing, MPS",
        },
    }
    assert good_status == 200
    assert json.loads(good_text)["response"] == {"uid": "uid-1", "allowed": True}


def test_the_share_memory_quota_is_served_on_its_own_path_only_when_given(
    certs: tuple[Pair, Pair, Pair],
) -> None:
    a, _, served = certs
    api = FakeApi()
    api.quotas["team-a"] = [{"metadata": {"name": "gpu"}, "spec": {"hard": {SHARE_MEMORY: "16Gi"}}}]
    quota = ShareMemoryQuota(api, lambda: CLASSES, driver=DRIVER)
    big = share_claim_object("big", "24Gi")
    big["metadata"]["namespace"] = "team-a"

    async def scenario(server: WebhookServer) -> tuple[int, str]:
        return await post(server.port, trusting(a), review_body(big), path=SHARE_MEMORY_PATH)

    status, text = with_server(served, scenario, share_quota=quota)
    assert status == 200
    assert json.loads(text)["response"]["status"] == {
        "code": 403,
        "reason": "Forbidden",
        "message": "exceeded quota: gpu, requested: gpu.nvidia.com/share-memory=24Gi, used: "
        "gpu.nvidia.com/share-memory=0, limited: gpu.nvidia.com/share-memory=16Gi",
    }
    assert with_server(served, scenario)[0] == 404


def test_readyz_answers_ok(certs: tuple[Pair, Pair, Pair]) -> None:
    a, _, served = certs

    async def scenario(server: WebhookServer) -> tuple[int, str]:
        return await get(server.port, trusting(a), "/readyz")

    assert with_server(served, scenario) == (200, "ok")


def test_bodies_that_are_not_admission_reviews_get_400_and_other_types_415(
    certs: tuple[Pair, Pair, Pair],
) -> None:
    a, _, served = certs

    async def scenario(server: WebhookServer) -> list[tuple[int, str]]:
        return [
            await post(server.port, trusting(a), b"{not json"),
            await post(server.port, trusting(a), review_body(claim("MPS")), "text/plain"),
        ]

    (malformed, wrong_type) = with_server(served, scenario)

    assert malformed[0] == 400
    assert malformed[1].startswith("the body is not valid JSON")
    assert wrong_type == (415, "expected Content-Type application/json, got text/plain")


def test_plain_http_gets_no_answer(certs: tuple[Pair, Pair, Pair]) -> None:
    _, _, served = certs

    async def scenario(server: WebhookServer) -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.ClientError):
                async with session.get(f"http://127.0.0.1:{server.port}/readyz") as reply:
                    await reply.text()

    with_server(served, scenario)


# ---- certificate rotation -------------------------------------------------------------------
def test_a_changed_certificate_is_served_to_new_connections(
    certs: tuple[Pair, Pair, Pair],
) -> None:
    a, b, served = certs

    async def scenario(server: WebhookServer) -> None:
        assert (await get(server.port, trusting(a), "/readyz"))[0] == 200
        assert not server.certificate.reload_if_changed()  # unchanged: nothing to do

        install(b, served)
        assert server.certificate.reload_if_changed()

        assert (await get(server.port, trusting(b), "/readyz"))[0] == 200
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            await get(server.port, trusting(a), "/readyz")

    with_server(served, scenario)


def test_the_server_polls_the_files_and_reloads_by_itself(certs: tuple[Pair, Pair, Pair]) -> None:
    _, b, served = certs

    async def scenario(server: WebhookServer) -> None:
        install(b, served)
        for _ in range(200):
            try:
                await get(server.port, trusting(b), "/readyz")
                return
            except aiohttp.ClientConnectorCertificateError:
                await asyncio.sleep(0.02)
        raise AssertionError("the rotated certificate was not served within 4 s")

    with_server(served, scenario, reload_interval_s=0.05)


def test_a_broken_replacement_keeps_the_last_good_certificate(
    certs: tuple[Pair, Pair, Pair], caplog: pytest.LogCaptureFixture
) -> None:
    a, b, served = certs
    caplog.set_level(logging.ERROR, logger="gpu_dra.controller.webhook")

    async def scenario(server: WebhookServer) -> None:
        served.cert.write_bytes(b.cert.read_bytes())  # the new cert, the old key: no pair
        assert not server.certificate.reload_if_changed()
        assert not server.certificate.reload_if_changed()  # logged once, not at every look

        assert (await get(server.port, trusting(a), "/readyz"))[0] == 200

        install(b, served)  # the key follows: the pair loads
        assert server.certificate.reload_if_changed()
        assert (await get(server.port, trusting(b), "/readyz"))[0] == 200

    with_server(served, scenario)

    errors = [r.getMessage() for r in caplog.records]
    assert len(errors) == 1
    assert errors[0].startswith("cannot load the changed webhook certificate, keeping the last one")


# ---- setup errors and serving beside the run loop -------------------------------------------
def test_missing_or_unloadable_files_are_a_setup_error(
    certs: tuple[Pair, Pair, Pair], tmp_path: Path
) -> None:
    a, b, _ = certs

    with pytest.raises(WebhookSetupError, match="cannot load the webhook certificate"):
        ReloadingCertificate(tmp_path / "absent.crt", a.key)
    with pytest.raises(WebhookSetupError, match="cannot load the webhook certificate"):
        ReloadingCertificate(a.cert, b.key)


def test_a_port_in_use_is_a_setup_error(certs: tuple[Pair, Pair, Pair]) -> None:
    _, _, served = certs

    async def scenario() -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            server = WebhookServer(
                ReloadingCertificate(served.cert, served.key),
                port=taken.getsockname()[1],
                driver=DRIVER,
                host="127.0.0.1",
            )
            with pytest.raises(WebhookSetupError, match="cannot serve the webhook on port"):
                await server.start()

    asyncio.run(scenario())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        port: int = probe.getsockname()[1]
        return port


def test_serving_runs_the_webhook_while_the_main_loop_runs(certs: tuple[Pair, Pair, Pair]) -> None:
    a, _, served = certs
    settings = ControllerSettings(
        webhook_port=free_port(),
        webhook_tls_cert_file=served.cert,
        webhook_tls_private_key_file=served.key,
    )

    async def main_loop() -> int:
        status, _ = await get(settings.webhook_port, trusting(a), "/readyz")
        return status

    async def scenario() -> tuple[int, bool]:
        code = await serving(settings, main_loop, driver=DRIVER)
        try:
            await get(settings.webhook_port, trusting(a), "/readyz")
        except aiohttp.ClientConnectorError:
            return code, False
        return code, True

    assert asyncio.run(scenario()) == (200, False)


def test_without_a_port_serving_only_runs_the_main_loop(tmp_path: Path) -> None:
    settings = ControllerSettings(webhook_tls_cert_file=tmp_path / "absent.crt")

    async def main_loop() -> int:
        return 7

    assert asyncio.run(serving(settings, main_loop, driver=DRIVER)) == 7


def test_serving_fails_before_the_main_loop_when_the_webhook_cannot_start(tmp_path: Path) -> None:
    settings = ControllerSettings(webhook_port=free_port(), webhook_tls_cert_file=tmp_path / "x")
    started = []

    async def main_loop() -> int:
        started.append(True)
        return 0

    with pytest.raises(WebhookSetupError):
        asyncio.run(serving(settings, main_loop, driver=DRIVER))
    assert started == []
