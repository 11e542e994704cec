"""The chart's monitoring content queries only what the kubelet plugin exports: every metric name
in the Grafana dashboard (dashboards/gpu-dra.json, its panels and variables) and in the rendered
Prometheus rules is one the plugin's registry, built as its composition root builds it, holds
(or a recording rule of the same rules). See docs/metrics.md."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from gpu_dra.driver.nvml.simulated import SimulatedHost
from gpu_dra.kubelet_plugin.metrics import (
    DiscoveryMetrics,
    PluginMetrics,
    register_checkpoint_collectors,
)
from gpu_dra.kubelet_plugin.node_devices import NodeInventory
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.slices.metrics import SliceMetrics
from gpu_dra.kubelet_plugin.utilization.runtime import start_utilization
from tests.helmchart import CHART, Rendered

DASHBOARD = CHART / "dashboards" / "gpu-dra.json"
_KEYWORDS = frozenset(
    {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or"}
    | {"unless", "offset", "inf", "nan"}
)
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's ``$variables`` allowed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges
    text = _GROUPING.sub("", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        name, after = match.group(), text[match.end() :].lstrip()
        start = match.start()
        if after.startswith("(") or name.lower() in _KEYWORDS:
            continue  # a function or an operator
        if start and (text[start - 1].isdigit() or text[start - 1] in "$."):
            continue  # a number's exponent or unit, a variable
        names.add(name)
    return names


def plugin_metric_names(tmp_path: Path) -> set[str]:
    """The sample names of the plugin's registry, as `kubelet-plugin/__main__.py` fills it."""
    host = SimulatedHost.load("hgx-h100", "node-a")
    registry = CollectorRegistry()
    DiscoveryMetrics(registry, "node-a")
    register_checkpoint_collectors(registry, "node-a", dict)
    PluginMetrics(registry)
    SliceMetrics(registry)
    settings = KubeletPluginSettings.parse(
        ["--node-name=node-a", "--simulate=hgx-h100", f"--data-dir={tmp_path}"], env={}
    )
    inventory = NodeInventory((), simulated=True)
    monitor = start_utilization(
        settings, host.nvml, inventory, entries=dict, claims=lambda ns, name: None,
        registry=registry,
    )  # fmt: skip
    assert monitor is not None
    monitor.close()
    names = set()
    for family in registry.collect():
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(family.type, ("",))
        names.update(family.name + suffix for suffix in suffixes)
    return names


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            text = query["query"] if isinstance(query, dict) else query
            queries.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", text))
    return queries


def rendered_rules(tmp_path: Path, kind: str) -> list[dict[str, Any]]:
    values = {
        "gpuResourcesEnabledOverride": True,
        "metrics": {"rules": {"enabled": True, "kind": kind, "idleForSeconds": 3600}},
    }
    tmp_path.mkdir(exist_ok=True)
    rendered = Rendered.of(values, tmp_path)
    if kind == "PrometheusRule":
        groups = rendered.one("PrometheusRule")["spec"]["groups"]
    else:
        config = rendered.one("ConfigMap", "gpu-dra-rules")["data"]["gpu-dra.rules.yaml"]
        groups = yaml.safe_load(config)["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_the_extractor_finds_metrics_and_skips_functions_labels_and_variables() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, operation) (rate(gpu_dra_a_bucket{node=~"$node", '
        'x="y{z}"}[$__rate_interval]))) / on (node) group_left (tier) gpu_dra_b > 1e3 '
        "and time() - gpu_dra:c offset 5m"
    )
    assert promql_metric_names(expr) == {"gpu_dra_a_bucket", "gpu_dra_b", "gpu_dra:c"}


def test_every_dashboard_query_selects_metrics_the_plugin_exports(tmp_path: Path) -> None:
    exported = plugin_metric_names(tmp_path)
    queries = dashboard_queries()
    assert len(queries) >= 10
    for query in queries:
        names = promql_metric_names(query)
        assert names, f"no metric in {query!r}"
        assert names <= exported, f"{sorted(names - exported)} in {query!r} are not exported"


def test_the_dashboard_covers_allocation_utilization_shares_and_latency() -> None:
    used = set().union(*(promql_metric_names(q) for q in dashboard_queries()))
    assert {
        "gpu_dra_claim_devices",
        "gpu_dra_claim_gpu_utilization_percent",
        "gpu_dra_claim_compute_limit_percent",
        "gpu_dra_claim_memory_limit_bytes",
        "gpu_dra_kubelet_plugin_call_duration_seconds_bucket",
    } <= used


@pytest.mark.parametrize("kind", ["PrometheusRule", "ConfigMap"])
def test_every_rule_selects_exported_metrics_or_recorded_ones(tmp_path: Path, kind: str) -> None:
    exported = plugin_metric_names(tmp_path / "plugin")
    rules = rendered_rules(tmp_path / "chart", kind)
    recorded = {rule["record"] for rule in rules if "record" in rule}
    for rule in rules:
        names = promql_metric_names(rule["expr"])
        assert names, rule
        assert names <= exported | recorded, f"{sorted(names - exported - recorded)}: {rule}"
    (idle,) = [rule for rule in rules if rule.get("alert") == "GpuDraClaimIdle"]
    assert idle["expr"].endswith(">= 3600")
    assert "gpu_dra:claim_idle_seconds" in recorded


def test_the_dashboard_configmap_is_the_dashboard_file_and_rules_are_off_by_default(
    tmp_path: Path,
) -> None:
    rendered = Rendered.of({"gpuResourcesEnabledOverride": True}, tmp_path)
    config = rendered.one("ConfigMap", "gpu-dra-dashboard")
    assert config["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(config["data"]["gpu-dra.json"]) == json.loads(DASHBOARD.read_text())
    assert rendered.all("PrometheusRule") == []
    assert [c for c in rendered.all("ConfigMap") if c["metadata"]["name"] == "gpu-dra-rules"] == []


def test_the_utilization_values_reach_the_plugin(tmp_path: Path) -> None:
    values = {
        "gpuResourcesEnabledOverride": True,
        "metrics": {"utilization": {"interval": 2.5, "idleThreshold": 12}},
    }
    container = Rendered.of(values, tmp_path).container("DaemonSet", "gpus")
    env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    settings = KubeletPluginSettings.parse(["--node-name=n"], env)
    assert settings.utilization_interval_s == 2.5
    assert settings.utilization_idle_threshold == 12
