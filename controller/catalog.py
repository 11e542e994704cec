"""The DeviceClass catalog: the DeviceClasses in a directory of YAML files, applied to the cluster.

`load_catalog` reads and checks the files; `apply_catalog` applies every class through a
`DeviceClassApi` (server-side apply in the `kubernetes` adapter, so re-applying an unchanged class
changes nothing). One class that fails does not stop the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypedDict, cast

import yaml
from kubernetes import client as k8s

from gpu_dra.controller.metrics import CatalogMetrics
from gpu_dra.driver.resourceapi import API_GROUP, API_VERSION
from gpu_dra.kube import errors
from gpu_dra.kube.client import translated_errors

log = logging.getLogger(__name__)

DEVICE_CLASS_KIND = "DeviceClass"
DEVICE_CLASSES = "deviceclasses"
YAML_SUFFIXES = (".yaml", ".yml")
_VERSION = API_VERSION.removeprefix(f"{API_GROUP}/")


class DeviceClassMeta(TypedDict, total=False):
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]


class DeviceClass(TypedDict):
    apiVersion: str
    kind: str
    metadata: DeviceClassMeta
    spec: dict[str, Any]


class CatalogError(ValueError):
    """A catalog file cannot be used; the message names the file and what to fix."""


class DeviceClassApi(Protocol):
    def apply(self, device_class: DeviceClass) -> None:
        """Create or update the class so that it matches `device_class` (blocking)."""
        ...


class KubernetesDeviceClassApi:
    """`DeviceClassApi` by server-side apply (`application/apply-patch+yaml`, forced)."""

    def __init__(
        self, api_client: k8s.ApiClient, *, field_manager: str, request_timeout_s: float = 30.0
    ) -> None:
        self._objects = k8s.CustomObjectsApi(api_client)
        self._field_manager = field_manager
        self._timeout = request_timeout_s

    def apply(self, device_class: DeviceClass) -> None:
        name = device_class["metadata"]["name"]
        with translated_errors(f"apply DeviceClass {name}"):
            self._objects.patch_cluster_custom_object(
                API_GROUP,
                _VERSION,
                DEVICE_CLASSES,
                name,
                dict(device_class),
                field_manager=self._field_manager,
                force=True,
                _content_type="application/apply-patch+yaml",
                _request_timeout=self._timeout,
            )


@dataclass(frozen=True)
class CatalogResult:
    applied: tuple[str, ...]
    failed: tuple[tuple[str, str], ...]
    """(class name, error message) of each class that could not be applied."""

    @property
    def ok(self) -> bool:
        return not self.failed


def load_catalog(directory: Path) -> tuple[DeviceClass, ...]:
    """Every DeviceClass in `directory`'s `*.yaml`/`*.yml` files, ordered by file name.

    A file may hold several YAML documents; empty documents are skipped. Raises `CatalogError`
    for a missing directory, unreadable YAML, another kind, or a name defined twice.
    """
    if not directory.is_dir():
        raise CatalogError(f"DeviceClass catalog {directory}: not a directory")
    classes: list[DeviceClass] = []
    defined_in: dict[str, Path] = {}
    for path in sorted(p for p in directory.iterdir() if p.suffix in YAML_SUFFIXES):
        for device_class in _read_file(path):
            name = device_class["metadata"]["name"]
            if name in defined_in:
                raise CatalogError(
                    f"{path}: DeviceClass {name!r} is already defined in {defined_in[name]}"
                )
            defined_in[name] = path
            classes.append(device_class)
    return tuple(classes)


async def apply_catalog(
    api: DeviceClassApi, classes: Sequence[DeviceClass], metrics: CatalogMetrics | None = None
) -> CatalogResult:
    """Apply each class; failures are collected, not raised."""
    applied: list[str] = []
    failed: list[tuple[str, str]] = []
    for device_class in classes:
        name = device_class["metadata"]["name"]
        try:
            await asyncio.to_thread(api.apply, device_class)
        except errors.ApiError as error:
            log.warning("applying DeviceClass failed: name=%s error=%s", name, error)
            failed.append((name, str(error)))
        else:
            applied.append(name)
    if metrics is not None:
        metrics.applies.labels(result="applied").inc(len(applied))
        metrics.applies.labels(result="failed").inc(len(failed))
    log.info("applied DeviceClass catalog: applied=%d failed=%d", len(applied), len(failed))
    return CatalogResult(applied=tuple(applied), failed=tuple(failed))


def _read_file(path: Path) -> list[DeviceClass]:
    try:
        documents = list(yaml.safe_load_all(path.read_text(encoding="utf-8")))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as error:
        raise CatalogError(f"{path}: cannot read YAML: {error}") from error
    return [
        _checked(path, index, document)
        for index, document in enumerate(documents)
        if document is not None
    ]


def _checked(path: Path, index: int, document: object) -> DeviceClass:
    where = f"{path} (document {index + 1})"
    if not isinstance(document, dict):
        raise CatalogError(f"{where}: expected a mapping, got {type(document).__name__}")
    if document.get("apiVersion") != API_VERSION or document.get("kind") != DEVICE_CLASS_KIND:
        raise CatalogError(
            f"{where}: expected apiVersion {API_VERSION} and kind {DEVICE_CLASS_KIND}, got "
            f"{document.get('apiVersion')!r} and {document.get('kind')!r}"
        )
    metadata = document.get("metadata")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
        raise CatalogError(f"{where}: metadata.name is required")
    if not isinstance(document.get("spec", {}), dict):
        raise CatalogError(f"{where}: spec must be a mapping")
    document.setdefault("spec", {})
    return cast("DeviceClass", document)
