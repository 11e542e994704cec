"""The quota recipe on the e2e cluster (docs/quotas.md): a team's quota applied as the page
says, ``kubectl apply -n <team> -f deployments/quotas/<team>.yaml``, then waited for until the
quota controller counts it and the chart's tier-quota policy governs the namespace. Used by
e2e/test_tier_quota.py and the demo (demo/quotas.py)."""

from __future__ import annotations

from typing import Final

from kubernetes.dynamic.exceptions import DynamicApiError

from e2e import manifests as m
from e2e.cluster import Cluster
from e2e.cluster.paths import REPO_ROOT
from e2e.kube import Kube, wait_for

QUOTAS: Final = REPO_ROOT / "deployments" / "quotas"
QUOTA: Final = "gpu-tiers"
"""The name of the recipe's quotas."""
PROBE_CLASS: Final = "policy-probe.gpu-dra.example"
"""A class no quota names: a dry-run claim of it is refused once the policy governs."""


def apply_tier_quota(cluster: Cluster, kube: Kube, team_file: str, namespace: str) -> None:
    """Apply ``deployments/quotas/<team_file>`` to `namespace`; return once the quota is
    counted (``status.used``) and the tier-quota policy refuses a dry-run claim of a class the
    quota does not name (the apiserver's policy informer has seen the quota)."""
    cluster.kubectl("apply", "-n", namespace, "-f", str(QUOTAS / team_file))
    wait_for(
        f"quota {QUOTA} of {namespace} to be counted",
        lambda: "used" in kube.get("v1", "ResourceQuota", QUOTA, namespace).get("status", {}),
        60,
    )
    probe = m.claim("policy-probe", namespace, m.claim_spec([m.request(device_class=PROBE_CLASS)]))

    def enforced() -> bool:
        try:
            kube.create(probe, dry_run=True)
        except DynamicApiError as error:
            return bool(error.status == 403)
        return False

    wait_for(f"the tier-quota policy to govern {namespace}", enforced, 30)
