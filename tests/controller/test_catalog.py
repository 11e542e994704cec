"""The DeviceClass catalog: loading the directory, applying it, and the controller's run loop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from gpu_dra.controller.__main__ import EXIT_APPLY_FAILED, EXIT_BAD_SETUP, EXIT_OK, run
from gpu_dra.controller.catalog import CatalogError, apply_catalog, load_catalog
from gpu_dra.controller.metrics import CatalogMetrics
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.kube import errors
from tests.fakes.deviceclass_api import RecordingDeviceClassApi


def device_class_yaml(name: str, expression: str = "true") -> str:
    return (
        "apiVersion: resource.k8s.io/v1\n"
        "kind: DeviceClass\n"
        f"metadata:\n  name: {name}\n"
        f"spec:\n  selectors:\n  - cel:\n      expression: '{expression}'\n"
    )


@pytest.fixture
def catalog_dir(tmp_path: Path) -> Path:
    (tmp_path / "gpu.example.com.yaml").write_text(device_class_yaml("gpu.example.com"))
    (tmp_path / "mig.example.com.yml").write_text(device_class_yaml("mig.example.com"))
    (tmp_path / "README.md").write_text("not a class")
    return tmp_path


def settings_for(
    directory: Path, *, once: bool = False, resync_s: float = 600.0, retry_s: float = 10.0
) -> ControllerSettings:
    return ControllerSettings(
        deviceclasses_dir=directory,
        metrics_port=0,
        once=once,
        resync_interval_s=resync_s,
        retry_interval_s=retry_s,
    )


def test_catalog_holds_every_yaml_file_in_name_order(catalog_dir: Path) -> None:
    classes = load_catalog(catalog_dir)

    assert [c["metadata"]["name"] for c in classes] == ["gpu.example.com", "mig.example.com"]
    assert classes[0]["spec"]["selectors"][0]["cel"]["expression"] == "true"


def test_a_file_may_hold_several_classes(tmp_path: Path) -> None:
    (tmp_path / "all.yaml").write_text(
        device_class_yaml("a.example.com") + "---\n" + device_class_yaml("b.example.com") + "---\n"
    )

    assert [c["metadata"]["name"] for c in load_catalog(tmp_path)] == [
        "a.example.com",
        "b.example.com",
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "kind: DeviceClass\napiVersion: resource.k8s.io/v1beta1\nmetadata: {name: x}\n",
            "v1beta1",
        ),
        ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n", "ConfigMap"),
        ("apiVersion: resource.k8s.io/v1\nkind: DeviceClass\nspec: {}\n", "metadata.name"),
        ("- just\n- a list\n", "expected a mapping"),
        ("key: [unclosed\n", "cannot read YAML"),
    ],
)
def test_unusable_file_is_refused_naming_the_file(
    tmp_path: Path, content: str, message: str
) -> None:
    (tmp_path / "bad.yaml").write_text(content)

    with pytest.raises(CatalogError, match=message) as raised:
        load_catalog(tmp_path)
    assert "bad.yaml" in str(raised.value)


def test_a_class_defined_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(device_class_yaml("same.example.com"))
    (tmp_path / "b.yaml").write_text(device_class_yaml("same.example.com"))

    with pytest.raises(CatalogError, match=r"already defined in .*a\.yaml"):
        load_catalog(tmp_path)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="not a directory"):
        load_catalog(tmp_path / "absent")


def test_one_failing_class_does_not_stop_the_others(catalog_dir: Path) -> None:
    api = RecordingDeviceClassApi(
        refuse={"gpu.example.com": errors.InvalidError("spec.selectors[0]: compilation failed")}
    )
    registry = CollectorRegistry()

    result = asyncio.run(apply_catalog(api, load_catalog(catalog_dir), CatalogMetrics(registry)))

    assert result.applied == ("mig.example.com",)
    assert [name for name, _ in result.failed] == ["gpu.example.com"]
    assert "compilation failed" in result.failed[0][1]
    assert not result.ok
    assert registry.get_sample_value("gpu_dra_deviceclass_applies_total", {"result": "failed"}) == 1


def test_controller_once_applies_the_catalog_and_exits_ok(catalog_dir: Path) -> None:
    api = RecordingDeviceClassApi()

    status = asyncio.run(
        run(settings_for(catalog_dir, once=True), api, CatalogMetrics(CollectorRegistry()))
    )

    assert status == EXIT_OK
    assert sorted(api.stored) == ["gpu.example.com", "mig.example.com"]


def test_controller_once_exits_1_when_a_class_fails(catalog_dir: Path) -> None:
    api = RecordingDeviceClassApi(refuse={"mig.example.com": errors.ApiError("timeout")})

    status = asyncio.run(
        run(settings_for(catalog_dir, once=True), api, CatalogMetrics(CollectorRegistry()))
    )

    assert status == EXIT_APPLY_FAILED


def test_controller_with_a_broken_catalog_exits_2(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n")

    status = asyncio.run(
        run(
            settings_for(tmp_path, once=True),
            RecordingDeviceClassApi(),
            CatalogMetrics(CollectorRegistry()),
        )
    )

    assert status == EXIT_BAD_SETUP


def test_running_controller_retries_failures_and_picks_up_new_files(catalog_dir: Path) -> None:
    api = RecordingDeviceClassApi(refuse={"mig.example.com": errors.ApiError("timeout")})
    settings = settings_for(catalog_dir, resync_s=0.05, retry_s=0.01)

    async def scenario() -> int:
        stop = asyncio.Event()
        task = asyncio.create_task(
            run(settings, api, CatalogMetrics(CollectorRegistry()), stop=stop)
        )
        await asyncio.sleep(0.05)
        api.refuse.clear()
        (catalog_dir / "new.example.com.yaml").write_text(device_class_yaml("new.example.com"))
        for _ in range(200):
            if "new.example.com" in api.stored:
                break
            await asyncio.sleep(0.01)
        stop.set()
        return await asyncio.wait_for(task, timeout=5)

    assert asyncio.run(scenario()) == EXIT_OK
    assert sorted(api.stored) == ["gpu.example.com", "mig.example.com", "new.example.com"]
