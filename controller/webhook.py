"""The admission webhook's HTTPS server (aiohttp), run by gpu-dra-controller on every replica.

``POST /validate-resource-claim-parameters`` (NVIDIA's path) takes an AdmissionReview v1 and
answers with the verdict of `gpu_dra.controller.admission`; a body that is not one gets HTTP 400.
``POST /validate-share-memory`` (with `--share-memory-quota`) answers with the verdict of
`gpu_dra.controller.share_memory` on a ResourceClaim's share memory
(docs/shares.md#share-memory-quota).
``GET /readyz`` answers ``ok``. The certificate and key files are re-read every few seconds; when
their content changed, new connections get the new pair (a renewed Secret needs no restart), and
a pair that cannot be loaded is logged while the last good one stays. A pair that cannot be
loaded at start, or a port that cannot be bound, is a `WebhookSetupError`.
See docs/deployment.md#admission-webhook.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from pathlib import Path
from typing import Any, Final

from aiohttp import web

from gpu_dra.controller import admission
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.controller.share_memory import ShareMemoryQuota

log = logging.getLogger(__name__)

PATH: Final = "/validate-resource-claim-parameters"
SHARE_MEMORY_PATH: Final = "/validate-share-memory"
READY_PATH: Final = "/readyz"
RELOAD_INTERVAL_S: Final = 10.0
MAX_BODY_BYTES: Final = 4 * 1024 * 1024
"""Admission requests carry the object and, for updates, the old one (each at most ~1.5 MiB)."""
SHUTDOWN_TIMEOUT_S: Final = 5.0


class WebhookSetupError(Exception):
    """The webhook cannot start: its certificate cannot be loaded or its port cannot be bound."""


def server_context(cert_file: Path, key_file: Path) -> ssl.SSLContext:
    """A TLS 1.2+ server context serving the pair (OSError or ssl.SSLError if it cannot)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    return context


class ReloadingCertificate:
    """The webhook's serving certificate, loaded again from its files when they change.

    `context` is given to the listener once; its SNI callback, which runs on every handshake
    (with or without SNI), hands each new connection the context of the latest good pair.
    """

    def __init__(self, cert_file: Path, key_file: Path) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        try:
            self._seen: tuple[bytes, bytes] | str = self._read()
            self.context = server_context(cert_file, key_file)
        except (OSError, ssl.SSLError) as error:
            raise WebhookSetupError(
                f"cannot load the webhook certificate {cert_file} with key {key_file}: {error}"
            ) from error
        self._current = self.context
        self.context.sni_callback = self._select

    def _read(self) -> tuple[bytes, bytes]:
        return self.cert_file.read_bytes(), self.key_file.read_bytes()

    def _select(
        self, ssl_object: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext
    ) -> None:
        if self._current is not context:
            ssl_object.context = self._current

    def reload_if_changed(self) -> bool:
        """Load the pair again if the files' content changed since the last look; whether new
        connections now get a new pair."""
        try:
            content: tuple[bytes, bytes] | str = self._read()
        except OSError as error:
            content = str(error)
        if content == self._seen:
            return False
        self._seen = content
        if isinstance(content, str):
            log.error("cannot read the webhook certificate, keeping the last one: %s", content)
            return False
        try:
            self._current = server_context(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as error:
            log.error(
                "cannot load the changed webhook certificate, keeping the last one: %s", error
            )
            return False
        log.info("webhook certificate reloaded from %s", self.cert_file)
        return True

    async def watch(self, stop: asyncio.Event, interval_s: float = RELOAD_INTERVAL_S) -> None:
        """`reload_if_changed` every `interval_s` seconds until `stop`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=interval_s)
            if not stop.is_set():
                self.reload_if_changed()


def application(driver: str, share_quota: ShareMemoryQuota | None = None) -> web.Application:
    """The webhook's routes: the validation endpoint, the share-memory quota endpoint (with
    `share_quota`) and the readiness endpoint."""

    async def reviewed(request: web.Request) -> Mapping[str, Any] | web.Response:
        if request.content_type != "application/json":
            return web.Response(
                status=HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                text=f"expected Content-Type application/json, got {request.content_type}",
            )
        try:
            return admission.parse_review(await request.read())
        except admission.BadReviewError as error:
            log.warning("not an admission review: %s", error)
            return web.Response(status=HTTPStatus.BAD_REQUEST, text=str(error))

    async def validate(request: web.Request) -> web.Response:
        review = await reviewed(request)
        if isinstance(review, web.Response):
            return review
        verdict = admission.decide(review["request"], driver=driver)
        _log_verdict(review["request"], verdict)
        return web.json_response(admission.response(review, verdict))

    async def validate_share_memory(request: web.Request) -> web.Response:
        review = await reviewed(request)
        if isinstance(review, web.Response):
            return review
        assert share_quota is not None
        verdict = await asyncio.to_thread(share_quota.review, review["request"])
        _log_verdict(review["request"], verdict)
        return web.json_response(admission.response(review, verdict))

    async def ready(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_post(PATH, validate)
    if share_quota is not None:
        app.router.add_post(SHARE_MEMORY_PATH, validate_share_memory)
    app.router.add_get(READY_PATH, ready)
    return app


def _log_verdict(request: Mapping[str, Any], verdict: admission.Verdict) -> None:
    resource = request.get("resource")
    plural = resource.get("resource") if isinstance(resource, Mapping) else None
    name = "/".join(str(p) for p in (request.get("namespace"), request.get("name")) if p)
    what = f"{request.get('operation')} {plural} {name or '<generated name>'}"
    if verdict.allowed:
        log.debug("admitted %s (uid %s)", what, request.get("uid"))
    else:
        log.info("denied %s (uid %s): %s", what, request.get("uid"), verdict.message)


class WebhookServer:
    """The webhook served over TLS on `port` (0: any free port) of `host` (None: all)."""

    def __init__(
        self,
        certificate: ReloadingCertificate,
        *,
        port: int,
        driver: str,
        host: str | None = None,
        reload_interval_s: float = RELOAD_INTERVAL_S,
        share_quota: ShareMemoryQuota | None = None,
    ) -> None:
        self.certificate = certificate
        self._runner = web.AppRunner(
            application(driver, share_quota), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S
        )
        self._host = host
        self._port = port
        self._reload_interval_s = reload_interval_s
        self._site: web.TCPSite | None = None
        self._stop = asyncio.Event()
        self._watch: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        """The port listened on (once started)."""
        return self._site.port if self._site is not None else self._port

    async def start(self) -> None:
        await self._runner.setup()
        self._site = web.TCPSite(
            self._runner, self._host, self._port, ssl_context=self.certificate.context
        )
        try:
            await self._site.start()
        except OSError as error:
            await self._runner.cleanup()
            raise WebhookSetupError(
                f"cannot serve the webhook on port {self._port}: {error}"
            ) from error
        self._watch = asyncio.create_task(
            self.certificate.watch(self._stop, self._reload_interval_s)
        )
        log.info("serving the admission webhook on port %d (%s)", self.port, PATH)

    async def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            await self._watch
        await self._runner.cleanup()


async def serving(
    settings: ControllerSettings,
    main: Callable[[], Awaitable[int]],
    *,
    driver: str,
    share_quota: ShareMemoryQuota | None = None,
) -> int:
    """`main()`'s result, with the webhook served while it runs when `settings.webhook_port` is
    set (with the share-memory quota endpoint when `share_quota` is given); `WebhookSetupError`
    (before `main` starts) if the webhook cannot be served."""
    if not settings.webhook_port:
        return await main()
    certificate = ReloadingCertificate(
        settings.webhook_tls_cert_file, settings.webhook_tls_private_key_file
    )
    server = WebhookServer(
        certificate, port=settings.webhook_port, driver=driver, share_quota=share_quota
    )
    await server.start()
    try:
        return await main()
    finally:
        await server.stop()
