"""The kubelet plugin's gRPC surface, exercised like the kubelet does: real grpc.aio clients
over real Unix sockets in a temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import stat
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as v1
from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2_grpc as v1_grpc
from gpu_dra.kubelet_plugin._generated.dra.v1beta1 import api_pb2 as v1beta1
from gpu_dra.kubelet_plugin._generated.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2_grpc as reg_grpc
from gpu_dra.kubelet_plugin.plugin_sockets import (
    PluginServer,
    registration_socket_name,
    remove_stale_sockets,
    socket_paths,
)
from gpu_dra.kubelet_plugin.prepare_protocol import PreparedDevice
from tests.fakes.claim_preparer import InMemoryClaimPreparer

DRIVER = "gpu.nvidia.com"
UID_A = "0b6a1e3c-8f43-4a55-9a0e-2f7d1c9b8a01"
UID_B = "5d2c9f71-3e8a-4b6d-8c1f-6a4e2b0d9c02"

DEVICE_A = PreparedDevice(
    request_names=("gpu",),
    pool_name="node-a",
    device_name="gpu-0",
    cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-0",),
    share_id="7c1e0f2a-0000-4000-8000-000000000001",
)


@pytest.fixture
def sock_root() -> Iterator[Path]:
    """A short temporary directory: Unix socket paths are limited to 107 bytes."""
    with tempfile.TemporaryDirectory(prefix="gpu-dra-", dir="/tmp") as root:
        yield Path(root)


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


@contextlib.asynccontextmanager
async def serving(
    sock_root: Path, preparer: InMemoryClaimPreparer, **kwargs: Any
) -> AsyncIterator[PluginServer]:
    server = PluginServer(
        driver_name=DRIVER,
        preparer=preparer,
        plugins_dir=sock_root / "plugins",
        registry_dir=sock_root / "plugins_registry",
        **kwargs,
    )
    await server.start()
    try:
        yield server
    finally:
        await server.stop(grace_s=1)


@contextlib.asynccontextmanager
async def channel(path: Path) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"unix:{path}") as ch:
        yield ch


def claim(uid: str, name: str = "claim") -> v1.Claim:
    return v1.Claim(namespace="default", uid=uid, name=name)


def beta_claim(uid: str, name: str = "claim") -> v1beta1.Claim:
    return v1beta1.Claim(namespace="default", uid=uid, name=name)


# --- registration ---------------------------------------------------------------------


def test_get_info_advertises_dra_plugin_with_absolute_endpoint_and_both_services(
    sock_root: Path,
) -> None:
    async def scenario() -> None:
        async with (
            serving(sock_root, InMemoryClaimPreparer()) as server,
            channel(server.registration_socket) as ch,
        ):
            info = await reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=5)
            assert info.type == "DRAPlugin"
            assert info.name == DRIVER
            assert info.endpoint == str(sock_root / "plugins" / DRIVER / "dra.sock")
            assert not info.endpoint.startswith("unix")
            assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]

    run(scenario())


def test_registration_socket_is_named_after_the_driver(sock_root: Path) -> None:
    async def scenario() -> None:
        async with serving(sock_root, InMemoryClaimPreparer()) as server:
            assert server.registration_socket == sock_root / "plugins_registry" / (
                f"{DRIVER}-reg.sock"
            )
            assert stat.S_ISSOCK(server.registration_socket.lstat().st_mode)

    run(scenario())


def test_successful_registration_sets_event_and_runs_callback_every_time(sock_root: Path) -> None:
    republished: list[int] = []

    async def scenario() -> None:
        done = asyncio.Event()

        async def republish_slices() -> None:
            republished.append(1)
            done.set()

        async with (
            serving(sock_root, InMemoryClaimPreparer(), on_registered=republish_slices) as server,
            channel(server.registration_socket) as ch,
        ):
            stub = reg_grpc.RegistrationStub(ch)
            assert not server.registered.is_set()
            for _ in range(2):
                done.clear()
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=True), timeout=5
                )
                await asyncio.wait_for(done.wait(), 5)
            assert server.registered.is_set()
            assert server.registration.registration_count == 2
            assert server.registration.last_outcome is not None
            assert server.registration.last_outcome.registered

    run(scenario())
    assert len(republished) == 2


def test_failed_registration_is_answered_with_an_error_and_clears_the_event(
    sock_root: Path,
) -> None:
    async def scenario() -> None:
        async with (
            serving(sock_root, InMemoryClaimPreparer()) as server,
            channel(server.registration_socket) as ch,
        ):
            stub = reg_grpc.RegistrationStub(ch)
            await stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=5
            )
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=False, error="version mismatch"),
                    timeout=5,
                )
            assert "version mismatch" in (failure.value.details() or "")
            assert not server.registered.is_set()
            assert server.registration.last_outcome is not None
            assert server.registration.last_outcome.error == "version mismatch"

    run(scenario())


def test_failing_registration_callback_does_not_fail_the_notification(sock_root: Path) -> None:
    async def scenario() -> None:
        async def broken() -> None:
            raise RuntimeError("api server down")

        async with (
            serving(sock_root, InMemoryClaimPreparer(), on_registered=broken) as server,
            channel(server.registration_socket) as ch,
        ):
            await reg_grpc.RegistrationStub(ch).NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=5
            )
            await asyncio.sleep(0.05)
            assert server.registered.is_set()

    run(scenario())


# --- DRA v1 ---------------------------------------------------------------------------


def test_v1_prepare_returns_devices_with_share_id(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(devices={UID_A: (DEVICE_A,)})

    async def scenario() -> None:
        async with (
            serving(sock_root, preparer) as server,
            channel(server.dra_socket) as ch,
        ):
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A, "train")]), timeout=10
            )
            assert set(response.claims) == {UID_A}
            entry = response.claims[UID_A]
            assert entry.error == ""
            (device,) = entry.devices
            assert list(device.request_names) == ["gpu"]
            assert device.pool_name == "node-a"
            assert device.device_name == "gpu-0"
            assert list(device.cdi_device_ids) == list(DEVICE_A.cdi_device_ids)
            assert device.HasField("share_id")
            assert device.share_id == DEVICE_A.share_id

    run(scenario())
    ((operation, claims),) = preparer.calls
    assert operation == "prepare"
    assert [(c.namespace, c.uid, c.name) for c in claims] == [("default", UID_A, "train")]


def test_v1_prepare_leaves_share_id_unset_when_device_is_not_shared(sock_root: Path) -> None:
    unshared = PreparedDevice(("gpu",), "node-a", "gpu-1", ())
    preparer = InMemoryClaimPreparer(devices={UID_A: (unshared,)})

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A)]), timeout=10
            )
            (device,) = response.claims[UID_A].devices
            assert not device.HasField("share_id")
            assert list(device.cdi_device_ids) == []

    run(scenario())


def test_v1_unprepare_answers_every_claim_with_per_claim_errors(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(unprepare_errors={UID_B: "MIG device busy"})

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim(UID_A), claim(UID_B)]),
                timeout=10,
            )
            assert set(response.claims) == {UID_A, UID_B}
            assert response.claims[UID_A].error == ""
            assert response.claims[UID_B].error == "MIG device busy"

    run(scenario())


def test_per_claim_prepare_failure_does_not_fail_the_other_claims(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(
        devices={UID_A: (DEVICE_A,)}, prepare_errors={UID_B: "opaque config invalid: fix x"}
    )

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A), claim(UID_B)]), timeout=10
            )
            assert response.claims[UID_A].error == ""
            assert len(response.claims[UID_A].devices) == 1
            assert response.claims[UID_B].error == "opaque config invalid: fix x"
            assert len(response.claims[UID_B].devices) == 0

    run(scenario())


# --- DRA v1beta1 ----------------------------------------------------------------------


def test_v1beta1_prepare_returns_the_same_devices_without_share_id(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(devices={UID_A: (DEVICE_A,)})

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            stub = v1beta1_grpc.DRAPluginStub(ch)
            response = await stub.NodePrepareResources(
                v1beta1.NodePrepareResourcesRequest(claims=[beta_claim(UID_A)]), timeout=10
            )
            (device,) = response.claims[UID_A].devices
            assert device.device_name == "gpu-0"
            assert list(device.cdi_device_ids) == list(DEVICE_A.cdi_device_ids)
            # Read the bytes as a v1 message: field 5 (share_id) must not be on the wire.
            as_v1 = v1.NodePrepareResourcesResponse.FromString(response.SerializeToString())
            assert not as_v1.claims[UID_A].devices[0].HasField("share_id")

    run(scenario())


def test_v1beta1_unprepare_reaches_the_same_preparer(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer()

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            stub = v1beta1_grpc.DRAPluginStub(ch)
            await stub.NodePrepareResources(
                v1beta1.NodePrepareResourcesRequest(claims=[beta_claim(UID_A)]), timeout=10
            )
            assert UID_A in preparer.prepared
            response = await stub.NodeUnprepareResources(
                v1beta1.NodeUnprepareResourcesRequest(claims=[beta_claim(UID_A)]), timeout=10
            )
            assert set(response.claims) == {UID_A}
            assert response.claims[UID_A].error == ""

    run(scenario())
    assert preparer.prepared == {}


# --- response rules -------------------------------------------------------------------


def test_claim_missing_from_preparer_result_gets_an_error_entry(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(forget={UID_B})

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            prepared = await stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A), claim(UID_B)]), timeout=10
            )
            assert set(prepared.claims) == {UID_A, UID_B}
            assert prepared.claims[UID_A].error == ""
            assert "no result" in prepared.claims[UID_B].error
            unprepared = await stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim(UID_A), claim(UID_B)]), timeout=10
            )
            assert set(unprepared.claims) == {UID_A, UID_B}
            assert "no result" in unprepared.claims[UID_B].error

    run(scenario())


def test_unrequested_claims_from_preparer_are_not_sent_to_the_kubelet(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(extra_results={UID_B})

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A)]), timeout=10
            )
            assert set(response.claims) == {UID_A}

    run(scenario())


def test_hung_prepare_becomes_a_per_claim_error_before_the_deadline(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(hang=True)

    async def scenario() -> None:
        async with (
            serving(sock_root, preparer, call_timeout_s=0.3) as server,
            channel(server.dra_socket) as ch,
        ):
            stub = v1_grpc.DRAPluginStub(ch)
            started = time.monotonic()
            response = await stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A), claim(UID_B)]), timeout=10
            )
            assert time.monotonic() - started < 5
            for uid in (UID_A, UID_B):
                assert "did not finish within 0.3s" in response.claims[uid].error
            unprepared = await stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim(UID_A)]), timeout=10
            )
            assert "did not finish" in unprepared.claims[UID_A].error

    run(scenario())
    assert preparer.cancelled == 2


def test_short_client_deadline_still_gets_a_response_with_per_claim_errors(
    sock_root: Path,
) -> None:
    preparer = InMemoryClaimPreparer(hang=True)

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A)]), timeout=2.5
            )
            assert "did not finish" in response.claims[UID_A].error

    run(scenario())


@pytest.mark.parametrize("deadline_s", [1.0, 0.5])
def test_a_deadline_of_a_second_or_less_still_leaves_time_to_answer(
    sock_root: Path, deadline_s: float
) -> None:
    # An already-prepared claim: answered after a thread hop and a checkpoint read.
    preparer = InMemoryClaimPreparer(delay_s=0.02)

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            stub = v1_grpc.DRAPluginStub(ch)
            response = await stub.NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A)]), timeout=deadline_s
            )
            assert response.claims[UID_A].error == ""
            unprepared = await stub.NodeUnprepareResources(
                v1.NodeUnprepareResourcesRequest(claims=[claim(UID_A)]), timeout=deadline_s
            )
            assert unprepared.claims[UID_A].error == ""

    run(scenario())


def test_preparer_exception_becomes_a_per_claim_error_not_a_grpc_error(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer(raise_error=RuntimeError("nvml exploded"))

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A), claim(UID_B)]), timeout=10
            )
            for uid in (UID_A, UID_B):
                assert "RuntimeError: nvml exploded" in response.claims[uid].error

    run(scenario())


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_empty_request_returns_empty_map_without_calling_preparer(
    sock_root: Path, version: str
) -> None:
    preparer = InMemoryClaimPreparer()

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            api: Any = v1 if version == "v1" else v1beta1
            grpc_api: Any = v1_grpc if version == "v1" else v1beta1_grpc
            stub = grpc_api.DRAPluginStub(ch)
            prepared = await stub.NodePrepareResources(api.NodePrepareResourcesRequest(), timeout=5)
            unprepared = await stub.NodeUnprepareResources(
                api.NodeUnprepareResourcesRequest(), timeout=5
            )
            assert len(prepared.claims) == 0
            assert len(unprepared.claims) == 0

    run(scenario())
    assert preparer.calls == []


def test_duplicate_claims_in_a_request_are_prepared_once(sock_root: Path) -> None:
    preparer = InMemoryClaimPreparer()

    async def scenario() -> None:
        async with serving(sock_root, preparer) as server, channel(server.dra_socket) as ch:
            response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                v1.NodePrepareResourcesRequest(claims=[claim(UID_A), claim(UID_A)]), timeout=10
            )
            assert set(response.claims) == {UID_A}

    run(scenario())
    ((_, claims),) = preparer.calls
    assert len(claims) == 1


# --- sockets --------------------------------------------------------------------------


@contextlib.contextmanager
def fast_thread_switching() -> Iterator[None]:
    """Let a watcher thread run often while the event loop thread is busy."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def watch(stop: threading.Event, probe: Callable[[], None]) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            probe()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_dra_socket_serves_before_registration_socket_appears(sock_root: Path) -> None:
    dra_sock = sock_root / "plugins" / DRIVER / "dra.sock"
    reg_sock = sock_root / "plugins_registry" / f"{DRIVER}-reg.sock"
    seen: dict[str, bool] = {}
    stop = threading.Event()

    def probe() -> None:
        if "dra_at_reg" not in seen and reg_sock.exists():
            seen["dra_at_reg"] = dra_sock.exists()
            # The kubelet connects as soon as it sees the registration socket.
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
                client.connect(str(dra_sock))
            seen["connected"] = True
            stop.set()

    async def scenario() -> None:
        with fast_thread_switching():
            thread = watch(stop, probe)
            async with serving(sock_root, InMemoryClaimPreparer()):
                await asyncio.to_thread(stop.wait, 5)
            stop.set()
            thread.join(5)

    run(scenario())
    assert seen == {"dra_at_reg": True, "connected": True}


class _CheckWhenLogged(logging.Handler):
    """Runs a check at the moment the server logs a message starting with ``prefix``."""

    def __init__(self, prefix: str, check: Callable[[], None]) -> None:
        super().__init__()
        self.prefix = prefix
        self.check = check
        self.failures: list[BaseException] = []
        self.ran = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(self.prefix):
            self.ran += 1
            try:
                self.check()
            except BaseException as err:  # reported by the test below
                self.failures.append(err)


def test_registration_socket_is_absent_while_dra_socket_becomes_ready(sock_root: Path) -> None:
    dra_sock = sock_root / "plugins" / DRIVER / "dra.sock"
    reg_sock = sock_root / "plugins_registry" / f"{DRIVER}-reg.sock"

    def dra_is_serving_and_not_registered_yet() -> None:
        assert not reg_sock.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.connect(str(dra_sock))

    handler = _CheckWhenLogged("dra service serving", dra_is_serving_and_not_registered_yet)
    server_log = logging.getLogger("gpu_dra.kubelet_plugin.plugin_sockets")
    server_log.addHandler(handler)
    level = server_log.level
    server_log.setLevel(logging.INFO)

    async def scenario() -> None:
        async with serving(sock_root, InMemoryClaimPreparer()):
            assert reg_sock.exists()

    try:
        run(scenario())
    finally:
        server_log.removeHandler(handler)
        server_log.setLevel(level)
    assert handler.ran == 1
    assert handler.failures == []


def test_stop_removes_registration_socket_before_dra_socket(sock_root: Path) -> None:
    observed: list[tuple[bool, bool]] = []
    stop = threading.Event()

    async def scenario() -> None:
        async with serving(sock_root, InMemoryClaimPreparer()) as server:

            def probe() -> None:
                # Look at the DRA socket first: once it is gone, the registration socket
                # must already be gone too.
                dra_present = server.dra_socket.exists()
                registration_present = server.registration_socket.exists()
                observed.append((registration_present, dra_present))

            with fast_thread_switching():
                thread = watch(stop, probe)
                await server.stop(grace_s=1)
                await asyncio.sleep(0.05)
                stop.set()
                thread.join(5)
            assert not server.registration_socket.exists()
            assert not server.dra_socket.exists()

    run(scenario())
    assert (True, False) not in observed
    assert observed[-1] == (False, False)


def test_stale_socket_files_are_replaced_on_start(sock_root: Path) -> None:
    dra_sock = sock_root / "plugins" / DRIVER / "dra.sock"
    reg_sock = sock_root / "plugins_registry" / f"{DRIVER}-reg.sock"
    for path in (dra_sock, reg_sock):
        path.parent.mkdir(parents=True, exist_ok=True)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
            leftover.bind(str(path))  # closed without unlink: a stale socket file
        assert stat.S_ISSOCK(path.lstat().st_mode)
        with (
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client,
            pytest.raises(ConnectionRefusedError),
        ):
            client.connect(str(path))

    async def scenario() -> None:
        async with serving(sock_root, InMemoryClaimPreparer()) as server:
            async with channel(server.dra_socket) as ch:
                response = await v1_grpc.DRAPluginStub(ch).NodePrepareResources(
                    v1.NodePrepareResourcesRequest(), timeout=5
                )
                assert len(response.claims) == 0
            async with channel(server.registration_socket) as ch:
                info = await reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=5)
                assert info.name == DRIVER

    run(scenario())


def test_regular_file_in_place_of_a_socket_is_not_deleted(sock_root: Path) -> None:
    dra_sock = sock_root / "plugins" / DRIVER / "dra.sock"
    dra_sock.parent.mkdir(parents=True)
    dra_sock.write_text("not a socket")

    async def scenario() -> None:
        with pytest.raises(FileExistsError, match="not a socket"):
            async with serving(sock_root, InMemoryClaimPreparer()):
                pass

    run(scenario())
    assert dra_sock.read_text() == "not a socket"
    assert not (sock_root / "plugins_registry" / f"{DRIVER}-reg.sock").exists()


def test_sockets_and_socket_dir_are_owner_only(sock_root: Path) -> None:
    async def scenario() -> None:
        async with serving(sock_root, InMemoryClaimPreparer()) as server:
            assert stat.S_IMODE(server.socket_dir.stat().st_mode) == 0o750
            assert stat.S_IMODE(server.dra_socket.lstat().st_mode) == 0o600
            assert stat.S_IMODE(server.registration_socket.lstat().st_mode) == 0o600

    run(scenario())


def test_instance_id_gives_each_instance_its_own_sockets(sock_root: Path) -> None:
    async def scenario() -> None:
        async with (
            serving(sock_root, InMemoryClaimPreparer(), instance_id="pod-1") as first,
            serving(sock_root, InMemoryClaimPreparer(), instance_id="pod-2") as second,
        ):
            assert first.dra_socket.name == "dra-pod-1.sock"
            assert first.registration_socket.name == f"{DRIVER}-pod-1-reg.sock"
            assert second.dra_socket != first.dra_socket
            async with channel(second.registration_socket) as ch:
                info = await reg_grpc.RegistrationStub(ch).GetInfo(reg.InfoRequest(), timeout=5)
                assert info.endpoint == str(second.dra_socket)

    run(scenario())


def test_registration_socket_names_fit_a_unix_socket_as_the_reference_library_names_them(
    sock_root: Path,
) -> None:
    uid = "4f1c2b9e-0000-4000-8000-00000000000a"
    short = sock_root / "r"
    assert registration_socket_name(short, DRIVER, uid) == f"{DRIVER}-{uid}-reg.sock"
    # k8s.io/dynamic-resource-allocation's RollingUpdateRegistrarSocketFile: the UID's hash, then
    # a hash of driver and UID, when the full name does not fit.
    # (Expected names computed with Go's crypto/sha256 and base64.RawURLEncoding.) The hashed
    # names are 35 bytes: a directory of 70 - len(root) characters leaves exactly 107 for it.
    medium = sock_root / ("m" * (70 - len(str(sock_root))))
    assert registration_socket_name(medium, DRIVER, uid) == f"{DRIVER}-pUqlSSjrsxw-reg.sock"
    deep = sock_root / ("d" * (71 - len(str(sock_root))))
    assert registration_socket_name(deep, DRIVER, uid) == "dra-wQxNw5rDz__BmKpWJGwPYw-reg.sock"
    # A long driver name does not fit even with the UID's hash; the third name does.
    long_driver = "a" * 40 + ".example.com"
    third = registration_socket_name(medium, long_driver, uid)
    assert third.startswith("dra-")
    assert third != registration_socket_name(medium, DRIVER, uid)
    assert len(os.fsencode(medium / third)) <= 107
    for directory in (short, medium):
        dra, registration = socket_paths(DRIVER, sock_root, directory, uid)
        assert dra == sock_root / DRIVER / f"dra-{uid}.sock"
        assert len(os.fsencode(registration)) <= 107
    assert socket_paths(DRIVER, sock_root, short, None) == (
        sock_root / DRIVER / "dra.sock",
        short / f"{DRIVER}-reg.sock",
    )


def test_only_sockets_nobody_serves_are_removed_as_stale(sock_root: Path) -> None:
    dead = sock_root / "dead.sock"
    kept = sock_root / "kept.sock"
    live = sock_root / "live.sock"
    plain = sock_root / "plain.sock"
    for path in (dead, kept):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
            leftover.bind(str(path))
    plain.write_text("not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(live))
        listener.listen()

        removed = remove_stale_sockets(
            [dead, kept, live, plain, sock_root / "missing.sock"], keep={kept}
        )

        assert removed == [dead]
        assert live.exists()
    assert not dead.exists()
    assert kept.exists()
    assert plain.read_text() == "not a socket"


def test_stop_is_idempotent(sock_root: Path) -> None:
    async def scenario() -> None:
        async with serving(sock_root, InMemoryClaimPreparer()) as server:
            await server.stop(grace_s=0)
            await server.stop(grace_s=0)
            assert not server.dra_socket.exists()

    run(scenario())


@pytest.mark.parametrize("name", ["GPU.example.com", "../evil", "a/b", ""])
def test_invalid_driver_names_are_rejected(sock_root: Path, name: str) -> None:
    with pytest.raises(ValueError, match="DNS subdomain"):
        PluginServer(driver_name=name, preparer=InMemoryClaimPreparer(), plugins_dir=sock_root)


def test_deadline_must_stay_below_the_kubelets(sock_root: Path) -> None:
    with pytest.raises(ValueError, match="below the kubelet"):
        PluginServer(
            driver_name=DRIVER,
            preparer=InMemoryClaimPreparer(),
            plugins_dir=sock_root,
            call_timeout_s=45,
        )


def test_dra_socket_path_is_absolute_even_for_relative_dirs(
    sock_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(sock_root)
    server = PluginServer(
        driver_name=DRIVER,
        preparer=InMemoryClaimPreparer(),
        plugins_dir=Path("plugins"),
        registry_dir=Path("registry"),
    )
    assert server.dra_socket.is_absolute()
    assert os.fspath(server.dra_socket) == os.fspath(sock_root / "plugins" / DRIVER / "dra.sock")


def test_socket_path_too_long_for_a_unix_socket_is_rejected(sock_root: Path) -> None:
    with pytest.raises(ValueError, match="longer than 107 bytes"):
        PluginServer(
            driver_name=DRIVER,
            preparer=InMemoryClaimPreparer(),
            plugins_dir=sock_root / ("x" * 100),
            registry_dir=sock_root,
        )
