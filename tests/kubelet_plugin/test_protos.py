"""The vendored protos match the kubelet's wire facts and the checked-in stubs are fresh."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest
from google.protobuf.descriptor import FieldDescriptor

from gpu_dra.kubelet_plugin._generated.dra.v1 import api_pb2 as v1
from gpu_dra.kubelet_plugin._generated.dra.v1beta1 import api_pb2 as v1beta1
from gpu_dra.kubelet_plugin._generated.pluginregistration import api_pb2 as reg
from gpu_dra.kubelet_plugin.protos import generate

STRING = FieldDescriptor.TYPE_STRING
BOOL = FieldDescriptor.TYPE_BOOL
MESSAGE = FieldDescriptor.TYPE_MESSAGE


def test_checked_in_stubs_match_freshly_generated_ones(tmp_path: Path) -> None:
    fresh = tmp_path / "_generated"
    generate.generate(fresh)
    assert generate.differences(fresh, generate.GENERATED_DIR) == []


def test_check_mode_reports_stale_stubs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    stale = tmp_path / "_generated"
    generate.generate(stale)
    (stale / "dra" / "v1" / "api_pb2.py").write_text("# edited by hand\n")
    assert generate.main(["--check", "--out", str(stale)]) == 1
    assert "api_pb2.py" in capsys.readouterr().err
    assert generate.main(["--check", "--out", str(generate.GENERATED_DIR)]) == 0


def test_v1_and_v1beta1_register_under_different_proto_file_names() -> None:
    assert v1.DESCRIPTOR.name != v1beta1.DESCRIPTOR.name
    assert v1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1"
    assert v1beta1.DESCRIPTOR.package == "k8s.io.kubelet.pkg.apis.dra.v1beta1"
    assert reg.DESCRIPTOR.package == "pluginregistration"


def fields(message: Any) -> dict[str, tuple[int, int, bool]]:
    descriptor = message.DESCRIPTOR
    return {f.name: (f.number, f.type, f.is_repeated) for f in descriptor.fields}


@pytest.mark.parametrize("api", [v1, v1beta1], ids=["v1", "v1beta1"])
def test_dra_messages_have_the_kubelets_field_numbers(api: Any) -> None:
    assert fields(api.Claim) == {
        "namespace": (1, STRING, False),
        "uid": (2, STRING, False),
        "name": (3, STRING, False),
    }
    assert fields(api.NodePrepareResourcesRequest) == {"claims": (1, MESSAGE, True)}
    assert fields(api.NodeUnprepareResourcesRequest) == {"claims": (1, MESSAGE, True)}
    assert fields(api.NodePrepareResourceResponse) == {
        "devices": (1, MESSAGE, True),
        "error": (2, STRING, False),
    }
    assert fields(api.NodeUnprepareResourceResponse) == {"error": (1, STRING, False)}
    for response in (api.NodePrepareResourcesResponse, api.NodeUnprepareResourcesResponse):
        claims = response.DESCRIPTOR.fields_by_name["claims"]
        assert claims.number == 1
        assert claims.message_type.GetOptions().map_entry
        assert claims.message_type.fields_by_name["key"].type == STRING
    device = {
        "request_names": (1, STRING, True),
        "pool_name": (2, STRING, False),
        "device_name": (3, STRING, False),
        "cdi_device_ids": (4, STRING, True),
    }
    if api is v1:
        device["share_id"] = (5, STRING, False)
        assert v1.Device.DESCRIPTOR.fields_by_name["share_id"].has_presence
    assert fields(api.Device) == device


@pytest.mark.parametrize("api", [v1, v1beta1], ids=["v1", "v1beta1"])
def test_dra_service_paths(api: Any) -> None:
    service = api.DESCRIPTOR.services_by_name["DRAPlugin"]
    assert sorted(service.methods_by_name) == ["NodePrepareResources", "NodeUnprepareResources"]
    assert service.full_name == f"{api.DESCRIPTOR.package}.DRAPlugin"


def test_registration_messages_have_the_kubelets_field_numbers() -> None:
    assert fields(reg.PluginInfo) == {
        "type": (1, STRING, False),
        "name": (2, STRING, False),
        "endpoint": (3, STRING, False),
        "supported_versions": (4, STRING, True),
    }
    assert fields(reg.RegistrationStatus) == {
        "plugin_registered": (1, BOOL, False),
        "error": (2, STRING, False),
    }
    assert fields(reg.InfoRequest) == {}
    assert fields(reg.RegistrationStatusResponse) == {}
    service = reg.DESCRIPTOR.services_by_name["Registration"]
    assert service.full_name == "pluginregistration.Registration"
    assert sorted(service.methods_by_name) == ["GetInfo", "NotifyRegistrationStatus"]


INT64 = FieldDescriptor.TYPE_INT64
ENUM = FieldDescriptor.TYPE_ENUM


@pytest.mark.parametrize("version", ["v1", "v1alpha1"])
def test_health_service_has_the_kubelets_names_and_field_numbers(version: str) -> None:
    api = importlib.import_module(f"gpu_dra.kubelet_plugin._generated.dra_health.{version}.api_pb2")
    assert api.DESCRIPTOR.package == version
    service = api.DESCRIPTOR.services_by_name["DRAResourceHealth"]
    assert service.full_name == f"{version}.DRAResourceHealth"  # what registration advertises
    (method,) = service.methods
    assert (method.name, method.server_streaming, method.client_streaming) == (
        "NodeWatchResources",
        True,
        False,
    )
    assert fields(api.NodeWatchResourcesRequest) == {}
    assert fields(api.NodeWatchResourcesResponse) == {"devices": (1, MESSAGE, True)}
    assert fields(api.DeviceIdentifier) == {
        "pool_name": (1, STRING, False),
        "device_name": (2, STRING, False),
    }
    assert fields(api.DeviceHealth) == {
        "device": (1, MESSAGE, False),
        "health": (2, ENUM, False),
        "last_updated_time": (3, INT64, False),
        "health_check_timeout_seconds": (4, INT64, False),
        "message": (5, STRING, False),
    }
    assert dict(api.HealthStatus.items()) == {"UNKNOWN": 0, "HEALTHY": 1, "UNHEALTHY": 2}
