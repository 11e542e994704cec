"""The names of a namespace's tier quota (docs/quotas.md), shared by the chart's tier-quota
policy, the controller's share-memory check, `gpu-dra lint` and `gpu-dra explain`.

The tier quota is the namespace's ResourceQuota labelled ``gpu.nvidia.com/tier-quota: "true"``;
Kubernetes counts the devices of each DeviceClass it names (``<class>.deviceclass.resource.k8s.io
/devices``) and the extended resources (``requests.<name>``); gpu-dra enforces its share-memory
line itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

TIER_QUOTA_LABEL: Final = "gpu.nvidia.com/tier-quota"
"""The label (value ``"true"``) that makes a ResourceQuota its namespace's tier quota."""
TIER_QUOTA_SELECTOR: Final = f"{TIER_QUOTA_LABEL}=true"
CLASS_SUFFIX: Final = ".deviceclass.resource.k8s.io/devices"
"""``<class>`` + this: Kubernetes' quota resource counting the devices a class hands out."""
REQUESTS_PREFIX: Final = "requests."
"""This + an extended resource name: the quota resource counting pods' requests of it."""
SHARE_MEMORY: Final = "gpu.nvidia.com/share-memory"
"""The ``spec.hard`` key that limits the GPU memory of the namespace's shares (gpu-dra's own)."""


def is_tier_quota(quota: object) -> bool:
    """Whether a raw ResourceQuota carries the tier-quota label (value ``true``)."""
    metadata = quota.get("metadata") if isinstance(quota, Mapping) else None
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    return isinstance(labels, Mapping) and str(labels.get(TIER_QUOTA_LABEL, "")).lower() == "true"
