"""The webhook's self-signed certificate kept by the controller (chart: tls.mode controller).

`ensure_secret` reads the kubernetes.io/tls Secret (``tls.crt``, ``tls.key``, ``ca.crt``) and
keeps it when it is usable (parses, the key matches, a CA of ``ca.crt`` signed it, it names the
Service and has more than `RENEW_BEFORE` left); else it makes a new CA and certificate
(`generate`) and writes them, keeping the old CA in ``ca.crt`` while it is valid so that
replicas still serving the old certificate stay trusted. Replicas racing to write see a
conflict and read the winner's Secret. `ca_bundle_patch` is the JSON patch that sets every
webhook's ``caBundle`` of the ValidatingWebhookConfiguration to ``ca.crt``; `CertificateKeeper`
does both at start and every `CHECK_INTERVAL_S`, and writes the pair to the files the webhook
server reloads. Nothing of this is rendered by Helm, so ``helm template | kubectl apply`` (GitOps)
does not change the certificate. See docs/deployment.md#admission-webhook.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Final, Protocol, cast

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from kubernetes import client as k8s

from gpu_dra.kube import errors
from gpu_dra.kube.client import decoded_object, translated_errors

log = logging.getLogger(__name__)

VALIDITY: Final = timedelta(days=3650)
RENEW_BEFORE: Final = timedelta(days=30)
CHECK_INTERVAL_S: Final = 60.0
WRITE_ATTEMPTS: Final = 5

CERT_KEY: Final = "tls.crt"
KEY_KEY: Final = "tls.key"
CA_KEY: Final = "ca.crt"


class CertificateSetupError(Exception):
    """The certificate could not be set up at start: the apiserver refused or stayed away, or
    the files could not be written."""


@dataclass(frozen=True)
class Material:
    """PEM bytes of the serving certificate, its key and the CA bundle that trusts it."""

    cert: bytes
    key: bytes
    ca_bundle: bytes

    def data(self) -> dict[str, str]:
        """The Secret's ``data`` (base64)."""
        return {
            CERT_KEY: base64.b64encode(self.cert).decode(),
            KEY_KEY: base64.b64encode(self.key).decode(),
            CA_KEY: base64.b64encode(self.ca_bundle).decode(),
        }


def dns_names(service_ref: str) -> list[str]:
    """The names the apiserver may dial for Service ``namespace/name``."""
    namespace, _, name = service_ref.partition("/")
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc"]


def generate(names: Sequence[str], now: datetime, *, keep_cas: bytes = b"") -> Material:
    """A new CA (P-256) and a server certificate for `names` signed by it, both valid for
    `VALIDITY` from `now`; `keep_cas` (PEM CAs still valid at `now`) stay in the bundle after
    the new CA."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{names[0]}-ca")])
    start, end = now - timedelta(minutes=5), now + VALIDITY
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[-1])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    kept = [c for c in _certificates(keep_cas) if c.not_valid_after_utc > now]
    bundle = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in [ca, *kept])
    return Material(
        cert=cert.public_bytes(serialization.Encoding.PEM),
        key=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        ca_bundle=bundle,
    )


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _certificates(pem: bytes) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem) if pem.strip() else []
    except ValueError:
        return []


def material_of(data: dict[str, str] | None) -> Material | None:
    """The Secret ``data`` as `Material`, or None when a key is missing or not base64."""
    if not data or not all(k in data for k in (CERT_KEY, KEY_KEY, CA_KEY)):
        return None
    try:
        return Material(
            cert=base64.b64decode(data[CERT_KEY], validate=True),
            key=base64.b64decode(data[KEY_KEY], validate=True),
            ca_bundle=base64.b64decode(data[CA_KEY], validate=True),
        )
    except ValueError:
        return None


def problem(material: Material | None, names: Sequence[str], now: datetime) -> str:
    """Why `material` cannot be served for `names` at `now`; empty when it can."""
    if material is None:
        return "no tls.crt, tls.key and ca.crt"
    try:
        cert = x509.load_pem_x509_certificate(material.cert)
        key = serialization.load_pem_private_key(material.key, password=None)
    except (ValueError, TypeError) as error:
        return f"does not load: {error}"
    if key.public_key() != cert.public_key():
        return "the key is not the certificate's"
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return "the certificate has no DNS names"
    missing = set(names) - set(san.get_values_for_type(x509.DNSName))
    if missing:
        return f"the certificate does not name {', '.join(sorted(missing))}"
    if cert.not_valid_before_utc > now:
        return "the certificate is not valid yet"
    if cert.not_valid_after_utc - now < RENEW_BEFORE:
        return f"the certificate expires at {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    for ca in _certificates(material.ca_bundle):
        with contextlib.suppress(ValueError, TypeError, InvalidSignature):
            cert.verify_directly_issued_by(ca)
            return ""
    return "no CA of ca.crt signed the certificate"


class SecretApi(Protocol):
    """The one Secret the certificate lives in."""

    def get(self) -> dict[str, Any] | None:
        """The Secret object, or None when there is none."""

    def create(self, data: dict[str, str]) -> None:
        """Create it (`errors.AlreadyExistsError` when another replica was first)."""

    def replace(self, data: dict[str, str], resource_version: str) -> None:
        """Replace its data (`errors.ConflictError` when it changed since it was read)."""


class WebhookConfigurationApi(Protocol):
    """The ValidatingWebhookConfiguration whose caBundle is kept."""

    def get(self) -> dict[str, Any]:
        """The object (`errors.NotFoundError` when there is none)."""

    def patch(self, operations: list[dict[str, Any]]) -> None:
        """Apply a JSON patch (`errors.InvalidError` when a ``test`` fails)."""


def ensure_secret(
    secrets: SecretApi,
    names: Sequence[str],
    *,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> Material:
    """The Secret's usable material, made and written first when it is missing or unusable."""
    for _ in range(WRITE_ATTEMPTS):
        current = secrets.get()
        data = cast("dict[str, str] | None", current.get("data")) if current else None
        material = material_of(data)
        why = problem(material, names, now())
        if not why:
            return cast("Material", material)
        fresh = generate(names, now(), keep_cas=material.ca_bundle if material else b"")
        try:
            if current is None:
                secrets.create(fresh.data())
                log.info("made the webhook certificate for %s", ", ".join(names))
            else:
                version = str(current.get("metadata", {}).get("resourceVersion", ""))
                secrets.replace(fresh.data(), version)
                log.warning("replaced the webhook certificate (%s)", why)
        except (errors.AlreadyExistsError, errors.ConflictError):
            continue  # another replica wrote it: use theirs
        return fresh
    raise errors.ApiError(
        f"the webhook certificate Secret changed under every one of {WRITE_ATTEMPTS} writes"
    )


def ca_bundle_patch(configuration: dict[str, Any], ca_bundle: bytes) -> list[dict[str, Any]]:
    """JSON patch setting every webhook's ``clientConfig.caBundle`` to `ca_bundle` (empty when
    all have it); each change is guarded by a ``test`` of the webhook's name at its index."""
    encoded = base64.b64encode(ca_bundle).decode()
    operations: list[dict[str, Any]] = []
    for index, webhook in enumerate(configuration.get("webhooks") or []):
        if (webhook.get("clientConfig") or {}).get("caBundle") == encoded:
            continue
        operations += [
            {"op": "test", "path": f"/webhooks/{index}/name", "value": webhook["name"]},
            {"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": encoded},
        ]
    return operations


def write_pair(material: Material, cert_file: Path, key_file: Path) -> bool:
    """Write the certificate and key files (each replaced whole) unless they hold the pair;
    whether they changed. The key file is written first and readable by the owner only."""
    try:
        if cert_file.read_bytes() == material.cert and key_file.read_bytes() == material.key:
            return False
    except OSError:
        pass
    for path, content, mode in ((key_file, material.key, 0o600), (cert_file, material.cert, 0o644)):
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_bytes(content)
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    return True


class CertificateKeeper:
    """Keeps the Secret, the certificate files and the webhooks' caBundle in step."""

    def __init__(
        self,
        secrets: SecretApi,
        configuration: WebhookConfigurationApi,
        *,
        names: Sequence[str],
        cert_file: Path,
        key_file: Path,
        now: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        self._secrets = secrets
        self._configuration = configuration
        self._names = list(names)
        self._cert_file = cert_file
        self._key_file = key_file
        self._now = now

    def sync(self) -> Material:
        """One round (blocking): the Secret ensured, the files written, the caBundle patched.
        `errors.ApiError` when the apiserver cannot be read or written."""
        material = ensure_secret(self._secrets, self._names, now=self._now)
        if write_pair(material, self._cert_file, self._key_file):
            log.info("wrote the webhook certificate to %s", self._cert_file)
        operations = ca_bundle_patch(self._configuration.get(), material.ca_bundle)
        if operations:
            self._configuration.patch(operations)
            log.info("set the caBundle of %d webhooks", len(operations) // 2)
        return material

    async def start(self, attempts: int = 15, retry_s: float = 2.0) -> None:
        """`sync` until it succeeds (the webhook server needs the files), at most `attempts`
        times; `CertificateSetupError` with the last error when none did, at once for an error
        that a retry cannot mend (RBAC, an unwritable directory)."""
        for attempt in range(1, attempts + 1):
            try:
                await asyncio.to_thread(self.sync)
                return
            except OSError as error:
                raise CertificateSetupError(
                    f"cannot write the webhook certificate to {self._cert_file.parent}: {error}"
                ) from error
            except errors.ApiError as error:
                if attempt == attempts or not error.retryable:
                    raise CertificateSetupError(str(error)) from error
                log.warning("cannot set up the webhook certificate yet (%s); retrying", error)
                await asyncio.sleep(retry_s)

    async def keep(self, stop: asyncio.Event, interval_s: float = CHECK_INTERVAL_S) -> None:
        """`sync` every `interval_s` until `stop`; failures are logged and retried."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            if stop.is_set():
                return
            try:
                await asyncio.to_thread(self.sync)
            except (errors.ApiError, OSError) as error:
                log.error("cannot keep the webhook certificate: %s", error)


class KubernetesSecretApi:
    """`SecretApi` on the `kubernetes` client (`CoreV1Api`, raw dictionaries)."""

    def __init__(self, api_client: k8s.ApiClient, ref: str, *, labels: dict[str, str]) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self._namespace, _, self._name = ref.partition("/")
        self._labels = labels

    def get(self) -> dict[str, Any] | None:
        action = f"read Secret {self._namespace}/{self._name}"
        try:
            with translated_errors(action):
                response: Any = self._core.read_namespaced_secret(
                    self._name, self._namespace, _preload_content=False, _request_timeout=30
                )
                body: bytes = response.data
        except errors.NotFoundError:
            return None
        return decoded_object(body, action)

    def _body(self, data: dict[str, str], resource_version: str = "") -> Any:
        """The Secret manifest (a raw dictionary, which the client sends as is)."""
        metadata: dict[str, Any] = {
            "name": self._name,
            "namespace": self._namespace,
            "labels": self._labels,
        }
        if resource_version:
            metadata["resourceVersion"] = resource_version
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata,
            "type": "kubernetes.io/tls",
            "data": data,
        }

    def create(self, data: dict[str, str]) -> None:
        with translated_errors(f"create Secret {self._namespace}/{self._name}"):
            self._core.create_namespaced_secret(
                self._namespace, self._body(data), _request_timeout=30
            )

    def replace(self, data: dict[str, str], resource_version: str) -> None:
        with translated_errors(f"update Secret {self._namespace}/{self._name}"):
            self._core.replace_namespaced_secret(
                self._name, self._namespace, self._body(data, resource_version), _request_timeout=30
            )


class KubernetesWebhookConfigurationApi:
    """`WebhookConfigurationApi` on the `kubernetes` client."""

    def __init__(self, api_client: k8s.ApiClient, name: str, *, field_manager: str) -> None:
        self._api = k8s.AdmissionregistrationV1Api(api_client)
        self._name = name
        self._field_manager = field_manager

    def get(self) -> dict[str, Any]:
        action = f"read ValidatingWebhookConfiguration {self._name}"
        with translated_errors(action):
            response: Any = self._api.read_validating_webhook_configuration(
                self._name, _preload_content=False, _request_timeout=30
            )
            body: bytes = response.data
        return decoded_object(body, action)

    def patch(self, operations: list[dict[str, Any]]) -> None:
        with translated_errors(f"patch ValidatingWebhookConfiguration {self._name}"):
            self._api.patch_validating_webhook_configuration(
                self._name,
                operations,
                field_manager=self._field_manager,
                _request_timeout=30,
            )
