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
from gpu_dra.kubelet_plugin.device_health.runtime import health_runtime
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
        ["--node-name=node-a", "--simulate=hgx-h100", f"--data-dir={tmp_path}",
         "--health-monitor=true"],
        env={},
    )  # fmt: skip
    inventory = NodeInventory((), simulated=True)
    monitor = start_utilization(
        settings, host.nvml, inventory, entries=dict, claims=lambda ns, name: None,
        registry=registry,
    )  # fmt: skip
    assert monitor is not None
    monitor.close()
    health = health_runtime(
        settings, host.nvml, inventory, supervisor=None, republish=lambda taints: None,
        registry=registry,
    )  # fmt: skip
    assert health is not None
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


# ---- scraped through the chart's ServiceMonitor -----------------------------------------------
# The Prometheus Operator turns a ServiceMonitor endpoint into a scrape config whose target
# labels are namespace, service, pod, container, endpoint, job and instance (of the Service's
# endpoint), then the endpoint's own `relabelings`; Prometheus then merges a scraped series'
# labels with the target's: with honor_labels false (the default) a scraped label of the same
# name is renamed exported_<name> and the target's is put in its place. Modelled here for the
# relabel actions the chart uses; another action fails the model (extend it, do not skip).

PLUGIN_NAMESPACE = "gpu-dra"
PLUGIN_POD = "gpu-dra-kubelet-plugin-x7k2p"
CLAIM_NAMESPACE = "default"
WORKLOAD_POD = "trainer-0"


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str]:
    labels = dict(labels)
    for config in configs:
        action = config.get("action", "replace").lower()
        regex = re.compile(f"^(?:{config.get('regex', '(.*)')})$")
        if action == "replace":
            value = config.get("separator", ";").join(
                labels.get(name, "") for name in config.get("sourceLabels", [])
            )
            match = regex.match(value)
            if match is None:
                continue
            replacement = match.expand(
                re.sub(r"\$\{?(\d+)\}?", r"\\\1", config.get("replacement", "$1"))
            )
            if replacement:
                labels[config["targetLabel"]] = replacement
            else:
                labels.pop(config["targetLabel"], None)
        elif action == "labeldrop":
            labels = {k: v for k, v in labels.items() if not regex.match(k)}
        elif action == "labelkeep":
            labels = {k: v for k, v in labels.items() if regex.match(k)}
        else:
            raise AssertionError(f"relabel action {action!r} is not modelled")
    return labels


def merged(series: dict[str, str], target: dict[str, str], honor_labels: bool) -> dict[str, str]:
    labels = {k: v for k, v in series.items() if v}
    for name, value in target.items():
        if name in labels and honor_labels:
            continue
        if name in labels:
            exported = f"exported_{name}"
            while exported in labels:
                exported = f"exported_{exported}"
            labels[exported] = labels[name]
        labels[name] = value
    return labels


def plugin_target(endpoint: dict[str, Any]) -> dict[str, str]:
    discovered = {
        "namespace": PLUGIN_NAMESPACE,
        "service": "gpu-dra-kubelet-plugin-metrics",
        "pod": PLUGIN_POD,
        "container": "gpus",
        "endpoint": endpoint["port"],
        "job": "gpu-dra-kubelet-plugin-metrics",
        "instance": "10.1.2.3:8081",
    }
    return relabel(discovered, endpoint.get("relabelings", []))


def plugin_series(tmp_path: Path) -> list[tuple[str, dict[str, str]]]:
    """A plugin registry with a sampled claim (namespace `CLAIM_NAMESPACE`, pod `WORKLOAD_POD`)
    and device health: (sample name, labels) of every series of one scrape."""
    from gpu_dra.driver.health import DeviceHealth  # noqa: PLC0415
    from gpu_dra.kubelet_plugin.device_health.metrics import (  # noqa: PLC0415
        DeviceHealthCollector,
        HealthEventMetrics,
    )
    from gpu_dra.kubelet_plugin.utilization.claims import PodRef  # noqa: PLC0415
    from tests.kubelet_plugin.nodes import UID_A, Node, hgx_h100_inventory, ok  # noqa: PLC0415
    from tests.kubelet_plugin.test_utilization import Sampling  # noqa: PLC0415

    node = Node(tmp_path / "node", hgx_h100_inventory())
    ok(node.prepare(node.add_gpus(UID_A, "train", "gpu-0"))[UID_A])
    sampling = Sampling(node, tmp_path / "proc", {"train": (PodRef("uid-t", WORKLOAD_POD),)})
    sampling.monitor.sample_once()
    registry = sampling.registry
    registry.register(DeviceHealthCollector("node-a", lambda: {"gpu-0": DeviceHealth()}))
    HealthEventMetrics(registry, "node-a").observe("GPU-0", 0x8, 48, None)
    return [(s.name, dict(s.labels)) for m in registry.collect() for s in m.samples]


def service_monitor_endpoint(tmp_path: Path) -> dict[str, Any]:
    values = {"gpuResourcesEnabledOverride": True, "metrics": {"serviceMonitor": {"enabled": True}}}
    tmp_path.mkdir(exist_ok=True)
    rendered = Rendered.of(values, tmp_path)
    monitor = rendered.one("ServiceMonitor", "gpu-dra-kubelet-plugin")
    (endpoint,) = monitor["spec"]["endpoints"]
    return dict(endpoint)


def test_claim_labels_survive_the_service_monitor(tmp_path: Path) -> None:
    endpoint = service_monitor_endpoint(tmp_path / "chart")
    target = plugin_target(endpoint)
    honor = bool(endpoint.get("honorLabels", False))
    stored = [(n, merged(labels, target, honor)) for n, labels in plugin_series(tmp_path)]
    claim = [labels for name, labels in stored if name == "gpu_dra_claim_devices"]
    assert claim
    assert all(labels["namespace"] == CLAIM_NAMESPACE for labels in claim)
    assert all(labels["plugin_pod"] == PLUGIN_POD for _, labels in stored)
    assert not [labels for _, labels in stored if any(k.startswith("exported_") for k in labels)]
    (pods,) = [labels for name, labels in stored if name == "gpu_dra_claim_pod_info"]
    assert (pods["namespace"], pods["claim"], pods["pod"]) == (
        CLAIM_NAMESPACE,
        "train",
        WORKLOAD_POD,
    )
    # The plugin's own series name no namespace: they get none, not the plugin's.
    health = [labels for name, labels in stored if name == "gpu_dra_device_health"]
    assert health
    assert all("namespace" not in labels and "pod" not in labels for labels in health)


def test_without_its_relabelings_the_claims_namespace_would_become_exported(
    tmp_path: Path,
) -> None:
    """The model's own check: the ServiceMonitor as shipped before (no relabelings) put the
    plugin's namespace over the claim's, as the Prometheus Operator does."""
    endpoint = service_monitor_endpoint(tmp_path / "chart")
    endpoint.pop("relabelings")
    stored = [
        (n, merged(labels, plugin_target(endpoint), False)) for n, labels in plugin_series(tmp_path)
    ]
    (claim,) = [labels for name, labels in stored if name == "gpu_dra_claim_devices"]
    assert (claim["namespace"], claim["exported_namespace"]) == (PLUGIN_NAMESPACE, CLAIM_NAMESPACE)


_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")


def promql_labels(expr: str) -> set[str]:
    """The label names an expression groups, joins or matches by."""
    names = {n.strip() for group in _LABEL_LISTS.findall(expr) for n in group.split(",")}
    names |= set(_MATCHERS.findall(expr))
    return {n for n in names if n and n not in {"le", "__name__"}}


def test_every_label_the_dashboard_and_rules_use_is_on_the_scraped_series(tmp_path: Path) -> None:
    endpoint = service_monitor_endpoint(tmp_path / "chart")
    target = plugin_target(endpoint)
    series = plugin_series(tmp_path / "plugin")
    labels_of: dict[str, set[str]] = {}
    for name, labels in series:
        labels_of.setdefault(name, set()).update(merged(labels, target, False))
    rules = rendered_rules(tmp_path / "rules", "PrometheusRule")
    recorded = {rule["record"]: rule["expr"] for rule in rules if "record" in rule}
    checked = 0
    for query in dashboard_queries() + [rule["expr"] for rule in rules]:
        names = promql_metric_names(query)
        sources = {source for n in names for source in promql_metric_names(recorded.get(n, n))}
        if not sources or not sources <= set(labels_of):
            continue  # a series this scrape has none of (latency histograms, errors)
        available = set().union(*(labels_of[n] for n in sources))
        missing = promql_labels(query) - available
        assert not missing, f"{sorted(missing)} of {query!r} are on no scraped series"
        checked += 1
    assert checked >= 8
