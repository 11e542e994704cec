"""Health metrics from a running monitor on simulated NVML: every published device's health as
a label, its current problems with when they began, and the NVML events counted per GPU (XIDs by
number, ignored ones as such, recoveries), as a Prometheus scrape of the registry reads them."""

from __future__ import annotations

import asyncio

import pynvml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_dra.driver.health import HealthStatus
from gpu_dra.driver.nvml.simulated import SimulatedNvml
from gpu_dra.kubelet_plugin.device_health.metrics import DeviceHealthCollector, HealthEventMetrics
from tests.kubelet_plugin.test_device_health_monitor import NODE, NOW, XID, build, running, until

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def labelled(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def test_device_health_problems_and_xid_counts_reach_the_scrape() -> None:
    async def scenario() -> None:
        registry = CollectorRegistry()
        events = HealthEventMetrics(registry, NODE)
        node = build(observe_event=events.observe)
        registry.register(DeviceHealthCollector(NODE, node.monitor.snapshot))
        uuid = {gpu.index: gpu.uuid for gpu in node.inventory.gpus}
        async with running(node):
            health = labelled(scrape(registry), "gpu_dra_device_health")
            assert len(health) == len(node.monitor.snapshot()) == 8
            assert {dict(labels)["status"] for labels in health} == {"Healthy"}
            node.nvml.inject_event(1, XID, 13)  # an application error: ignored, still counted
            node.nvml.inject_event(1, XID, 13)
            node.nvml.inject_event(2, XID, 79)
            await until(lambda: node.health("gpu-2") is HealthStatus.UNHEALTHY, "gpu-2 down")
            samples = scrape(registry)
            health = labelled(samples, "gpu_dra_device_health")
            assert health[frozenset({("node", NODE), ("device", "gpu-2"),
                                     ("status", "Unhealthy")})] == 1  # fmt: skip
            assert sum(1 for labels in health if ("status", "Unhealthy") in labels) == 1
            problems = labelled(samples, "gpu_dra_device_problem_since_timestamp_seconds")
            assert problems == {
                frozenset({("node", NODE), ("device", "gpu-2"), ("key", "xid"), ("value", "79"),
                           ("severity", "lost")}): NOW.timestamp(),
            }  # fmt: skip
            counted = labelled(samples, "gpu_dra_health_events_total")
            assert counted == {
                frozenset({("node", NODE), ("gpu", uuid[1]), ("kind", "xid"), ("xid", "13"),
                           ("outcome", "ignored")}): 2,
                frozenset({("node", NODE), ("gpu", uuid[2]), ("kind", "xid"), ("xid", "79"),
                           ("outcome", "lost")}): 1,
            }  # fmt: skip
            node.nvml.recover_gpu(2)
            await until(lambda: node.health("gpu-2") is HealthStatus.HEALTHY, "gpu-2 back")
            samples = scrape(registry)
            assert labelled(samples, "gpu_dra_device_problem_since_timestamp_seconds") == {}
            recovered = frozenset({("node", NODE), ("gpu", uuid[2]), ("kind", "recovery"),
                                   ("xid", ""), ("outcome", "recovered")})  # fmt: skip
            assert labelled(samples, "gpu_dra_health_events_total")[recovered] == 1

    asyncio.run(scenario())


def test_an_unmonitored_device_is_unknown_in_the_metrics() -> None:
    def fail_registration(nvml: SimulatedNvml) -> None:
        nvml.set_fault("device_register_events", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=3)

    async def scenario() -> None:
        registry = CollectorRegistry()
        node = build(prepare=fail_registration)
        registry.register(DeviceHealthCollector(NODE, node.monitor.snapshot))
        async with running(node):
            await until(lambda: node.health("gpu-3") is HealthStatus.UNKNOWN, "gpu-3 unknown")
            samples = scrape(registry)
            health = labelled(samples, "gpu_dra_device_health")
            assert frozenset({("node", NODE), ("device", "gpu-3"), ("status", "Unknown")}) in health
            (problem,) = labelled(samples, "gpu_dra_device_problem_since_timestamp_seconds")
            assert ("severity", "unmonitored") in problem
            assert ("key", "unmonitored") in problem

    asyncio.run(scenario())
