"""The opaque config entries of ResourceClaims, ResourceClaimTemplates and DeviceClasses, judged
as the kubelet plugin judges them at prepare.

`config_list` finds an object's entries (``spec.devices.config``, ``spec.spec.devices.config``,
``spec.config``; the same paths in resource.k8s.io v1, v1beta2 and v1beta1); `check_config_list`
runs each entry for the driver through `resolve_configs`, the plugin's own code path, with no
devices, so every entry is decoded and validated. Messages are the plugin's, located by the
entry's path: ``spec.devices.config[0]: parameters.sharing.strategy: unknown GPU sharing ...``.
An entry for another driver is skipped, unless `near_miss_driver` finds it is this driver's
config under a misspelt driver name (``gpu.nvidai.com`` with a ``resource.nvidia.com`` GpuConfig):
no driver would apply it, so it is an error with "did you mean". The controller's admission
webhook uses it (docs/deployment.md#admission-webhook).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from gpu_dra.driver.config.api import API_GROUP
from gpu_dra.driver.config.decode import KINDS
from gpu_dra.driver.config.errors import MAX_PROBLEMS_SHOWN, ConfigError, ConfigProblem
from gpu_dra.driver.config.resolve import NOT_OPAQUE, ConfigSource, resolve_configs, shown_name
from gpu_dra.driver.jsonbounds import describe

Verdict = Literal["OK", "ERROR", "SKIP"]

CONFIG_LISTS: Final[dict[str, tuple[tuple[str, ...], ConfigSource]]] = {
    "ResourceClaim": (("spec", "devices", "config"), "FromClaim"),
    "ResourceClaimTemplate": (("spec", "spec", "devices", "config"), "FromClaim"),
    "DeviceClass": (("spec", "config"), "FromClass"),
}
"""Kind -> where its config list is, and the source the scheduler gives its entries."""

NOT_AN_ENTRY: Final = "expected an object with opaque.driver and opaque.parameters"
NOT_A_LIST: Final = "expected a list of config entries"

NEAR_MISS_RATIO: Final = 0.8
"""How alike (difflib's ratio, case ignored) a driver name must be to the driver's to be read as
a misspelling of it: gpu.nvidai.com 0.93, mig.nvidia.com 0.86; NVIDIA's compute-domain.nvidia.com
(whose configs are resource.nvidia.com too, of other kinds) 0.67."""


@dataclass(frozen=True)
class EntryCheck:
    """The verdict on one config entry, or on a config list that is not a list."""

    path: str
    """``spec.devices.config[0]`` (``spec.devices.config`` for the list itself)."""
    verdict: Verdict
    message: str = ""

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.message else self.path


def config_list(kind: str, obj: Mapping[str, object]) -> object:
    """The raw value at the config path of `kind` in `obj` (None where the path ends early, or
    the value in the way where it is not an object). KeyError for kinds without config."""
    keys, _ = CONFIG_LISTS[kind]
    value: object = obj
    for key in keys:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    return value


def check_config_list(kind: str, obj: Mapping[str, object], *, driver: str) -> list[EntryCheck]:
    """The verdict on each config entry of `obj`, a `kind` object (see `CONFIG_LISTS`)."""
    keys, source = CONFIG_LISTS[kind]
    entries: object = obj
    for depth, key in enumerate(keys):
        if entries is None:
            return []
        if not isinstance(entries, Mapping):
            return [EntryCheck(".".join(keys[:depth]), "ERROR", "expected an object")]
        entries = entries.get(key)
    if entries is None:
        return []
    if not isinstance(entries, list):
        return [EntryCheck(".".join(keys), "ERROR", NOT_A_LIST)]
    checks = []
    for index, entry in enumerate(entries):
        verdict, message = check_entry(entry, source=source, driver=driver)
        checks.append(EntryCheck(f"{'.'.join(keys)}[{index}]", verdict, message))
    return checks


def check_entry(entry: object, *, source: ConfigSource, driver: str) -> tuple[Verdict, str]:
    """Verdict and message for one ``config`` entry, as the kubelet plugin would judge it.

    Entries of other drivers are skipped. Problems come back without the entry's label (the
    caller names the entry by its path): ``parameters.kind: unsupported kind ...``.
    """
    if not isinstance(entry, Mapping):
        return "ERROR", NOT_AN_ENTRY
    opaque = entry.get("opaque")
    if not isinstance(opaque, Mapping):
        return "ERROR", NOT_OPAQUE
    entry_driver = opaque.get("driver")
    if entry_driver != driver:
        near_miss = near_miss_driver(opaque, driver=driver)
        if near_miss is not None:
            return "ERROR", near_miss
        shown = (
            shown_name(entry_driver) if isinstance(entry_driver, str) else describe(entry_driver)
        )
        return "SKIP", f"driver {shown} is not {driver}"
    try:
        resolve_configs([{**entry, "source": source}], [], driver=driver, claim="")
    except ConfigError as error:
        problems = [ConfigProblem(p.reason, field=p.field) for p in error.problems]
        message = "; ".join(str(problem) for problem in problems[:MAX_PROBLEMS_SHOWN])
        hidden = len(problems) - MAX_PROBLEMS_SHOWN
        if hidden > 0:
            message += f"; ({hidden} more problem{'s' if hidden > 1 else ''})"
        return "ERROR", message
    return "OK", ""


def near_miss_driver(opaque: Mapping[str, object], *, driver: str) -> str | None:
    """Why the ``opaque`` part of a config entry looks like `driver`'s config under a misspelt
    driver name, or None: its parameters are of `driver`'s API (``resource.nvidia.com/*``, a
    kind `driver` decodes) and its driver name, not `driver`, is close to it (`NEAR_MISS_RATIO`).
    Such an entry is for no installed driver: the scheduler passes it on and every driver skips
    it, so the claim would run without the config."""
    name, parameters = opaque.get("driver"), opaque.get("parameters")
    if not isinstance(name, str) or name == driver or not isinstance(parameters, Mapping):
        return None
    api_version, kind = parameters.get("apiVersion"), parameters.get("kind")
    if not (
        isinstance(api_version, str)
        and api_version.startswith(f"{API_GROUP}/")
        and isinstance(kind, str)
        and kind in KINDS
    ):
        return None
    matcher = difflib.SequenceMatcher(None, name.lower(), driver.lower())
    if matcher.real_quick_ratio() < NEAR_MISS_RATIO or matcher.ratio() < NEAR_MISS_RATIO:
        return None  # the first test, on the lengths alone, spares a long name the full one
    return (
        f"opaque.driver: {shown_name(name)} is not {driver}, but the parameters are {driver}'s "
        f"{shown_name(kind)}: did you mean {driver}? As written, {driver} ignores this config"
    )
