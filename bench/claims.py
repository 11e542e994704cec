"""Allocated ResourceClaims for the benchmarks, and a ClaimReader that serves them from memory.

The real plugin GETs each claim from the API server during prepare. The benchmarks leave that
GET out on purpose: its cost is the cluster's (API server load, network, client QPS limits), not
the driver's, and it would make the numbers depend on whichever cluster the machine reaches. The
in-memory reader keeps everything else of the path: the preparer still receives a full
``resource.k8s.io/v1`` claim and checks its UID, allocation, pool and configs.

Claim ``i`` is named ``bench-<i>`` with a UID derived from ``i``, so that the plugin process and
the client process build the same claims without sharing anything but the count.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Final

from gpu_dra.kubelet_plugin.kubeapi import ClaimNotFoundError, ResourceClaim
from gpu_dra.kubelet_plugin.prepare_protocol import ClaimRef

DRIVER: Final = "gpu.nvidia.com"
NAMESPACE: Final = "bench"
REQUEST: Final = "gpu"

_UID_NAMESPACE: Final = uuid.UUID("0d7e3c52-9b0e-4c1f-8a55-6b2f1e9d4a30")


def claim_ref(index: int) -> ClaimRef:
    """The kubelet's view of claim ``index``: namespace, UID, name."""
    return ClaimRef(
        namespace=NAMESPACE,
        uid=str(uuid.uuid5(_UID_NAMESPACE, f"bench-{index}")),
        name=f"bench-{index}",
    )


def allocated_claim(index: int, *, node_name: str, device_name: str) -> ResourceClaim:
    """Claim ``index`` as the API server serves it once the scheduler allocated one GPU."""
    ref = claim_ref(index)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"namespace": ref.namespace, "name": ref.name, "uid": ref.uid},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": REQUEST,
                        "exactly": {
                            "deviceClassName": DRIVER,
                            "allocationMode": "ExactCount",
                            "count": 1,
                        },
                    }
                ]
            }
        },
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {
                            "request": REQUEST,
                            "driver": DRIVER,
                            "pool": node_name,
                            "device": device_name,
                        }
                    ],
                    "config": [],
                },
                "nodeSelector": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": [node_name]}
                            ]
                        }
                    ]
                },
            }
        },
    }


def allocated_claims(
    count: int, *, node_name: str, device_names: Sequence[str]
) -> dict[tuple[str, str], ResourceClaim]:
    """Claims ``0..count-1``; claim ``i`` holds device ``device_names[i % len(device_names)]``.

    Any ``len(device_names)`` consecutive claims therefore hold distinct devices and can be
    prepared at the same time.
    """
    claims = {}
    for index in range(count):
        claim = allocated_claim(
            index, node_name=node_name, device_name=device_names[index % len(device_names)]
        )
        claims[(claim["metadata"]["namespace"], claim["metadata"]["name"])] = claim
    return claims


class InMemoryClaimReader:
    """`ClaimReader` over pre-built claims: no API server round trip (see the module doc)."""

    def __init__(self, claims: Mapping[tuple[str, str], ResourceClaim]) -> None:
        self._claims = dict(claims)

    def get_claim(self, namespace: str, name: str) -> ResourceClaim:
        try:
            return self._claims[(namespace, name)]
        except KeyError:
            raise ClaimNotFoundError(f"ResourceClaim {namespace}/{name} not found") from None
