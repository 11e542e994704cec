"""Two teams sharing the node by rule, in the demo (docs/quotas.md): the recipe's quotas
(deployments/quotas/research.yaml and training.yaml) applied as the docs say, with
``kubectl apply -n <team> -f``, to namespaces ``research`` and ``training`` on the last stage's
node. Training claims the three whole GPUs its quota allows and runs a pod on one; its fourth
claim is refused at creation with the quota's message. Research takes a notebook MIG slice within
quota; its claim through a class its quota does not name (``training.gpu.nvidia.com``) is
refused by the chart's tier-quota policy. The demo prints both refusals and each quota's use
(``kubectl describe resourcequota``). e2e/test_demo_examples.py asserts the output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from kubernetes.dynamic.exceptions import DynamicApiError

from e2e import manifests as m
from e2e.driver import Driver
from e2e.quotas import QUOTA, apply_tier_quota
from e2e.workloads import wait_running

TEAMS: Final = ("research", "training")
CLAIM_API: Final = "resource.k8s.io/v1"
TRAINING_CLAIMS: Final = 3
"""What training.yaml allows of gpu.nvidia.com."""
REFUSED_CLAIM: Final = ("training", f"trainer-{TRAINING_CLAIMS}")
BYPASS_CLAIM: Final = ("research", "through-training-class")
BYPASS_CLASS: Final = "training.gpu.nvidia.com"


@dataclass(frozen=True)
class Refusal:
    namespace: str
    claim: str
    message: str


def claim(name: str, namespace: str, device_class: str) -> dict[str, Any]:
    return m.claim(name, namespace, m.claim_spec([m.request(device_class=device_class)]))


def refused(driver: Driver, manifest: dict[str, Any]) -> Refusal:
    """The apiserver's refusal of `manifest`; RuntimeError if it was created."""
    metadata = manifest["metadata"]
    try:
        driver.kube.create(manifest)
    except DynamicApiError as error:
        if error.status != 403:
            raise
        message = json.loads(str(error.body))["message"]
        return Refusal(metadata["namespace"], metadata["name"], str(message))
    raise RuntimeError(f"{metadata['namespace']}/{metadata['name']} was not refused")


def reset_teams(driver: Driver) -> None:
    """Delete the teams' namespaces of an earlier run (and wait until they are gone)."""
    for team in TEAMS:
        driver.kube.delete("v1", "Namespace", team)
    for team in TEAMS:
        driver.kube.wait_gone("v1", "Namespace", team, None, timeout=180)


def show_quotas(driver: Driver, say: Callable[[str], None]) -> list[Refusal]:
    """The two teams, as the module docstring says; returns the refusals it printed."""
    cluster, kube = driver.cluster, driver.kube
    reset_teams(driver)
    for team in TEAMS:
        kube.create_namespace(team)
        say(f"==> kubectl apply -n {team} -f deployments/quotas/{team}.yaml")
        apply_tier_quota(cluster, kube, f"{team}.yaml", team)
    for index in range(TRAINING_CLAIMS):
        kube.create(claim(f"trainer-{index}", "training", "gpu.nvidia.com"))
    kube.create(m.gpu_pod("trainer-0", "training", claim="trainer-0"))
    kube.create(claim("notebook", "research", "mig-1g.gpu.nvidia.com"))
    wait_running(kube, "trainer-0", "training")
    say(f"==> training holds {TRAINING_CLAIMS} whole-GPU claims (its quota); trainer-0 runs on:")
    say("  " + kube.pod_log("trainer-0", "training").strip().replace("\n", "\n  "))
    refusals = [
        refused(driver, claim(REFUSED_CLAIM[1], REFUSED_CLAIM[0], "gpu.nvidia.com")),
        refused(driver, claim(BYPASS_CLAIM[1], BYPASS_CLAIM[0], BYPASS_CLASS)),
    ]
    say("==> over its quota, training's next whole GPU is refused at kubectl apply:")
    say(f"  {refusals[0].message}")
    say(f"==> research tries the same hardware through {BYPASS_CLASS}, which its quota does not "
        "name:")  # fmt: skip
    say(f"  {refusals[1].message}")
    for team in TEAMS:
        say(f"==> kubectl describe resourcequota {QUOTA} -n {team}")
        say(cluster.kubectl("describe", "resourcequota", QUOTA, "-n", team))
    return refusals
