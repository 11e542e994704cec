"""The reference docs cover what the code defines: every flag and environment variable of both
processes in docs/config.md, every DeviceClass of deviceclasses/ in docs/deviceclasses.md, and
the MPS mounts every share's container gets in docs/mps.md (the container contract and the
hostile-tenant table rest on them).

Settings are read from the code (the controller's `ControllerSettings` options and parser, the
kubelet plugin's `--help` checked against `KubeletPluginSettings` fields), never listed here.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_dra.controller.settings import ControllerSettings, build_parser, options
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonPaths
from gpu_dra.kubelet_plugin.mps.edits import workload_edits
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

REPO = Path(__file__).resolve().parents[1]
CONFIG_DOC = REPO / "docs" / "config.md"
DEVICECLASSES_DOC = REPO / "docs" / "deviceclasses.md"
DEVICECLASSES_DIR = REPO / "deviceclasses"
MPS_DOC = REPO / "docs" / "mps.md"
HOSTILE_TENANT_HEADING = "## What a hostile tenant can do today"

_OPTION_BLOCK = re.compile(r"^ {2}(--[a-z0-9-]+)(.*?)(?=^ {2}-|\Z)", re.MULTILINE | re.DOTALL)
_ENV_IN_HELP = re.compile(r"\benv\s+(GPU_DRA_[A-Z0-9_]+)")
_CONTRACT_MOUNT = re.compile(
    r"^\| mount \| `<data-dir>/mps/<id>/(\w+)` → `([^`]+)` \(`([^`]+)`\) \|$", re.MULTILINE
)


# ---- what the code defines --------------------------------------------------------------------
def controller_settings() -> dict[str, str]:
    """`{flag: env}` of every ControllerSettings field."""
    return {option.flag: option.env for option in options().values()}


def controller_flags() -> set[str]:
    """Every option string of the controller's parser (`--once` also has `--no-once`)."""
    parser = build_parser({})
    return {flag for action in parser._actions for flag in action.option_strings} - {
        "-h",
        "--help",
    }


def plugin_help(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> str:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no token split by wrapping
    with pytest.raises(SystemExit) as exited:
        KubeletPluginSettings.parse(["--help"], env={})
    assert exited.value.code == 0
    return capsys.readouterr().out


def plugin_settings(help_text: str) -> dict[str, str | None]:
    """`{flag: env}` from the options section of the plugin's `--help`."""
    section = help_text.split("options:", 1)[1]
    settings: dict[str, str | None] = {}
    for match in _OPTION_BLOCK.finditer(section):
        env = _ENV_IN_HELP.search(match[2])
        settings[match[1]] = env[1] if env else None
    settings.pop("--help", None)
    return settings


def flag_for_field(name: str) -> str:
    """`call_timeout_s` -> `--call-timeout`: how settings fields are spelled as flags."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def device_classes() -> list[dict[str, Any]]:
    classes = []
    for path in sorted(DEVICECLASSES_DIR.glob("*.yaml")):
        classes.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return classes


def workload_mounts() -> set[tuple[str, str, str]]:
    """`(daemon directory, container path, options)` of the MPS mounts of a share's container."""
    paths = DaemonPaths.of(Path("/data"), "daemon-0")
    return {
        (Path(mount.host_path).name, mount.container_path, ",".join(mount.options))
        for mount in workload_edits(paths).mounts
    }


# ---- checks on doc text (return what is missing, so they can be tested on broken text) ---------
def undocumented_settings(doc: str, settings: dict[str, str]) -> list[str]:
    """Flags whose doc table row (a line starting with `|`) does not also name the env twin."""
    rows = [line for line in doc.splitlines() if line.lstrip().startswith("|")]
    return [
        f"{flag} / {env}"
        for flag, env in sorted(settings.items())
        if not any(f"`{flag}`" in row and f"`{env}`" in row for row in rows)
    ]


def unmentioned(doc: str, names: set[str]) -> list[str]:
    return sorted(name for name in names if f"`{name}`" not in doc)


def undocumented_classes(doc: str, classes: list[dict[str, Any]]) -> list[str]:
    """Classes without a `## \\`name\\`` heading, or whose CEL or extended resource name the doc
    does not show (compared with whitespace collapsed, so YAML line folding does not matter)."""
    headings = {line.strip() for line in doc.splitlines() if line.startswith("#")}
    flat_doc = " ".join(doc.split())
    problems = []
    for device_class in classes:
        name = device_class["metadata"]["name"]
        spec = device_class.get("spec") or {}
        if f"## `{name}`" not in headings:
            problems.append(f"{name}: no heading")
        for selector in spec.get("selectors", []):
            expression = " ".join(selector["cel"]["expression"].split())
            if expression not in flat_doc:
                problems.append(f"{name}: CEL not shown: {expression}")
        extended = spec.get("extendedResourceName")
        if extended and f"extendedResourceName: {extended}" not in flat_doc:
            problems.append(f"{name}: extendedResourceName {extended} not shown")
    return problems


def misstated_workload_mounts(doc: str, mounts: set[tuple[str, str, str]]) -> list[str]:
    """Where docs/mps.md states the MPS mounts otherwise than ``mounts``: the `| mount |` rows of
    the container contract, and the paragraph that opens the hostile-tenant table."""
    documented = set(_CONTRACT_MOUNT.findall(doc))
    problems = [f"container contract lacks {mount}" for mount in sorted(mounts - documented)]
    problems += [f"container contract states {mount}" for mount in sorted(documented - mounts)]
    _, found, after = doc.partition(HOSTILE_TENANT_HEADING)
    if not found:
        return [*problems, f"no section {HOSTILE_TENANT_HEADING!r}"]
    opening = " ".join(after.split("\n|", 1)[0].split())
    for _, container_path, mount_options in sorted(mounts):
        if f"`{container_path}`" not in opening:
            problems.append(f"hostile-tenant section does not name {container_path}")
        if f"`{mount_options}`" not in opening:
            problems.append(f"hostile-tenant section does not state {mount_options}")
    return problems


# ---- the settings are what the checks assume -----------------------------------------------
def test_every_plugin_settings_field_has_a_flag_with_an_env_twin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = plugin_settings(plugin_help(monkeypatch, capsys))

    assert set(settings) == {flag_for_field(f.name) for f in fields(KubeletPluginSettings)}
    assert all(settings.values()), settings


def test_every_controller_settings_field_has_a_flag_and_an_env_twin() -> None:
    settings = controller_settings()

    assert len(settings) == len(fields(ControllerSettings))
    assert all(flag.startswith("--") for flag in settings)
    assert all(env.startswith("GPU_DRA_") for env in settings.values())


# ---- the docs cover them ---------------------------------------------------------------------
def test_config_doc_lists_every_kubelet_plugin_flag_with_its_env_twin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = plugin_settings(plugin_help(monkeypatch, capsys))
    pairs = {flag: env for flag, env in settings.items() if env is not None}

    assert undocumented_settings(CONFIG_DOC.read_text(), pairs) == []


def test_config_doc_mentions_the_node_name_fallback_the_plugin_reads() -> None:
    settings = KubeletPluginSettings.parse([], env={"NODE_NAME": "node-from-downward-api"})

    assert settings.node_name == "node-from-downward-api"
    assert unmentioned(CONFIG_DOC.read_text(), {"NODE_NAME"}) == []


def test_config_doc_lists_every_controller_flag_with_its_env_twin() -> None:
    doc = CONFIG_DOC.read_text()

    assert undocumented_settings(doc, controller_settings()) == []
    assert unmentioned(doc, controller_flags()) == []


def test_deviceclasses_doc_covers_every_class_file() -> None:
    classes = device_classes()

    assert len(classes) == len(list(DEVICECLASSES_DIR.glob("*.yaml")))
    assert undocumented_classes(DEVICECLASSES_DOC.read_text(), classes) == []


def test_mps_doc_states_the_mounts_a_share_container_gets() -> None:
    mounts = workload_mounts()

    assert {(directory, path) for directory, path, _ in mounts} == {
        ("pipe", "/tmp/nvidia-mps"),
        ("shm", "/dev/shm"),
    }
    assert misstated_workload_mounts(MPS_DOC.read_text(), mounts) == []


# ---- the checks can fail ---------------------------------------------------------------------
def test_a_flag_missing_from_the_config_doc_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = plugin_settings(plugin_help(monkeypatch, capsys))
    pairs = {flag: env for flag, env in settings.items() if env is not None}
    doc = "\n".join(
        line for line in CONFIG_DOC.read_text().splitlines() if "`--call-timeout`" not in line
    )

    assert undocumented_settings(doc, pairs) == ["--call-timeout / GPU_DRA_CALL_TIMEOUT"]


def test_a_row_naming_the_wrong_env_twin_is_reported() -> None:
    doc = CONFIG_DOC.read_text().replace("`GPU_DRA_METRICS_PORT`", "`GPU_DRA_METRICS`")

    assert undocumented_settings(doc, controller_settings()) == [
        "--metrics-port / GPU_DRA_METRICS_PORT"
    ]


def test_a_class_missing_from_the_deviceclasses_doc_or_a_changed_cel_is_reported() -> None:
    classes = device_classes()
    doc = DEVICECLASSES_DOC.read_text().replace("## `hopper.gpu.nvidia.com`", "## Hopper")
    doc = doc.replace("quantity('40Gi')) >= 0", "quantity('32Gi')) >= 0")

    problems = undocumented_classes(doc, classes)

    assert "hopper.gpu.nvidia.com: no heading" in problems
    assert any(p.startswith("large-memory.gpu.nvidia.com: CEL not shown") for p in problems)


def test_a_changed_mps_mount_option_is_reported() -> None:
    read_only = {
        (directory, path, "ro,nosuid,nodev,bind" if directory == "pipe" else mount_options)
        for directory, path, mount_options in workload_mounts()
    }

    problems = misstated_workload_mounts(MPS_DOC.read_text(), read_only)

    pipe_read_only = ("pipe", "/tmp/nvidia-mps", "ro,nosuid,nodev,bind")
    assert f"container contract lacks {pipe_read_only}" in problems
    assert "hostile-tenant section does not state ro,nosuid,nodev,bind" in problems


def test_a_missing_hostile_tenant_section_is_reported() -> None:
    doc = MPS_DOC.read_text().replace(HOSTILE_TENANT_HEADING, "## Tenants")

    assert misstated_workload_mounts(doc, workload_mounts()) == [
        f"no section {HOSTILE_TENANT_HEADING!r}"
    ]
