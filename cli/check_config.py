"""`gpu-dra check-config`: validate the opaque ``GpuConfig``/``MigDeviceConfig`` entries of
ResourceClaims, ResourceClaimTemplates and DeviceClasses before they are applied, with the messages
the kubelet plugin would put in pod events (`resolve_configs`, the plugin's own code path).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from gpu_dra.cli.command import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    STDIN,
    STDIN_LABEL,
    CliError,
    Streams,
    Subcommand,
    add_env_argument,
    print_error,
    write_data,
)
from gpu_dra.cli.manifests import load_documents
from gpu_dra.driver.config.objects import CONFIG_LISTS, Verdict, check_config_list
from gpu_dra.driver.naming import DEFAULT_DRIVER_NAME
from gpu_dra.driver.resourceapi import API_GROUP


@dataclass(frozen=True)
class ConfigCheck:
    """The verdict on one config entry (or on a config list that is not a list)."""

    file: str
    object: str
    """``<kind>/<name>``."""
    path: str
    """``spec.devices.config[0]``."""
    verdict: Verdict
    message: str = ""

    def __str__(self) -> str:
        line = f"{self.verdict} {self.file} {self.object} {self.path}"
        return f"{line}: {self.message}" if self.message else line

    def to_json(self) -> dict[str, str]:
        return {
            "verdict": self.verdict,
            "file": self.file,
            "object": self.object,
            "path": self.path,
            "message": self.message,
        }


def add_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    parser.add_argument(
        "files",
        nargs="+",
        metavar="FILE",
        help=f"YAML manifest file, may hold several documents and List objects; {STDIN} reads "
        "standard input",
    )
    add_env_argument(
        parser,
        environ,
        "--driver-name",
        env=("GPU_DRA_DRIVER_NAME",),
        metavar="NAME",
        help="DRA driver name whose opaque configs are checked; others are skipped",
        default=DEFAULT_DRIVER_NAME,
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("text", "json", "yaml"),
        default="text",
        help="output format (default: text, one line per entry)",
    )


def run(args: argparse.Namespace, streams: Streams) -> int:
    checks: list[ConfigCheck] = []
    unreadable: list[str] = []
    for file in args.files:
        try:
            documents = load_documents(file, streams.stdin)
        except CliError as error:
            print_error(streams, COMMAND, str(error))
            unreadable.append(str(error))
            continue
        label = STDIN_LABEL if file == STDIN else file
        for document in documents:
            checks.extend(check_object(label, document, driver=args.driver_name))
    if args.output == "text":
        for check in checks:
            print(check, file=streams.out)
    else:
        write_data(streams, _report(checks, unreadable), args.output)
    if unreadable:
        return EXIT_USAGE
    if not checks:
        print(
            "no config entries found in ResourceClaims, ResourceClaimTemplates or DeviceClasses",
            file=streams.err,
        )
    return EXIT_FAILED if any(check.verdict == "ERROR" for check in checks) else EXIT_OK


def _report(checks: list[ConfigCheck], unreadable: list[str]) -> dict[str, Any]:
    """The ``-o json|yaml`` document: every entry's verdict, counts, the unreadable inputs."""
    count = {verdict: sum(c.verdict == verdict for c in checks) for verdict in ("OK", "ERROR")}
    return {
        "checks": [check.to_json() for check in checks],
        "summary": {
            "ok": count["OK"],
            "errors": count["ERROR"],
            "skipped": sum(check.verdict == "SKIP" for check in checks),
        },
        "unreadable": unreadable,
    }


def check_object(file: str, manifest: Mapping[str, Any], *, driver: str) -> list[ConfigCheck]:
    """The verdict on each config entry of a manifest (other kinds have none): the admission
    webhook's and the kubelet plugin's check (`driver.config.objects`), located in `file`."""
    kind = manifest.get("kind")
    api_version = manifest.get("apiVersion")
    if not (
        isinstance(kind, str)
        and kind in CONFIG_LISTS
        and isinstance(api_version, str)
        and api_version.startswith(f"{API_GROUP}/")
    ):
        return []
    metadata = manifest.get("metadata")
    name = metadata.get("name") if isinstance(metadata, Mapping) else None
    label = f"{kind}/{name or '<unnamed>'}"
    return [
        ConfigCheck(file, label, check.path, check.verdict, check.message)
        for check in check_config_list(kind, manifest, driver=driver)
    ]


COMMAND: Final = Subcommand(
    name="check-config",
    summary="validate the opaque GPU configs of claims, templates and DeviceClasses",
    description="Check every config entry of the ResourceClaims (spec.devices.config),\n"
    "ResourceClaimTemplates (spec.spec.devices.config) and DeviceClasses (spec.config)\n"
    "in the files, with the messages the kubelet plugin would put in pod events.\n"
    "One line per entry:\n"
    "  OK <file> <kind>/<name> <path>\n"
    "  ERROR <file> <kind>/<name> <path>: <message>\n"
    "  SKIP <file> <kind>/<name> <path>: <why>      (an entry for another driver)\n"
    "Entries that are not opaque are errors: the driver cannot tell whom they are for.\n"
    "So is this driver's config (resource.nvidia.com GpuConfig, MigDeviceConfig) under a\n"
    'misspelt driver name (gpu.nvidai.com): "did you mean gpu.nvidia.com?".\n'
    "Other objects are ignored. With -o json|yaml: {checks: [{verdict, file, object,\n"
    "path, message}], summary: {ok, errors, skipped}, unreadable: [...]}.\n"
    "Exit status: 0 all entries OK, 1 some entry has an error, 2 a file cannot be read\n"
    "or parsed.",
    examples=(
        "gpu-dra check-config claim.yaml deviceclasses/*.yaml",
        "kubectl kustomize overlays/prod | gpu-dra check-config -",
        "gpu-dra check-config -o json claim.yaml | jq '.checks[] | select(.verdict == \"ERROR\")'",
    ),
    add_arguments=add_arguments,
    run=run,
)
