"""The reference docs cover what the code defines: the flag tables of docs/config.md list exactly
the flags of both processes' and the `gpu-dra` commands' argparse parsers (with the environment
twins), docs/deviceclasses.md every DeviceClass of deviceclasses/, docs/mps.md the MPS mounts every
share's container gets (the container contract and the hostile-tenant table rest on them), and
every relative link in docs/*.md and README.md resolves (file, and heading anchor).

Settings are read from the code (the parsers themselves, the controller's `ControllerSettings`
options, the kubelet plugin's `--help` checked against `KubeletPluginSettings` fields), never
listed here.
"""

from __future__ import annotations

import argparse
import re
import tomllib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpu_dra.cli.__main__ import build_parser as cli_parser
from gpu_dra.controller.settings import ControllerSettings, build_parser, options
from gpu_dra.kubelet_plugin.mps.daemon_model import DaemonPaths
from gpu_dra.kubelet_plugin.mps.edits import workload_edits
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

REPO = Path(__file__).resolve().parents[1]
CONFIG_DOC = REPO / "docs" / "config.md"
DEVICECLASSES_DOC = REPO / "docs" / "deviceclasses.md"
DEVICECLASSES_DIR = REPO / "deviceclasses"
LINKED_DOCS = [*sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
PLUGIN_SECTION = "### `gpu-dra-kubelet-plugin`"
CONTROLLER_SECTION = "### `gpu-dra-controller`"
CLI_SECTION = "### `gpu-dra`"
MPS_DOC = REPO / "docs" / "mps.md"
HOSTILE_TENANT_HEADING = "## What a hostile tenant can do today"

_OPTION_BLOCK = re.compile(r"^ {2}(--[a-z0-9-]+)(.*?)(?=^ {2}-|\Z)", re.MULTILINE | re.DOTALL)
_ENV_IN_HELP = re.compile(r"\benv\s+(GPU_DRA_[A-Z0-9_]+)")
_LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)[^)]*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_FLAG_IN_CELL = re.compile(r"`(--?[a-z0-9][a-z0-9-]*)`")
_CONTRACT_MOUNT = re.compile(
    r"^\| mount( \(MPS shares\))? \| `<data-dir>/mps/<id>/(\w+)` → `([^`]+)` \(`([^`]+)`\) \|$",
    re.MULTILINE,
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


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string a parser defines, `--help` left out."""
    return {flag for action in parser._actions for flag in action.option_strings} - {"-h", "--help"}


def plugin_parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser `KubeletPluginSettings.parse` builds, caught at its `parse_args`."""
    built: list[argparse.ArgumentParser] = []

    def caught(parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        built.append(parser)
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", caught)
    with pytest.raises(SystemExit):
        KubeletPluginSettings.parse([], env={})
    (parser,) = built
    return parser


def cli_command_flags() -> set[tuple[str, str]]:
    """(command, option string) of every `gpu-dra` subcommand."""
    (subparsers,) = [
        a for a in cli_parser({})._actions if isinstance(a, argparse._SubParsersAction)
    ]
    return {
        (name, flag)
        for name, parser in subparsers.choices.items()
        for flag in option_strings(parser)
    }


def flag_for_field(name: str) -> str:
    """`call_timeout_s` -> `--call-timeout`: how settings fields are spelled as flags."""
    return "--" + name.removesuffix("_s").replace("_", "-")


def device_classes() -> list[dict[str, Any]]:
    classes = []
    for path in sorted(DEVICECLASSES_DIR.glob("*.yaml")):
        classes.extend(doc for doc in yaml.safe_load_all(path.read_text()) if doc)
    return classes


def workload_mounts(*, share: bool) -> set[tuple[str, str, str]]:
    """`(daemon directory, container path, options)` of the MPS mounts of a share's container
    (``share``) or of a per-claim daemon's."""
    paths = DaemonPaths.of(Path("/data"), "daemon-0")
    return {
        (Path(mount.host_path).name, mount.container_path, ",".join(mount.options))
        for mount in workload_edits(paths, pipe_read_only=share).mounts
    }


# ---- checks on doc text (return what is missing, so they can be tested on broken text) ---------
def section(doc: str, heading: str) -> str:
    """The text under `heading` up to the next heading of its level or above."""
    start = doc.index(f"{heading}\n") + len(heading)
    level = heading.split(" ", 1)[0]
    end = re.search(rf"^#{{1,{len(level)}}} ", doc[start:], re.MULTILINE)
    return doc[start:] if end is None else doc[start : start + end.start()]


def table_rows(text: str) -> Iterator[list[str]]:
    """The cells of each table row (header and rule lines included) of `text`."""
    for line in text.splitlines():
        if line.startswith("|"):
            yield [cell.strip() for cell in line.strip().strip("|").split("|")]


def documented_flags(text: str) -> set[str]:
    """The option strings named in the first column of the tables of `text`."""
    return {flag for row in table_rows(text) for flag in _FLAG_IN_CELL.findall(row[0])}


def documented_command_flags(text: str) -> set[tuple[str, str]]:
    """(command, option string) of the `| `command` | `--flag`, ... |` rows of `text`."""
    return {
        (row[0].strip("`"), flag)
        for row in table_rows(text)
        if len(row) > 1
        for flag in _FLAG_IN_CELL.findall(row[1])
    }


def flag_differences(documented: set[Any], defined: set[Any]) -> list[str]:
    """What the doc lists that the parser lacks, and the other way round."""
    return [f"not in the parser: {item}" for item in sorted(documented - defined)] + [
        f"not in the doc: {item}" for item in sorted(defined - documented)
    ]


def heading_anchors(markdown: str) -> set[str]:
    """The anchors a renderer gives the headings (GitHub style: lower case, punctuation dropped,
    spaces as dashes, `-1`, `-2`, ... for repeats); headings in code blocks do not count."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(markdown, keep_code_spans=True):
        heading = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if heading is None:
            continue
        anchor = re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-")
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else f"{anchor}-{count}")
    return anchors


def prose_lines(markdown: str, *, keep_code_spans: bool = False) -> list[str]:
    """The lines of `markdown` with fenced blocks blanked (and, unless kept, inline code)."""
    lines: list[str] = []
    fenced = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            lines.append("")
        elif fenced:
            lines.append("")
        else:
            lines.append(line if keep_code_spans else re.sub(r"`[^`]*`", "``", line))
    return lines


def broken_links(doc: Path, text: str | None = None) -> list[str]:
    """Relative links of `doc` (its text, or `text`) whose file, or heading anchor in a Markdown
    file, does not exist; absolute URLs are not checked."""
    markdown = doc.read_text() if text is None else text
    problems = []
    for number, line in enumerate(prose_lines(markdown), start=1):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            where = f"{doc.relative_to(REPO)}:{number}: {target}"
            if not linked.exists():
                problems.append(f"{where}: no such file")
            elif anchor and linked.suffix == ".md":
                linked_text = markdown if linked == doc else linked.read_text()
                if anchor not in heading_anchors(linked_text):
                    problems.append(f"{where}: no such heading")
    return problems


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


def misstated_workload_mounts(
    doc: str, claim_mounts: set[tuple[str, str, str]], share_mounts: set[tuple[str, str, str]]
) -> list[str]:
    """Where docs/mps.md states the MPS mounts otherwise than ``claim_mounts`` (per-claim
    daemons) and ``share_mounts`` (MPS shares): the `| mount |` rows of the container contract
    (`| mount (MPS shares) |` rows replace those of the same directory for shares), and the
    paragraph that opens the hostile-tenant table (about shares)."""
    plain: dict[str, tuple[str, str, str]] = {}
    shares: dict[str, tuple[str, str, str]] = {}
    for kind, directory, path, mount_options in _CONTRACT_MOUNT.findall(doc):
        (shares if kind else plain)[directory] = (directory, path, mount_options)
    problems: list[str] = []
    for what, mounts, documented in (
        ("", claim_mounts, set(plain.values())),
        (" (MPS shares)", share_mounts, set({**plain, **shares}.values())),
    ):
        problems += [f"container contract{what} lacks {m}" for m in sorted(mounts - documented)]
        problems += [f"container contract{what} states {m}" for m in sorted(documented - mounts)]
    _, found, after = doc.partition(HOSTILE_TENANT_HEADING)
    if not found:
        return [*problems, f"no section {HOSTILE_TENANT_HEADING!r}"]
    opening = " ".join(after.split("\n|", 1)[0].split())
    for _, container_path, mount_options in sorted(share_mounts):
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


def test_config_doc_flag_tables_list_exactly_the_parsers_flags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    doc = CONFIG_DOC.read_text()

    assert (
        flag_differences(
            documented_flags(section(doc, PLUGIN_SECTION)),
            option_strings(plugin_parser(monkeypatch)),
        )
        == []
    )
    assert (
        flag_differences(
            documented_flags(section(doc, CONTROLLER_SECTION)), option_strings(build_parser({}))
        )
        == []
    )
    assert (
        flag_differences(documented_command_flags(section(doc, CLI_SECTION)), cli_command_flags())
        == []
    )


def test_every_relative_link_in_the_docs_and_readme_resolves() -> None:
    assert len(LINKED_DOCS) > 5
    assert [problem for doc in LINKED_DOCS for problem in broken_links(doc)] == []


def test_deviceclasses_doc_covers_every_class_file() -> None:
    classes = device_classes()

    assert len(classes) == len(list(DEVICECLASSES_DIR.glob("*.yaml")))
    assert undocumented_classes(DEVICECLASSES_DOC.read_text(), classes) == []


def test_mps_doc_states_the_mounts_a_share_container_gets() -> None:
    claims, shares = workload_mounts(share=False), workload_mounts(share=True)

    assert {(directory, path) for directory, path, _ in shares} == {
        ("pipe", "/tmp/nvidia-mps"),
        ("shm", "/dev/shm"),
    }
    assert ("pipe", "/tmp/nvidia-mps", "ro,nosuid,nodev,bind") in shares
    assert ("pipe", "/tmp/nvidia-mps", "rw,nosuid,nodev,bind") in claims
    assert misstated_workload_mounts(MPS_DOC.read_text(), claims, shares) == []


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


def test_a_stale_or_missing_flag_row_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    plugin = section(CONFIG_DOC.read_text(), PLUGIN_SECTION)
    stale = plugin.replace("| `--call-timeout` |", "| `--call-timeout-s` |")
    cli = section(CONFIG_DOC.read_text(), CLI_SECTION)
    without_strict = "\n".join(line for line in cli.splitlines() if "`--strict`" not in line)

    assert flag_differences(
        documented_flags(stale), option_strings(plugin_parser(monkeypatch))
    ) == ["not in the parser: --call-timeout-s", "not in the doc: --call-timeout"]
    assert flag_differences(documented_command_flags(without_strict), cli_command_flags()) == [
        "not in the doc: ('lint', '--strict')"
    ]


def test_a_link_to_a_missing_file_or_heading_is_reported() -> None:
    doc = REPO / "docs" / "architecture.md"
    text = (
        "See [config](config.md#gpu-dra), [gone](nowhere.md), [bad](mig.md#no-such-part),\n"
        "[here](#layers), [web](https://example.com/x.md) and `[code](not-a-link.md)`.\n"
        "## Layers\n"
    )

    assert broken_links(doc, text) == [
        "docs/architecture.md:1: nowhere.md: no such file",
        "docs/architecture.md:1: mig.md#no-such-part: no such heading",
    ]


def test_a_changed_mps_mount_option_is_reported() -> None:
    changed = "ro,nosuid,nodev,noexec,bind"
    shares = {
        (directory, path, changed if directory == "pipe" else mount_options)
        for directory, path, mount_options in workload_mounts(share=True)
    }

    problems = misstated_workload_mounts(MPS_DOC.read_text(), workload_mounts(share=False), shares)

    assert f"container contract (MPS shares) lacks {('pipe', '/tmp/nvidia-mps', changed)}" in (
        problems
    )
    assert f"hostile-tenant section does not state {changed}" in problems
    assert not any(p.startswith("container contract lacks") for p in problems)


def test_a_missing_hostile_tenant_section_is_reported() -> None:
    doc = MPS_DOC.read_text().replace(HOSTILE_TENANT_HEADING, "## Tenants")

    assert misstated_workload_mounts(
        doc, workload_mounts(share=False), workload_mounts(share=True)
    ) == [f"no section {HOSTILE_TENANT_HEADING!r}"]


def import_path_rows() -> dict[str, str]:
    """``{import path prefix: folder}`` of the table in docs/development.md."""
    text = (REPO / "docs" / "development.md").read_text()
    return dict(re.findall(r"^\| `(gpu_dra\.[a-z_]+)` \| `([a-z-]+)/` \|", text, re.MULTILINE))


def test_the_import_path_table_maps_exactly_the_package_dirs_of_pyproject() -> None:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())

    assert import_path_rows() == pyproject["tool"]["setuptools"]["package-dir"]
