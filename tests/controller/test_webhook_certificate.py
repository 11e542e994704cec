"""The controller's own webhook certificate (webhook.tls.mode=controller): made once into its
Secret and then reused (the same bytes on every round, which is what keeps GitOps renders
stable), replaced when unusable with the old CA kept trusted, a racing replica's Secret taken,
the webhooks' caBundle patched only when it differs, and the pair served over TLS under the
Service's name with the kept CA."""

from __future__ import annotations

import asyncio
import base64
import os
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.controller.webhook_certificate import (
    RENEW_BEFORE,
    VALIDITY,
    CertificateKeeper,
    CertificateSetupError,
    Material,
    ca_bundle_patch,
    dns_names,
    ensure_secret,
    generate,
    material_of,
    problem,
)
from gpu_dra.kube import errors

SERVICE = "gpu-dra/gpu-dra-webhook"
NAMES = dns_names(SERVICE)
NOW = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


class FakeSecrets:
    """One Secret, with resourceVersion checks; `first_writer` plays a replica that wins."""

    def __init__(self, data: dict[str, str] | None = None) -> None:
        self.version = 1
        self.data = data
        self.writes = 0
        self.first_writer: dict[str, str] | None = None

    def get(self) -> dict[str, Any] | None:
        if self.data is None:
            return None
        return {"metadata": {"resourceVersion": str(self.version)}, "data": dict(self.data)}

    def _race(self) -> bool:
        if self.first_writer is None:
            return False
        self.data, self.first_writer = self.first_writer, None
        self.version += 1
        return True

    def create(self, data: dict[str, str]) -> None:
        if self._race() or self.data is not None:
            raise errors.AlreadyExistsError("exists", status=409, reason="AlreadyExists")
        self.data, self.writes = data, self.writes + 1

    def replace(self, data: dict[str, str], resource_version: str) -> None:
        if self._race() or resource_version != str(self.version):
            raise errors.ConflictError("conflict", status=409, reason="Conflict")
        self.data, self.version, self.writes = data, self.version + 1, self.writes + 1


class FakeConfiguration:
    def __init__(self, bundles: list[str | None]) -> None:
        self.webhooks = [
            {"name": f"hook-{i}", "clientConfig": {} if b is None else {"caBundle": b}}
            for i, b in enumerate(bundles)
        ]
        self.patches: list[list[dict[str, Any]]] = []

    def get(self) -> dict[str, Any]:
        return {"webhooks": [dict(h, clientConfig=dict(h["clientConfig"])) for h in self.webhooks]}

    def patch(self, operations: list[dict[str, Any]]) -> None:
        self.patches.append(operations)
        for op in operations:
            _, _, index, *rest = op["path"].split("/")
            hook = self.webhooks[int(index)]
            if op["op"] == "test":
                assert hook["name"] == op["value"]
            else:
                assert rest == ["clientConfig", "caBundle"]
                hook["clientConfig"]["caBundle"] = op["value"]


def test_the_secret_is_made_once_and_then_reused_unchanged() -> None:
    secrets = FakeSecrets()

    made = ensure_secret(secrets, NAMES, now=lambda: NOW)
    later = [NOW + timedelta(days=1), NOW + timedelta(days=300)]
    again = [ensure_secret(secrets, NAMES, now=lambda t=t: t) for t in later]

    assert secrets.writes == 1
    assert again == [made, made]
    assert material_of(secrets.data) == made
    assert problem(made, NAMES, NOW) == ""


@pytest.mark.parametrize(
    ("data", "why"),
    [
        ({"tls.crt": "bm90", "tls.key": "bm90"}, "no tls.crt, tls.key and ca.crt"),
        ({"tls.crt": "bm90", "tls.key": "bm90", "ca.crt": "bm90"}, "does not load"),
    ],
)
def test_an_unusable_secret_is_replaced(data: dict[str, str], why: str) -> None:
    secrets = FakeSecrets(data)

    assert why in problem(material_of(data), NAMES, NOW)
    made = ensure_secret(secrets, NAMES, now=lambda: NOW)

    assert secrets.writes == 1
    assert material_of(secrets.data) == made
    assert problem(made, NAMES, NOW) == ""


def test_a_certificate_for_other_names_or_near_its_end_is_renewed_keeping_the_old_ca() -> None:
    old = generate(dns_names("elsewhere/other-webhook"), NOW)
    expiring = generate(NAMES, NOW)
    near_end = NOW + VALIDITY - RENEW_BEFORE + timedelta(hours=1)

    assert "does not name gpu-dra-webhook" in problem(old, NAMES, NOW)
    assert "expires at" in problem(expiring, NAMES, near_end)
    secrets = FakeSecrets(expiring.data())
    renewed = ensure_secret(secrets, NAMES, now=lambda: near_end)

    assert renewed.cert != expiring.cert
    assert problem(renewed, NAMES, near_end) == ""
    # Replicas still serving the old certificate stay trusted until they reload.
    assert renewed.ca_bundle.endswith(expiring.ca_bundle)
    assert problem(Material(expiring.cert, expiring.key, renewed.ca_bundle), NAMES, NOW) == ""


def test_a_key_that_is_not_the_certificates_is_refused() -> None:
    one, other = generate(NAMES, NOW), generate(NAMES, NOW)

    assert problem(Material(one.cert, other.key, one.ca_bundle), NAMES, NOW) == (
        "the key is not the certificate's"
    )
    assert problem(Material(one.cert, one.key, other.ca_bundle), NAMES, NOW) == (
        "no CA of ca.crt signed the certificate"
    )


@pytest.mark.parametrize("existing", [False, True], ids=["create", "replace"])
def test_a_replica_that_loses_the_race_takes_the_winners_secret(existing: bool) -> None:
    secrets = FakeSecrets({"tls.crt": "", "tls.key": "", "ca.crt": ""} if existing else None)
    winner = generate(NAMES, NOW)
    secrets.first_writer = winner.data()

    taken = ensure_secret(secrets, NAMES, now=lambda: NOW)

    assert taken == winner
    assert secrets.writes == 0


def test_the_ca_bundle_is_patched_into_every_webhook_that_lacks_it() -> None:
    material = generate(NAMES, NOW)
    encoded = base64.b64encode(material.ca_bundle).decode()

    assert ca_bundle_patch({"webhooks": [{"name": "a", "clientConfig": {"caBundle": encoded}}]},
                           material.ca_bundle) == []  # fmt: skip
    assert ca_bundle_patch(
        {
            "webhooks": [
                {"name": "a", "clientConfig": {"caBundle": encoded}},
                {"name": "b", "clientConfig": {"caBundle": "b2xk"}},
            ]
        },
        material.ca_bundle,
    ) == [
        {"op": "test", "path": "/webhooks/1/name", "value": "b"},
        {"op": "add", "path": "/webhooks/1/clientConfig/caBundle", "value": encoded},
    ]


def test_the_keeper_writes_the_files_and_bundle_once_and_serves_them_under_the_ca(
    tmp_path: Path,
) -> None:
    secrets, configuration = FakeSecrets(), FakeConfiguration([None, None, "b2xk"])
    keeper = CertificateKeeper(
        secrets,
        configuration,
        names=NAMES,
        cert_file=tmp_path / "tls" / "tls.crt",
        key_file=tmp_path / "tls" / "tls.key",
    )

    material = keeper.sync()
    keeper.sync()

    assert secrets.writes == 1
    assert len(configuration.patches) == 1
    encoded = base64.b64encode(material.ca_bundle).decode()
    assert {h["clientConfig"]["caBundle"] for h in configuration.webhooks} == {encoded}
    assert (tmp_path / "tls" / "tls.crt").read_bytes() == material.cert
    assert (tmp_path / "tls" / "tls.key").stat().st_mode & 0o077 == 0
    assert _handshake(material, tmp_path / "tls", "gpu-dra-webhook.gpu-dra.svc")
    assert not _handshake(material, tmp_path / "tls", "gpu-dra-webhook.elsewhere.svc")


def test_start_retries_while_the_apiserver_is_away_and_gives_up_on_forbidden(
    tmp_path: Path,
) -> None:
    class Flaky(FakeSecrets):
        failures = 2

        def get(self) -> dict[str, Any] | None:
            if self.failures:
                self.failures -= 1
                raise errors.ApiError("connection refused")
            return super().get()

    class Forbidden(FakeSecrets):
        def get(self) -> dict[str, Any] | None:
            raise errors.ForbiddenError("secrets is forbidden", status=403)

    def keeper(secrets: FakeSecrets) -> CertificateKeeper:
        return CertificateKeeper(
            secrets, FakeConfiguration([None]), names=NAMES,
            cert_file=tmp_path / "c", key_file=tmp_path / "k",
        )  # fmt: skip

    flaky = Flaky()
    asyncio.run(keeper(flaky).start(attempts=3, retry_s=0))
    assert flaky.writes == 1
    with pytest.raises(CertificateSetupError, match="secrets is forbidden"):
        asyncio.run(keeper(Forbidden()).start(attempts=3, retry_s=0))
    read_only = tmp_path / "read-only"
    read_only.mkdir(mode=0o500)
    unwritable = CertificateKeeper(
        FakeSecrets(), FakeConfiguration([None]), names=NAMES,
        cert_file=read_only / "tls.crt", key_file=read_only / "tls.key",
    )  # fmt: skip
    if os.access(read_only, os.W_OK):  # root writes anyway: make the directory a file
        read_only.rmdir()
        read_only.write_text("")
    with pytest.raises(CertificateSetupError, match="cannot write the webhook certificate"):
        asyncio.run(unwritable.start(attempts=3, retry_s=0))


def test_the_secret_setting_needs_the_service_and_the_configuration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = ControllerSettings.from_env(
        {
            "GPU_DRA_WEBHOOK_TLS_SECRET": "gpu-dra/gpu-dra-webhook-tls",
            "GPU_DRA_WEBHOOK_SERVICE": SERVICE,
            "GPU_DRA_WEBHOOK_CONFIGURATION": "gpu-dra-webhook",
        }
    )
    assert settings.webhook_tls_secret == "gpu-dra/gpu-dra-webhook-tls"

    with pytest.raises(SystemExit):
        ControllerSettings.from_env({"GPU_DRA_WEBHOOK_TLS_SECRET": "gpu-dra/x"})
    assert "--webhook-tls-secret needs --webhook-service" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ControllerSettings.from_env({"GPU_DRA_WEBHOOK_TLS_SECRET": "no-namespace"})
    assert "expected namespace/name" in capsys.readouterr().err


def _handshake(material: Material, directory: Path, server_name: str) -> bool:
    """Whether a TLS client trusting `material`'s CA bundle accepts the pair in `directory`
    as `server_name` (in memory, as the apiserver would dial the Service)."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(directory / "tls.crt", directory / "tls.key")
    client = ssl.create_default_context(cadata=material.ca_bundle.decode())
    client.verify_flags &= ~ssl.VERIFY_X509_STRICT
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname=server_name)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    client_done = server_done = False
    for _ in range(10):
        if not client_done:
            try:
                c.do_handshake()
                client_done = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError:
                return False
        s_in.write(c_out.read())
        if not server_done:
            try:
                s.do_handshake()
                server_done = True
            except ssl.SSLWantReadError:
                pass
        c_in.write(s_out.read())
        if client_done and server_done:
            return True
    return False
