"""`gpu-dra lint`: check DeviceClass and claim selectors before they reach a cluster.

The checks (`lint`, pure): every CEL selector compiles; names gpu-dra never publishes are errors
(with a suggestion), names only NVIDIA's driver publishes warnings; common mistakes get a
linted rewrite (`lint_fixes`); each DeviceClass, and each claim
request on its class's devices, is evaluated on the devices of simulated machines as the scheduler
evaluates it (runtime errors, classes selecting nothing or the same devices). Names are read from
the selector text with the tokenizer of `gpu_dra.driver.cel.source`. The command reads the files
and builds the devices (`devices.plugin_devices`).
See docs/cel.md, "gpu-dra lint".
"""

from __future__ import annotations

import argparse
import difflib
import re
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Literal

from gpu_dra.cli.command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PROG,
    STDIN,
    STDIN_LABEL,
    CliError,
    Streams,
    Subcommand,
    add_env_argument,
    print_error,
    write_data,
)
from gpu_dra.cli.devices import plugin_devices
from gpu_dra.cli.lint_fixes import Names, ValueType, suggest_fix
from gpu_dra.cli.lint_quota import LintedClass, quota_findings, read_quota
from gpu_dra.cli.manifests import load_documents
from gpu_dra.driver.attributes import gpu_device, mig_device
from gpu_dra.driver.cel import (
    CelCompileError,
    CelRuntimeError,
    DraDevice,
    Selector,
    compile_selector,
    to_cel_device,
)
from gpu_dra.driver.cel.source import LexError, Token, tokens
from gpu_dra.driver.cel.values import Semver
from gpu_dra.driver.config.objects import CONFIG_LISTS, config_list, near_miss_driver
from gpu_dra.driver.config.quantity import parse_quantity
from gpu_dra.driver.mig_policy import DEFAULT as DEFAULT_MIG_POLICY
from gpu_dra.driver.mig_policy import (
    DEFAULT_POLICY_TEXT,
    EVERYTHING,
    MigPolicy,
    MigPolicyError,
    parse_policy,
)
from gpu_dra.driver.model import MigDevice
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.driver.nvml.simulated_profiles import (
    ProfileError,
    builtin_models,
    builtin_profile_names,
)
from gpu_dra.driver.resourceapi import API_GROUP, Device
from gpu_dra.driver.shares import offered_device

Level = Literal["ERROR", "WARNING", "INFO"]
LEVELS: Final[tuple[Level, ...]] = ("ERROR", "WARNING", "INFO")
Kind = Literal["attributes", "capacity"]

DEVICE_CLASS: Final = "DeviceClass"
RESOURCE_CLAIM: Final = "ResourceClaim"
RESOURCE_CLAIM_TEMPLATE: Final = "ResourceClaimTemplate"
KINDS: Final = (DEVICE_CLASS, RESOURCE_CLAIM, RESOURCE_CLAIM_TEMPLATE)
QUOTA_KIND: Final = "ResourceQuota"
"""Also read (v1): the holes a tier quota leaves (`lint_quota`, docs/quotas.md)."""
_REQUESTS_PATH: Final = {
    RESOURCE_CLAIM: ("spec", "devices", "requests"),
    RESOURCE_CLAIM_TEMPLATE: ("spec", "spec", "devices", "requests"),
}

# Names NVIDIA's DRA driver publishes that gpu-dra does not (yet): nvidia-compat.md §3.1.
_NVIDIA_ONLY: Final[dict[tuple[Kind, str], str]] = {
    ("attributes", "gpuModuleID"): "with FabricManagerPartitioning",
    **{("attributes", f"partition{n}"): "with FabricManagerPartitioning" for n in (1, 2, 4, 8)},
}
_SIMPLE_STRING: Final = re.compile(r"""[rR]?(?:'([^'\\\n]*)'|"([^"\\\n]*)")""")
_KIND_WORD: Final[dict[Kind, str]] = {"attributes": "attribute", "capacity": "capacity"}


@dataclass(frozen=True)
class Suggestion:
    """What to write instead of a selector, linted: it compiles, reads only published names,
    and selects `selected` of the `candidates` devices (`scope` says which)."""

    expression: str
    reasons: tuple[str, ...]
    selected: int
    candidates: int
    products: str
    errors: int
    """Devices on which the suggestion raises a runtime error (a missing attribute)."""
    scope: str = ""
    """`` DeviceClass x selects`` for a claim's request; empty: every simulated device."""

    @property
    def verdict(self) -> str:
        of = f"the {self.candidates}" if self.scope else str(self.candidates)
        text = f"compiles and selects {self.selected} of {of} devices{self.scope}"
        if self.products:
            text += f": {self.products}"
        if self.errors:
            text += f"; CEL runtime error on {self.errors}"
        return text

    def to_json(self) -> dict[str, Any]:
        return {
            "expression": self.expression,
            "reasons": list(self.reasons),
            "selects": self.selected,
            "of": self.candidates,
            "products": self.products,
            "runtimeErrors": self.errors,
        }


@dataclass(frozen=True)
class Finding:
    """One line of the lint report (and, with a suggestion, the lines that teach the fix)."""

    level: Level
    file: str
    object: str
    """``<kind>/<name>``."""
    message: str
    path: str = ""
    """Where in the object, ``spec.selectors[0].cel.expression``; empty for the whole object."""
    suggestion: Suggestion | None = None

    def __str__(self) -> str:
        where = f"{self.path}: " if self.path else ""
        line = f"{self.level} {self.file} {self.object}: {where}{self.message}"
        if self.suggestion is None:
            return line
        lines = [line, *(f"  why: {reason}" for reason in self.suggestion.reasons)]
        lines.append(f"  write instead: {self.suggestion.expression}")
        lines.append(f"  which {self.suggestion.verdict}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "level": self.level,
            "file": self.file,
            "object": self.object,
            "path": self.path,
            "message": self.message,
        }
        if self.suggestion is not None:
            data["suggestion"] = self.suggestion.to_json()
        return data


@dataclass(frozen=True)
class Source:
    """The objects of one input file (``<stdin>`` for standard input), Lists already opened."""

    file: str
    documents: Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class SimulatedDevice:
    """A device published on a simulated machine."""

    profile: str
    device: Device

    @property
    def key(self) -> tuple[str, str]:
        return self.profile, self.device["name"]

    @property
    def product(self) -> str:
        value = self.device.get("attributes", {}).get("productName", {}).get("string")
        return value if isinstance(value, str) else "?"

    def __str__(self) -> str:
        return f"{self.profile}/{self.device['name']} ({self.product})"


@dataclass(frozen=True)
class PublishedNames:
    """Attribute and capacity names (domain, identifier) a driver publishes."""

    attributes: frozenset[tuple[str, str]]
    capacity: frozenset[tuple[str, str]]

    @classmethod
    def of(cls, devices: Sequence[DraDevice]) -> PublishedNames:
        return cls(
            attributes=frozenset(
                (d, n) for dev in devices for d in dev.attributes for n in dev.attributes[d]
            ),
            capacity=frozenset(
                (d, n) for dev in devices for d in dev.capacity for n in dev.capacity[d]
            ),
        )

    def __or__(self, other: PublishedNames) -> PublishedNames:
        return PublishedNames(self.attributes | other.attributes, self.capacity | other.capacity)

    def names(self, kind: Kind) -> frozenset[tuple[str, str]]:
        return self.attributes if kind == "attributes" else self.capacity

    @property
    def domains(self) -> frozenset[str]:
        return frozenset(domain for domain, _ in self.attributes | self.capacity)


def publishable_names(driver: str = DEFAULT_DRIVER_NAME) -> PublishedNames:
    """Every name gpu-dra can publish: those of a GPU for which NVML reports every optional fact
    (memory, addressing mode, NUMA node, PCIe root) and of a MIG device spanning all 8 memory
    slices of it, so names no simulated profile happens to have (``addressingMode``) count."""
    full = replace(
        builtin_models()["H100-SXM5-80GB"].gpu(),
        pcie_root="pci0000:18",
        numa_node=0,
        addressing_mode=1,
    )
    mig = MigDevice(
        parent=replace(full, mig_enabled=True, mig_pending_enabled=True),
        profile="7g.80gb",
        gi_profile_id=0,
        placement_start=0,
        placement_size=8,
        gi_id=0,
        ci_id=0,
        ci_profile_id=7,
        uuid="MIG-00000000-0000-0000-0000-000000000000",
        memory_bytes=80 * 2**30,
        multiprocessors=132,
        copy_engines=8,
        decoders=7,
        encoders=0,
        jpeg_engines=7,
        ofa_engines=1,
    )
    devices = [gpu_device(full), offered_device(gpu_device(full), full), mig_device(mig)]
    return PublishedNames.of([to_cel_device(driver, device) for device in devices])


@dataclass(frozen=True)
class Reference:
    """``device.<kind>[<domain>].<name>`` read by a selector."""

    kind: Kind
    domain: str
    name: str

    def __str__(self) -> str:
        return f"device.{self.kind}['{self.domain}'].{self.name}"


@dataclass
class ClassResult:
    """What one DeviceClass selects."""

    file: str
    name: str
    selected: list[SimulatedDevice] = field(default_factory=list)
    evaluated: bool = False
    """False when a selector did not compile (or the object is malformed): nothing evaluated."""
    failed: bool = False
    """Some device raised a runtime error."""

    @property
    def keys(self) -> frozenset[tuple[str, str]]:
        return frozenset(device.key for device in self.selected)

    def to_json(self) -> dict[str, Any]:
        selects: dict[str, list[str]] = {}
        for device in self.selected:
            selects.setdefault(device.profile, []).append(device.device["name"])
        return {
            "file": self.file,
            "name": self.name,
            "evaluated": self.evaluated,
            "devices": len(self.selected),
            "selects": selects,
        }


@dataclass
class LintReport:
    findings: list[Finding]
    classes: list[ClassResult]
    objects: Counter[str]
    profiles: list[str]
    devices: int

    def count(self, level: Level) -> int:
        return sum(finding.level == level for finding in self.findings)

    def failed(self, *, strict: bool = False) -> bool:
        """Whether the lint fails: errors, or with `strict` warnings too."""
        return self.count("ERROR") > 0 or (strict and self.count("WARNING") > 0)

    def summary(self, files: int) -> str:
        kinds = ", ".join(f"{self.objects[kind]} {_plural(kind)}" for kind in KINDS)
        if self.objects[QUOTA_KIND]:
            kinds += f", {self.objects[QUOTA_KIND]} {_plural(QUOTA_KIND)}"
        profiles = ", ".join(self.profiles) or "none"
        levels = ", ".join(
            f"{self.count(level)} {word}"
            for level, word in zip(LEVELS, ("errors", "warnings", "infos"), strict=True)
        )
        return (
            f"{files} files: {kinds}; {self.devices} devices of {len(self.profiles)} "
            f"profiles ({profiles}); {levels}"
        )

    def to_json(self, files: int) -> dict[str, Any]:
        return {
            "findings": [finding.to_json() for finding in self.findings],
            "classes": [result.to_json() for result in self.classes],
            "summary": {
                "files": files,
                **{
                    _plural(kind[0].lower() + kind[1:]): self.objects[kind]
                    for kind in (*KINDS, QUOTA_KIND)
                },
                "profiles": self.profiles,
                "devices": self.devices,
                "errors": self.count("ERROR"),
                "warnings": self.count("WARNING"),
                "infos": self.count("INFO"),
            },
        }


# ---- the objects -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _SelectorSite:
    path: str
    """``spec.selectors[0].cel.expression``."""
    expression: str


@dataclass(frozen=True)
class _Request:
    path: str
    """``spec.devices.requests[0].exactly`` / ``...firstAvailable[1]``."""
    class_name: str | None
    selectors: tuple[_SelectorSite, ...]
    complete: bool
    """Every selector was well formed."""
    capacity: frozenset[str] = frozenset()
    """The capacities ``capacity.requests`` names (bare names)."""


@dataclass
class _Object:
    file: str
    kind: str
    name: str
    selectors: tuple[_SelectorSite, ...] = ()
    requests: tuple[_Request, ...] = ()
    complete: bool = True
    extended_resource: str | None = None
    """A DeviceClass's ``spec.extendedResourceName``."""

    @property
    def label(self) -> str:
        return f"{self.kind}/{self.name}"


class _Linter:
    def __init__(
        self,
        devices: Sequence[SimulatedDevice],
        *,
        driver: str,
        published: PublishedNames,
    ) -> None:
        self.driver = driver
        self.devices = list(devices)
        self.cel_devices = [to_cel_device(driver, device.device) for device in self.devices]
        self.published = published | PublishedNames.of(self.cel_devices)
        self.findings: list[Finding] = []
        self._compiled: dict[str, Selector | CelCompileError] = {}
        self.names = _names(driver, self.published, self.cel_devices)
        self._taught: set[tuple[str, str, str]] = set()  # (file, object, path) given a fix

    def add(
        self,
        level: Level,
        obj: _Object,
        message: str,
        path: str = "",
        suggestion: Suggestion | None = None,
    ) -> None:
        self.findings.append(Finding(level, obj.file, obj.label, message, path, suggestion))

    def teach(
        self, obj: _Object, site: _SelectorSite, candidates: Sequence[int], scope: str
    ) -> Suggestion | None:
        """The fix of `site`'s common mistakes, linted, once per site; None when there is no
        fix or it does not lint clean (compiles, reads only published names)."""
        key = (obj.file, obj.label, site.path)
        if key in self._taught:
            return None
        fix = suggest_fix(site.expression, self.names)
        if fix is None:
            return None
        try:
            selector = compile_selector(fix.expression)
        except CelCompileError:
            return None
        if any(level == "ERROR" for level, _ in self.check_names(fix.expression)):
            return None
        selected, errors = [], 0
        for index in candidates:
            try:
                if selector.matches(self.cel_devices[index]):
                    selected.append(index)
            except CelRuntimeError:
                errors += 1
        self._taught.add(key)
        return Suggestion(
            fix.expression,
            fix.reasons,
            len(selected),
            len(candidates),
            self.products(selected),
            errors,
            scope,
        )

    # -- reading the manifests

    def objects(self, sources: Sequence[Source]) -> list[_Object]:
        found: list[_Object] = []
        for source in sources:
            for manifest in source.documents:
                obj = self._read(source.file, manifest)
                if obj is not None:
                    found.append(obj)
        return found

    def _read(self, file: str, manifest: Mapping[str, Any]) -> _Object | None:
        kind, api_version = manifest.get("kind"), manifest.get("apiVersion")
        if not (
            kind in KINDS
            and isinstance(api_version, str)
            and api_version.startswith(f"{API_GROUP}/")
        ):
            return None
        metadata = manifest.get("metadata")
        name = metadata.get("name") if isinstance(metadata, Mapping) else None
        obj = _Object(file, str(kind), name if isinstance(name, str) and name else "<unnamed>")
        if kind == DEVICE_CLASS:
            spec = self._mapping(obj, manifest, "spec", "spec")
            if spec is not None:
                obj.selectors, complete = self._selectors(obj, spec, "spec")
                obj.complete = obj.complete and complete
                extended = spec.get("extendedResourceName")
                obj.extended_resource = extended if isinstance(extended, str) else None
        else:
            obj.requests = self._requests(obj, manifest, _REQUESTS_PATH[obj.kind])
        self._near_miss_drivers(obj, manifest)
        return obj

    def _near_miss_drivers(self, obj: _Object, manifest: Mapping[str, Any]) -> None:
        """ERROR for each config entry that is this driver's config under a misspelt driver
        name (`near_miss_driver`): no driver applies it (`gpu-dra check-config` checks the
        rest of the configs)."""
        entries = config_list(obj.kind, manifest)
        if not isinstance(entries, list):
            return
        path = ".".join(CONFIG_LISTS[obj.kind][0])
        for index, entry in enumerate(entries):
            opaque = entry.get("opaque") if isinstance(entry, Mapping) else None
            if not isinstance(opaque, Mapping):
                continue
            message = near_miss_driver(opaque, driver=self.driver)
            if message is not None:
                self.add("ERROR", obj, message, f"{path}[{index}]")

    def _mapping(
        self, obj: _Object, parent: Mapping[str, Any], key: str, path: str
    ) -> Mapping[str, Any] | None:
        value = parent.get(key)
        if value is None or isinstance(value, Mapping):
            return value
        self.add("ERROR", obj, "expected an object", path)
        obj.complete = False
        return None

    def _list(self, obj: _Object, parent: Mapping[str, Any], key: str, path: str) -> list[Any]:
        value = parent.get(key)
        if value is None:
            return []
        if isinstance(value, list):
            return value
        self.add("ERROR", obj, "expected a list", path)
        obj.complete = False
        return []

    def _selectors(
        self, obj: _Object, parent: Mapping[str, Any], path: str
    ) -> tuple[tuple[_SelectorSite, ...], bool]:
        """The CEL selectors of `parent`, and whether all of them were well formed."""
        selectors = parent.get("selectors")
        if selectors is None:
            return (), True
        if not isinstance(selectors, list):
            self.add("ERROR", obj, "expected a list", f"{path}.selectors")
            return (), False
        sites = []
        complete = True
        for index, selector in enumerate(selectors):
            where = f"{path}.selectors[{index}]"
            cel = selector.get("cel") if isinstance(selector, Mapping) else None
            expression = cel.get("expression") if isinstance(cel, Mapping) else None
            if not isinstance(expression, str):
                self.add("ERROR", obj, "expected a selector with a cel.expression string", where)
                complete = False
                continue
            sites.append(_SelectorSite(f"{where}.cel.expression", expression))
        return tuple(sites), complete

    def _requests(
        self, obj: _Object, manifest: Mapping[str, Any], keys: tuple[str, ...]
    ) -> tuple[_Request, ...]:
        parent: Mapping[str, Any] | None = manifest
        for depth, key in enumerate(keys[:-1]):
            if parent is None:
                return ()
            parent = self._mapping(obj, parent, key, ".".join(keys[: depth + 1]))
        if parent is None:
            return ()
        path = ".".join(keys)
        requests = []
        for index, request in enumerate(self._list(obj, parent, keys[-1], path)):
            where = f"{path}[{index}]"
            if not isinstance(request, Mapping):
                self.add("ERROR", obj, "expected an object", where)
                obj.complete = False
                continue
            if "exactly" in request:
                exactly = self._mapping(obj, request, "exactly", f"{where}.exactly")
                if exactly is not None:
                    requests.append(self._request(obj, exactly, f"{where}.exactly"))
            elif "firstAvailable" in request:
                subrequests = self._list(obj, request, "firstAvailable", f"{where}.firstAvailable")
                for sub, subrequest in enumerate(subrequests):
                    sub_path = f"{where}.firstAvailable[{sub}]"
                    if isinstance(subrequest, Mapping):
                        requests.append(self._request(obj, subrequest, sub_path))
                    else:
                        self.add("ERROR", obj, "expected an object", sub_path)
                        obj.complete = False
            else:  # resource.k8s.io/v1beta1: the fields of `exactly` inline
                requests.append(self._request(obj, request, where))
        return tuple(requests)

    def _request(self, obj: _Object, request: Mapping[str, Any], path: str) -> _Request:
        selectors, complete = self._selectors(obj, request, path)
        class_name = request.get("deviceClassName")
        capacity = request.get("capacity")
        wanted = capacity.get("requests") if isinstance(capacity, Mapping) else None
        named = frozenset(
            str(key).rsplit("/", 1)[-1] for key in (wanted if isinstance(wanted, Mapping) else {})
        )
        return _Request(
            path, class_name if isinstance(class_name, str) else None, selectors, complete, named
        )

    # -- compiling and names

    def compile(
        self,
        obj: _Object,
        site: _SelectorSite,
        candidates: Sequence[int],
        scope: str = "",
    ) -> Selector | None:
        """`site` compiled, or None after reporting the compile error; name problems are
        reported too. The first error of the site carries the fix, judged on `candidates`."""
        if site.expression not in self._compiled:
            try:
                self._compiled[site.expression] = compile_selector(site.expression)
            except CelCompileError as error:
                self._compiled[site.expression] = error
        compiled = self._compiled[site.expression]
        if isinstance(compiled, CelCompileError):
            suggestion = self.teach(obj, site, candidates, scope)
            message = f"compile error: {compiled.first_line}"
            self.add("ERROR", obj, message, site.path, suggestion)
            return None
        for level, message in self.check_names(site.expression):
            suggestion = self.teach(obj, site, candidates, scope) if level == "ERROR" else None
            self.add(level, obj, message, site.path, suggestion)
        return compiled

    def check_names(self, expression: str) -> list[tuple[Level, str]]:
        problems: list[tuple[Level, str]] = []
        for reference in dict.fromkeys(selector_references(expression)):
            problem = self._check_reference(reference)
            if problem is not None:
                problems.append(problem)
        return problems

    def _check_reference(self, ref: Reference) -> tuple[Level, str] | None:
        published = self.published
        if (ref.domain, ref.name) in published.names(ref.kind):
            return None
        if ref.domain not in published.domains:
            close = difflib.get_close_matches(ref.domain, sorted(published.domains), n=1)
            if not close:
                return None  # another driver's domain: not ours to judge
            return "WARNING", (
                f"{ref}: gpu-dra publishes nothing in domain {ref.domain} (it reads as an "
                f"empty map); did you mean {close[0]}?"
            )
        word = _KIND_WORD[ref.kind]
        other: Kind = "capacity" if ref.kind == "attributes" else "attributes"
        head = f"{ref}: gpu-dra never publishes {word} {ref.name}"
        if (ref.domain, ref.name) in published.names(other):
            moved = Reference(other, ref.domain, ref.name)
            return "ERROR", f"{head}; {ref.name} is {_a(_KIND_WORD[other])}: {moved}"
        domains = sorted(d for d, n in published.names(ref.kind) if n == ref.name)
        if domains:
            moved = Reference(ref.kind, domains[0], ref.name)
            return "ERROR", f"{head}; it is in domain {domains[0]}: {moved}"
        where = _NVIDIA_ONLY.get((ref.kind, ref.name))
        if where is not None and ref.domain == self.driver:
            return "WARNING", (
                f"{head} (yet); NVIDIA's driver publishes it {where}, so no gpu-dra device has it"
            )
        suggestion = self._close_name(ref)
        if suggestion is not None:
            return "ERROR", f"{head}; did you mean {suggestion.name}: {suggestion}?"
        known = ", ".join(sorted(n for d, n in published.names(ref.kind) if d == ref.domain))
        return "ERROR", f"{head}; its {word} names in {ref.domain}: {known or 'none'}"

    def _close_name(self, ref: Reference) -> Reference | None:
        """The published name closest to `ref`'s: same kind and domain first, then any."""
        same = [
            Reference(ref.kind, d, n) for d, n in self.published.names(ref.kind) if d == ref.domain
        ]
        every = [
            Reference(kind, d, n)
            for kind in ("attributes", "capacity")
            for d, n in sorted(self.published.names(kind))
        ]
        for candidates in (same, every):
            by_name = {
                candidate.name.lower(): candidate for candidate in sorted(candidates, key=str)
            }
            close = difflib.get_close_matches(ref.name.lower(), list(by_name), n=1, cutoff=0.75)
            if close:
                return by_name[close[0]]
        return None

    # -- evaluating

    def evaluate(
        self,
        obj: _Object,
        sites: Sequence[tuple[_SelectorSite, Selector]],
        candidates: Sequence[int],
        what: str = "",
    ) -> tuple[list[int], bool]:
        """Indexes of the candidate devices every selector accepts, and whether one failed
        (a runtime error is reported once per selector, with the first device as example)."""
        selected: list[int] = []
        errors: dict[int, tuple[int, str, str]] = {}  # selector -> (count, example, message)
        for index in candidates:
            for number, (_, selector) in enumerate(sites):
                try:
                    matched = selector.matches(self.cel_devices[index])
                except CelRuntimeError as error:
                    count, example, message = errors.get(number, (0, "", str(error)))
                    errors[number] = (count + 1, example or str(self.devices[index]), message)
                    break
                if not matched:
                    break
            else:
                selected.append(index)
        for number, (count, example, message) in sorted(errors.items()):
            self.add(
                "ERROR",
                obj,
                f"CEL runtime error on {count} of {len(candidates)} devices{what}, e.g. "
                f"{example}: {message}",
                sites[number][0].path,
                self.teach(obj, sites[number][0], candidates, what),
            )
        return selected, bool(errors)

    def products(self, indexes: Sequence[int]) -> str:
        counts = Counter(self.devices[index].product for index in indexes)
        return ", ".join(f"{count}x {product}" for product, count in counts.items())


def lint(
    sources: Sequence[Source],
    devices: Sequence[SimulatedDevice],
    *,
    driver: str = DEFAULT_DRIVER_NAME,
    published: PublishedNames | None = None,
    unpublished: Sequence[SimulatedDevice] = (),
    mig_policy: str = "",
) -> LintReport:
    """Lint the DeviceClasses, ResourceClaims and ResourceClaimTemplates of `sources`.

    `devices` are what classes and requests are evaluated against; `published` (default: what
    `gpu_device` can publish) plus the names of `devices` are the names selectors may read.
    `unpublished` are the dynamic MIG partitions the profile policy `mig_policy` leaves out: a
    class that selects some of them but no partition of `devices` gets a warning.
    Raises `CelRuntimeError` if a device cannot be converted to a CEL value (a bad profile).
    """
    linter = _Linter(devices, driver=driver, published=published or publishable_names(driver))
    left_out = [(device, to_cel_device(driver, device.device)) for device in unpublished]
    objects = linter.objects(sources)
    classes: dict[str, tuple[_Object, ClassResult]] = {}
    results: list[ClassResult] = []
    everything = list(range(len(linter.devices)))
    for obj in objects:
        if obj.kind != DEVICE_CLASS:
            continue
        result = ClassResult(obj.file, obj.name)
        results.append(result)
        if obj.name in classes:
            first = classes[obj.name][0]
            linter.add(
                "WARNING",
                obj,
                f"{obj.label} is defined again (first in {first.file}); the last one applied wins",
            )
        classes[obj.name] = (obj, result)
        sites = [(site, linter.compile(obj, site, everything)) for site in obj.selectors]
        compiled = [(site, selector) for site, selector in sites if selector is not None]
        if len(compiled) < len(sites) or not obj.complete:
            continue
        indexes, result.failed = linter.evaluate(obj, compiled, everything)
        result.evaluated = True
        result.selected = [linter.devices[index] for index in indexes]
        profiles = ", ".join(dict.fromkeys(device.profile for device in linter.devices))
        if indexes:
            linter.add(
                "INFO",
                obj,
                f"selects {len(indexes)} of {len(everything)} devices: {linter.products(indexes)}",
            )
        elif not result.failed:
            linter.add(
                "WARNING",
                obj,
                f"selects no device of the simulated profiles ({profiles or 'none'})",
            )
        if left_out and not any(_is_partition(linter.devices[index]) for index in indexes):
            _warn_outside_policy(linter, obj, [s for _, s in compiled], left_out, mig_policy)
    _compare_classes(linter, [(obj, result) for obj, result in classes.values()])
    _warn_shared_extended_resources(linter, [obj for obj, _ in classes.values()])
    for obj in objects:
        if obj.kind != DEVICE_CLASS:
            _lint_claim(linter, obj, classes)
    quotas = _lint_quotas(linter, sources, classes)
    order = {(obj.file, obj.label): index for index, obj in enumerate([*objects, *quotas])}
    return LintReport(
        findings=sorted(linter.findings, key=lambda f: order.get((f.file, f.object), len(order))),
        classes=results,
        objects=Counter(obj.kind for obj in [*objects, *quotas]),
        profiles=list(dict.fromkeys(device.profile for device in devices)),
        devices=len(devices),
    )


def _lint_quotas(
    linter: _Linter, sources: Sequence[Source], classes: Mapping[str, tuple[_Object, ClassResult]]
) -> list[_Object]:
    """The holes each ResourceQuota of `sources` leaves over the linted classes (`lint_quota`);
    returns the quotas as objects."""
    linted = {
        name: LintedClass(name, result.keys if result.evaluated else None, obj.extended_resource)
        for name, (obj, result) in classes.items()
    }

    def missing(name: str) -> str:
        close = difflib.get_close_matches(name, sorted(classes), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"limits DeviceClass {name}, which is not among the linted files{hint}"

    found: list[_Object] = []
    for source in sources:
        for manifest in source.documents:
            quota = read_quota(manifest)
            if quota is None:
                continue
            obj = _Object(source.file, QUOTA_KIND, quota.name)
            found.append(obj)
            for level, message, path in quota_findings(quota, linted, missing):
                linter.add(level, obj, message, path)
    return found


def _is_partition(device: SimulatedDevice) -> bool:
    """A dynamic MIG partition (a MIG device consuming counters)."""
    return "-mig-" in device.device["name"] and bool(device.device.get("consumesCounters"))


def _warn_outside_policy(
    linter: _Linter,
    obj: _Object,
    selectors: Sequence[Selector],
    left_out: Sequence[tuple[SimulatedDevice, DraDevice]],
    mig_policy: str,
) -> None:
    """WARNING when the class selects dynamic MIG partitions only among those the policy does
    not publish: its claims would stay pending on nodes with dynamic MIG."""

    def matches(device: DraDevice) -> bool:
        try:
            return all(selector.matches(device) for selector in selectors)
        except CelRuntimeError:  # reported by the evaluation on the published devices
            return False

    hits = [device for device, converted in left_out if matches(converted)]
    if not hits:
        return
    profiles = sorted(
        {
            str(device.device["attributes"]["profile"].get("string"))
            for device in hits
            if "profile" in device.device.get("attributes", {})
        }
    )
    linter.add(
        "WARNING",
        obj,
        f"selects no dynamic MIG partition published with --dynamic-mig-profiles={mig_policy}, "
        f"only {len(hits)} it leaves out ({', '.join(profiles)}): its claims stay pending on "
        "nodes with --dynamic-mig unless the policy offers those profiles",
    )


def _compare_classes(linter: _Linter, classes: Sequence[tuple[_Object, ClassResult]]) -> None:
    """Identical selections (WARNING) and overlaps (INFO), reported on the later class. Two
    classes of which one adds conditions to all of the other's (``&&``) differ by design: where
    they select the same devices, the added conditions merely exclude none of the simulated ones
    (INFO)."""
    evaluated = [(obj, result) for obj, result in classes if result.evaluated and result.selected]
    for later, (obj, result) in enumerate(evaluated):
        mine = result.keys
        for other_obj, other in evaluated[:later]:
            theirs = other.keys
            both = len(mine & theirs)
            name = other_obj.label
            added = _added_conditions(obj, other_obj) or _added_conditions(other_obj, obj)
            if mine == theirs and added:
                narrower = obj.label if _added_conditions(obj, other_obj) else name
                linter.add(
                    "INFO",
                    obj,
                    f"selects the same {len(mine)} devices as {name} on the simulated profiles; "
                    f"{narrower} adds {' && '.join(added)}, which excludes none of them",
                )
            elif mine == theirs:
                linter.add(
                    "WARNING",
                    obj,
                    f"selects the same {len(mine)} devices as {name} on the simulated profiles",
                )
            elif mine < theirs:
                linter.add(
                    "INFO", obj, f"selects a subset of {name} ({both} of its {len(theirs)} devices)"
                )
            elif mine > theirs:
                linter.add(
                    "INFO",
                    obj,
                    f"selects a superset of {name} (its {both} devices and "
                    f"{len(mine) - both} more)",
                )
            elif both:
                linter.add("INFO", obj, f"overlaps {name}: {both} devices selected by both")


def _warn_shared_extended_resources(linter: _Linter, classes: Sequence[_Object]) -> None:
    """WARNING on each later class whose extendedResourceName an earlier class already has:
    the scheduler serves pods asking for that name from one class only."""
    first: dict[str, _Object] = {}
    for obj in classes:
        name = obj.extended_resource
        if name is None:
            continue
        if name not in first:
            first[name] = obj
            continue
        linter.add(
            "WARNING",
            obj,
            f"extendedResourceName {name} is also that of {first[name].label} "
            f"({first[name].file}): pods asking for {name} get devices of only one of them "
            "(the class created later); give each name to one class",
            "spec.extendedResourceName",
        )


def _lint_claim(
    linter: _Linter, obj: _Object, classes: Mapping[str, tuple[_Object, ClassResult]]
) -> None:
    for request in obj.requests:
        entry = classes.get(request.class_name or "")
        scope, candidates = "", list(range(len(linter.devices)))
        if entry is not None and entry[1].evaluated:
            keys = entry[1].keys
            scope = f" DeviceClass {request.class_name} selects"
            candidates = [i for i, device in enumerate(linter.devices) if device.key in keys]
        sites = [(site, linter.compile(obj, site, candidates, scope)) for site in request.selectors]
        compiled = [(site, selector) for site, selector in sites if selector is not None]
        if entry is None and request.class_name is not None:
            linter.add("WARNING", obj, _missing_class(request.class_name, classes), request.path)
        if len(compiled) < len(sites) or not request.complete or entry is None:
            continue
        if not entry[1].evaluated:
            continue
        if not candidates:
            linter.add(
                "WARNING",
                obj,
                f"no device can satisfy the request: DeviceClass {request.class_name} selects "
                "no device of the simulated profiles",
                request.path,
            )
            continue
        _note_unnamed_amounts(linter, obj, request, candidates)
        if not compiled:
            continue
        indexes, failed = linter.evaluate(
            obj, compiled, candidates, f" DeviceClass {request.class_name} selects"
        )
        if not indexes and not failed:
            linter.add(
                "WARNING",
                obj,
                f"the selectors reject all {len(candidates)} devices DeviceClass "
                f"{request.class_name} selects ({linter.products(candidates)})",
                request.path,
            )


def _added_conditions(narrower: _Object, wider: _Object) -> list[str]:
    """The conditions `narrower` adds to every condition of `wider` (both classes' selectors
    split at their top-level ``&&``, compared token by token), as written; empty unless it keeps
    them all and adds some."""
    mine, theirs = _conditions(narrower), _conditions(wider)
    if mine is None or theirs is None or not set(theirs) < set(mine):
        return []
    return [text for key, text in mine.items() if key not in theirs]


def _conditions(obj: _Object) -> dict[str, str] | None:
    """The conjuncts of all of `obj`'s selectors (which the scheduler ANDs): each one's tokens
    joined by one space -> its text; None when a selector does not tokenize."""
    conditions: dict[str, str] = {}
    for site in obj.selectors:
        try:
            found = tokens(site.expression)
        except LexError:
            return None
        parts: list[list[Token]] = [[]]
        depth = 0
        for token in found:
            if token.kind == "punct" and token.text in ("(", "[", "{"):
                depth += 1
            elif token.kind == "punct" and token.text in (")", "]", "}"):
                depth -= 1
            if depth == 0 and token.text in ("||", "?"):  # not a plain conjunction: one part
                parts = [list(found)]
                break
            if depth == 0 and token.text == "&&":
                parts.append([])
            else:
                parts[-1].append(token)
        for part in map(_unwrapped, parts):
            if part:
                text = site.expression[part[0].start : part[-1].end]
                conditions.setdefault(" ".join(token.text for token in part), text)
    return conditions


def _unwrapped(part: list[Token]) -> list[Token]:
    """`part` without parentheses around all of it: ``(a)`` is ``a``."""
    while len(part) >= 2 and part[0].text == "(" and part[-1].text == ")":
        depth = 0
        for index, token in enumerate(part):
            depth += {"(": 1, ")": -1}.get(token.text, 0) if token.kind == "punct" else 0
            if depth == 0 and index < len(part) - 1:
                return part  # (a) && (b): the first parenthesis closes before the end
        part = part[1:-1]
    return part


def _missing_class(name: str, classes: Mapping[str, object]) -> str:
    """Why a request's DeviceClass `name`, not among `classes`, is a warning, and the closest
    linted class name."""
    close = difflib.get_close_matches(name, sorted(classes), n=1)
    hint = (
        f"did you mean {close[0]}?"
        if close
        else "lint the claim with its class (e.g. deviceclasses/), or make sure the cluster has it"
    )
    return (
        f"DeviceClass {name} is not among the linted files; {hint} (a claim naming a class the "
        "cluster lacks stays pending); the request's selectors were compiled but not evaluated"
    )


def _note_unnamed_amounts(
    linter: _Linter, obj: _Object, request: _Request, candidates: Sequence[int]
) -> None:
    """INFO for each capacity of the shared devices the request's class selects that the request
    does not name: it consumes the request policy's default, an equal part of the device
    (``--mps-share-replicas``; docs/mps.md, "Offering GPUs as shares")."""
    parts: dict[str, set[int]] = {}
    for index in candidates:
        device = linter.devices[index].device
        if not device.get("allowMultipleAllocations"):
            continue
        for name, entry in device.get("capacity", {}).items():
            default = (entry.get("requestPolicy") or {}).get("default")
            if name in request.capacity or default is None:
                continue
            total, part = parse_quantity(str(entry["value"])), parse_quantity(str(default))
            parts.setdefault(name, set()).add(round(total / part) if part else 0)
    for name, fractions in sorted(parts.items()):
        shown = ", ".join("all" if n == 1 else f"1/{n}" for n in sorted(fractions))
        linter.add(
            "INFO",
            obj,
            f"names no {name}: on the shared devices DeviceClass {request.class_name} selects it "
            f"gets the request policy's default, {shown} of the device (the node's "
            "--mps-share-replicas; the simulated nodes use the default)",
            request.path,
        )


# ---- names read by a selector ------------------------------------------------------------------


def _names(driver: str, published: PublishedNames, devices: Sequence[DraDevice]) -> Names:
    """`published` with the value type of each attribute some device of `devices` has."""
    types: dict[tuple[str, str], ValueType | None] = dict.fromkeys(published.attributes)
    for device in devices:
        for domain, values in device.attributes.items():
            for name, value in values.items():
                types[(domain, name)] = _value_type(value)
    return Names(driver, types, published.capacity)


def _value_type(value: object) -> ValueType:
    if isinstance(value, Semver):
        return "version"
    if isinstance(value, bool):
        return "bool"
    return "int" if isinstance(value, int) else "string"


def selector_references(expression: str) -> list[Reference]:
    """The ``device.attributes`` / ``device.capacity`` names `expression` reads, in order.

    Recognised: ``device.<kind>[D].x``, ``[D]['x']``, ``[D].?x``, ``[?D]...``, the field form
    ``device.<kind>.d.x`` (domains without dots), ``'x' in device.<kind>[D]``, and the same
    through an alias of ``cel.bind(a, device.<kind>[D], ...)``. D and 'x' must be plain string
    literals. A text that does not tokenize yields nothing (the compiler reports it).
    """
    try:
        found = tokens(expression)
    except LexError:
        return []
    references: list[Reference] = []
    aliases: list[tuple[str, Kind, str, int, int]] = []  # name, kind, domain, from, to
    for i in range(len(found)):
        if not _is_root(found, i, "device") or _text(found, i + 1) != ".":
            continue
        kind_text = _text(found, i + 2)
        if kind_text not in ("attributes", "capacity"):
            continue
        kind: Kind = "attributes" if kind_text == "attributes" else "capacity"
        domain, after = _domain(found, i + 3)
        if domain is None:
            continue
        references.extend(_member_or_in(found, i, after, kind, domain))
        alias = _bind_alias(found, i, after)
        if alias is not None:
            aliases.append((alias[0], kind, domain, after, alias[1]))
    for name, kind, domain, start, end in aliases:
        for k in range(start, end):
            if _is_root(found, k, name):
                references.extend(_member_or_in(found, k, k + 1, kind, domain))
    return references


def _text(found: Sequence[Token], index: int) -> str:
    return found[index].text if 0 <= index < len(found) else ""


def _is_root(found: Sequence[Token], index: int, name: str) -> bool:
    token = found[index]
    return token.kind == "ident" and token.text == name and _text(found, index - 1) != "."


def _string(found: Sequence[Token], index: int) -> str | None:
    if not 0 <= index < len(found) or found[index].kind != "string":
        return None
    match = _SIMPLE_STRING.fullmatch(found[index].text)
    if match is None:
        return None
    return match[1] if match[1] is not None else match[2]


def _domain(found: Sequence[Token], index: int) -> tuple[str | None, int]:
    """The domain selected at `index` (``[D]``, ``[?D]``, ``.d``) and the index after it."""
    if _text(found, index) == "[":
        optional = _text(found, index + 1) == "?"
        literal = index + 1 + optional
        if _text(found, literal + 1) == "]":
            return _string(found, literal), literal + 2
        return None, index
    if (
        _text(found, index) == "."
        and 0 <= index + 1 < len(found)
        and found[index + 1].kind == "ident"
    ):
        return found[index + 1].text, index + 2
    return None, index


def _member_or_in(
    found: Sequence[Token], start: int, after: int, kind: Kind, domain: str
) -> Iterator[Reference]:
    """The name read from the domain map ending before `after`: ``.x``, ``.?x``, ``['x']`` after
    it, or ``'x' in`` before the expression starting at `start`."""
    if _text(found, after) == "." and 0 <= after + 1 < len(found):
        nxt = after + 1 + (_text(found, after + 1) == "?")
        if 0 <= nxt < len(found) and found[nxt].kind == "ident" and _text(found, nxt + 1) != "(":
            yield Reference(kind, domain, found[nxt].text)
        return
    if _text(found, after) == "[":
        literal = after + 1 + (_text(found, after + 1) == "?")
        name = _string(found, literal)
        if name is not None and _text(found, literal + 1) == "]":
            yield Reference(kind, domain, name)
        return
    if _text(found, start - 1) == "in":
        name = _string(found, start - 2)
        if name is not None:
            yield Reference(kind, domain, name)


def _bind_alias(found: Sequence[Token], start: int, after: int) -> tuple[str, int] | None:
    """For ``cel.bind(a, <map from start to after>, body)``: ``a`` and the index of the closing
    parenthesis of the call."""
    open_index = start - 3  # cel . bind ( a , <start>
    if open_index < 3 or _text(found, after) != ",":
        return None
    if not (
        [_text(found, k) for k in range(open_index - 3, open_index + 1)]
        == ["cel", ".", "bind", "("]
        and found[open_index + 1].kind == "ident"
        and _text(found, open_index + 2) == ","
    ):
        return None
    depth = 0
    for k in range(open_index, len(found)):
        if found[k].kind == "punct":
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(found[k].text, 0)
        if depth == 0:
            return found[open_index + 1].text, k
    return None


def _plural(kind: str) -> str:
    return f"{kind}es" if kind.endswith("s") else f"{kind}s"


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


# ---- the command --------------------------------------------------------------------------------

MPS_SHARES_VARIANT: Final = "+mps-shares"
"""Suffix of the profile name under which `gpu-dra lint` evaluates a machine's whole GPUs and
static MIG devices as they are published when offered as MPS shares (``--mps-shares=all``,
``--mps-shares-on-mig=all``)."""

CAPPED_SHARES_VARIANT: Final = "+capped-shares"
"""The same for GPUs offered as capped time-sliced shares (``--capped-shares=all``, on a node
whose driver enforces the memory cap)."""

DYNAMIC_MIG_VARIANT: Final = "+dynamic-mig"
"""Suffix of the profile name under which `gpu-dra lint` evaluates a machine's partitionable
GPUs as they are published with ``--dynamic-mig`` (the whole GPU and every MIG placement of the
profiles ``--dynamic-mig-profiles`` offers)."""

_LINT_NODE: Final = "lint-node"  # seeds the simulated UUIDs, which no selector should read


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="YAML manifest file (several documents and List objects allowed), directory (its "
        f"*.yaml and *.yml files) or {STDIN} for standard input",
    )
    parser.add_argument(
        "--profile",
        action="append",
        metavar="PROFILE",
        help="evaluate on this simulated machine only: a built-in name (see `gpu-dra profiles`) "
        "or the path of a .json/.yaml profile file; repeatable (default: every built-in profile)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="warnings fail the lint too (exit status 1)"
    )
    add_env_argument(
        parser,
        environ,
        "--dynamic-mig-profiles",
        env=("GPU_DRA_DYNAMIC_MIG_PROFILES",),
        metavar="POLICY",
        help="the kubelet plugin's MIG profile policy: the +dynamic-mig variants publish only "
        "its profiles, and a class selecting only partitions outside it is a warning",
        default=DEFAULT_POLICY_TEXT,
    )
    add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver name: the domain of the published attributes and device.driver",
        default=DEFAULT_DRIVER_NAME,
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("text", "json", "yaml"),
        default="text",
        help="output format (default: text, one line per finding and a summary)",
    )


def run(args: argparse.Namespace, streams: Streams) -> int:
    try:
        policy = parse_policy(args.dynamic_mig_profiles)
    except MigPolicyError as error:
        raise CliError(f"--dynamic-mig-profiles: {error}", EXIT_USAGE) from error
    every_builtin = _lint_devices(builtin_profile_names(), variants=True, policy=EVERYTHING)
    devices = (
        _lint_devices(args.profile)
        if args.profile
        else _lint_devices(builtin_profile_names(), variants=True, policy=policy)
    )
    published_keys = {device.key for device in devices}
    unpublished = [
        device
        for device in every_builtin
        if device.profile.endswith(DYNAMIC_MIG_VARIANT)
        and _is_partition(device)
        and device.key not in published_keys
    ]
    sources: list[Source] = []
    unreadable: list[str] = []
    for path in args.paths:
        try:
            files = _lint_files(path)
        except CliError as error:
            print_error(streams, COMMAND, str(error))
            unreadable.append(str(error))
            continue
        for file in files:
            try:
                documents = load_documents(file, streams.stdin)
            except CliError as error:
                print_error(streams, COMMAND, str(error))
                unreadable.append(str(error))
                continue
            sources.append(Source(STDIN_LABEL if file == STDIN else file, documents))
    try:
        report = lint(
            sources,
            devices,
            driver=args.driver_name,
            published=_published(every_builtin, args.driver_name),
            unpublished=[] if args.profile else unpublished,
            mig_policy=str(policy),
        )
    except CelRuntimeError as error:
        raise CliError(f"a simulated device cannot be evaluated: {error}", EXIT_USAGE) from error
    _write_lint_report(streams, report, len(sources), unreadable, args.output)
    if unreadable:
        return EXIT_USAGE
    return EXIT_FAILED if report.failed(strict=args.strict) else EXIT_OK


def _lint_files(path: str) -> list[str]:
    """`path` itself, or the sorted *.yaml / *.yml files of a directory (CliError if none)."""
    if path == STDIN or not Path(path).is_dir():
        return [path]
    files = sorted(
        str(child)
        for child in Path(path).iterdir()
        if child.suffix in (".yaml", ".yml") and child.is_file()
    )
    if not files:
        raise CliError(f"no .yaml or .yml files in directory {path}", EXIT_USAGE)
    return files


def _lint_devices(
    profiles: Sequence[str], *, variants: bool = False, policy: MigPolicy = DEFAULT_MIG_POLICY
) -> list[SimulatedDevice]:
    """The published devices of each profile; with ``variants`` also, as profile
    ``<name>+mps-shares``, its whole GPUs and static MIG devices as published with
    ``--mps-shares=all --mps-shares-on-mig=all``, as ``<name>+capped-shares`` with
    ``--capped-shares=all``, and as
    ``<name>+dynamic-mig``, its partitionable GPUs' devices as published with ``--dynamic-mig``
    and `policy` (profiles without such GPUs add nothing)."""
    devices: list[SimulatedDevice] = []
    for spec in profiles:
        try:
            host = SimulatedHost.load(spec, _LINT_NODE)
        except ProfileError as error:
            raise CliError(str(error), EXIT_USAGE) from error
        try:
            published = plugin_devices(host.nvml, host.pci)
        except CliError as error:  # a profile with injected NVML faults
            raise CliError(f"simulated machine {spec}: {error}", EXIT_USAGE) from error
        devices.extend(SimulatedDevice(host.profile.name, device) for device in published)
        if not variants:
            continue
        shared = plugin_devices(host.nvml, host.pci, mps_shares=True)
        devices.extend(
            SimulatedDevice(f"{host.profile.name}{MPS_SHARES_VARIANT}", device)
            for device in shared
            if device.get("allowMultipleAllocations")
        )
        capped = plugin_devices(host.nvml, host.pci, capped_shares=True)
        devices.extend(
            SimulatedDevice(f"{host.profile.name}{CAPPED_SHARES_VARIANT}", device)
            for device in capped
            if device.get("allowMultipleAllocations")
        )
        partitioned = plugin_devices(host.nvml, host.pci, dynamic_mig=True, mig_policy=policy)
        devices.extend(
            SimulatedDevice(f"{host.profile.name}{DYNAMIC_MIG_VARIANT}", device)
            for device in partitioned
            if device.get("consumesCounters")
        )
    return devices


def _published(devices: Sequence[SimulatedDevice], driver: str) -> PublishedNames:
    """What gpu-dra publishes on any built-in profile, and can publish on any whole GPU."""
    converted = [to_cel_device(driver, device.device) for device in devices]
    return publishable_names(driver) | PublishedNames.of(converted)


def _write_lint_report(
    streams: Streams, report: LintReport, files: int, unreadable: Sequence[str], output: str
) -> None:
    if output != "text":
        data = report.to_json(files)
        data["unreadable"] = list(unreadable)
        write_data(streams, data, output)
        return
    for finding in report.findings:
        print(finding, file=streams.out)
    if not report.objects:
        print(
            "no DeviceClasses, ResourceClaims, ResourceClaimTemplates or ResourceQuotas found",
            file=streams.err,
        )
    summary = report.summary(files)
    if unreadable:
        summary += f"; {len(unreadable)} inputs unreadable"
    print(f"{PROG} lint: {summary}", file=streams.out)


COMMAND: Final = Subcommand(
    name="lint",
    summary="check the CEL selectors of DeviceClasses and claims on simulated GPUs",
    description="Compile every CEL selector of the DeviceClasses, ResourceClaims and\n"
    "ResourceClaimTemplates in the files, and evaluate each DeviceClass (and each claim\n"
    "request on the devices of its class) against every device of the simulated machines,\n"
    "as the scheduler evaluates them. One line per finding:\n"
    "  LEVEL <file> <kind>/<name>: [<path>: ]<message>\n"
    "ERROR: a compile error, a runtime error on some device (e.g. a missing attribute read\n"
    "without has()), an attribute or capacity gpu-dra never publishes (with a suggestion),\n"
    "a config of this driver's API under a misspelt driver name (did you mean ...?).\n"
    "For common mistakes (a name used as a domain, a quantity or version compared with a\n"
    "number or string) the first error says why and what to write instead, linted too.\n"
    "WARNING: a class selecting no device, two classes selecting the same devices, a name\n"
    "only NVIDIA's driver publishes (MIG), a claim's DeviceClass not among the files\n"
    "(with the closest one). INFO: what each class selects, overlaps.\n"
    "Exit status: 0 no errors (warnings allowed unless --strict), 1 errors (or warnings\n"
    "with --strict), 2 an input or profile cannot be read or parsed.",
    examples=(
        "gpu-dra lint deviceclasses/",
        "gpu-dra lint --strict --profile hgx-h100 --profile my-node.yaml classes/ claim.yaml",
        "kubectl get deviceclasses -o yaml | gpu-dra lint -o json -",
    ),
    add_arguments=add_arguments,
    run=run,
)
