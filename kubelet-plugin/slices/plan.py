"""Plan the writes that turn a pool's live ResourceSlices into its desired ones (pure).

A live slice whose content-hash annotation matches a desired slice is that slice; the rest pair by
position (live slices sorted by name); unpaired desired slices are created, unpaired live ones and
other pools' slices deleted. When every slice is current (content, generation, slice count, Node
owner) the plan is empty; otherwise the generation is bumped and every slice of the pool is written
once. Content is compared by hash because the apiserver normalizes fields.
See docs/architecture.md#slice-publishing.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace

from gpu_dra.driver.resourceapi import API_VERSION, ResourceSliceSpec
from gpu_dra.driver.slices import DesiredPool
from gpu_dra.kubelet_plugin.slices.kubeapi import (
    RESOURCE_SLICE_KIND,
    ObjectMeta,
    OwnerReference,
    ResourceSlice,
)

SPEC_HASH_ANNOTATION_NAME = "spec-hash"


@dataclass(frozen=True)
class SlicePlan:
    """Writes in the order they are made: deletes, then updates, then creates."""

    generation: int
    deletes: tuple[ResourceSlice, ...] = ()
    updates: tuple[ResourceSlice, ...] = ()
    creates: tuple[ResourceSlice, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.deletes or self.updates or self.creates)

    def owned_by(self, owner: OwnerReference) -> SlicePlan:
        """The plan with `owner` as the controller reference of every written slice."""
        return replace(
            self,
            updates=tuple(_with_owner(body, owner) for body in self.updates),
            creates=tuple(_with_owner(body, owner) for body in self.creates),
        )


def node_owner(node_name: str, node_uid: str) -> OwnerReference:
    """The ownerReference that lets garbage collection remove a node's slices with the Node."""
    return OwnerReference(
        apiVersion="v1", kind="Node", name=node_name, uid=node_uid, controller=True
    )


def spec_hash_annotation(driver: str) -> str:
    """`<driver>/spec-hash`: the driver name is a DNS subdomain, a valid annotation prefix."""
    return f"{driver}/{SPEC_HASH_ANNOTATION_NAME}"


def spec_hash(spec: ResourceSliceSpec) -> str:
    """Hash of a slice's content, leaving out the pool generation and slice count."""
    content = {key: value for key, value in spec.items() if key != "pool"}
    content["pool"] = spec["pool"]["name"]
    encoded = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


def generate_name(node_name: str, driver: str) -> str:
    """`<node>-<driver>-`, the prefix the apiserver completes with random characters."""
    return f"{node_name}-{driver}-"


def plan_pool(
    desired: DesiredPool, live: Sequence[ResourceSlice], *, last_generation: int
) -> SlicePlan:
    """The writes that publish `desired` over `live` (the slices under the publisher's selector).

    `last_generation` is the highest generation this publisher wrote before: after the kubelet
    wipes the pool, the new generation still grows.
    """
    hash_key = spec_hash_annotation(desired.driver)
    ours = sorted((s for s in live if s["spec"]["pool"]["name"] == desired.name), key=_name)
    foreign = [s for s in live if s["spec"]["pool"]["name"] != desired.name]
    hashes = [spec_hash(spec) for spec in desired.slices]

    pairs: dict[int, ResourceSlice] = {}
    unpaired = list(ours)
    for index, wanted in enumerate(hashes):
        found = next((s for s in unpaired if _annotation(s, hash_key) == wanted), None)
        if found is not None:
            pairs[index] = found
            unpaired.remove(found)
    for index in range(len(desired.slices)):
        if index not in pairs and unpaired:
            pairs[index] = unpaired.pop(0)

    current_generation = max((s["spec"]["pool"]["generation"] for s in ours), default=0)
    creates_needed = len(pairs) < len(desired.slices)
    if not (creates_needed or unpaired or foreign) and all(
        _is_current(pairs[index], wanted, hash_key, desired, current_generation)
        for index, wanted in enumerate(hashes)
    ):
        return SlicePlan(generation=current_generation)

    generation = max(current_generation, last_generation) + 1
    updates: list[ResourceSlice] = []
    creates: list[ResourceSlice] = []
    for index, spec in enumerate(desired.slices):
        metadata = _metadata_for(pairs.get(index), desired)
        metadata["annotations"] = {**metadata.get("annotations", {}), hash_key: hashes[index]}
        body = ResourceSlice(
            apiVersion=API_VERSION,
            kind=RESOURCE_SLICE_KIND,
            metadata=metadata,
            spec=_stamped(spec, generation),
        )
        (updates if index in pairs else creates).append(body)
    return SlicePlan(
        generation=generation,
        deletes=tuple(sorted(unpaired + foreign, key=_name)),
        updates=tuple(updates),
        creates=tuple(creates),
    )


def _is_current(
    live: ResourceSlice,
    wanted_hash: str,
    hash_key: str,
    desired: DesiredPool,
    generation: int,
) -> bool:
    pool = live["spec"]["pool"]
    return (
        _annotation(live, hash_key) == wanted_hash
        and pool["generation"] == generation
        and pool["resourceSliceCount"] == len(desired.slices)
        and _has_node_owner(live, desired.node_name)
    )


def _has_node_owner(live: ResourceSlice, node_name: str) -> bool:
    return any(
        ref["kind"] == "Node" and ref["name"] == node_name and ref.get("controller", False)
        for ref in live["metadata"].get("ownerReferences", [])
    )


def _metadata_for(live: ResourceSlice | None, desired: DesiredPool) -> ObjectMeta:
    """Metadata of the write: a generateName for a new slice; for an update the live identity,
    labels, annotations and owners (server-managed fields such as managedFields are left out)."""
    if live is None:
        return ObjectMeta(generateName=generate_name(desired.node_name, desired.driver))
    metadata = ObjectMeta()
    for key in ("name", "uid", "resourceVersion", "labels", "annotations", "ownerReferences"):
        if key in live["metadata"]:
            metadata[key] = copy.deepcopy(live["metadata"][key])
    return metadata


def _stamped(spec: ResourceSliceSpec, generation: int) -> ResourceSliceSpec:
    stamped = copy.deepcopy(spec)
    stamped["pool"]["generation"] = generation
    return stamped


def _with_owner(body: ResourceSlice, owner: OwnerReference) -> ResourceSlice:
    owned = copy.deepcopy(body)
    others = [
        ref
        for ref in owned["metadata"].get("ownerReferences", [])
        if not ref.get("controller", False)
    ]
    owned["metadata"]["ownerReferences"] = [*others, owner]
    return owned


def _annotation(live: ResourceSlice, key: str) -> str | None:
    return live["metadata"].get("annotations", {}).get(key)


def _name(live: ResourceSlice) -> str:
    return live["metadata"].get("name", "")
