"""One MIG device a claim makes (`MigIntent`): where it goes, its ids once made, its JSON.

Claims record their intents in the checkpoint (`tiers.state.intents_from_state`) before any NVML
call; `claims.DynamicMig` makes, joins and destroys the devices. See docs/mig.md, "Dynamic MIG:
lifecycle".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_dra.kubelet_plugin.checkpoint import JsonValue


@dataclass(frozen=True)
class MigIntent:
    """One MIG device a claim makes: where, and (once made) its ids and UUID."""

    device: str
    parent_uuid: str
    gi_profile_id: int
    placement_start: int
    gi_id: int | None = None
    ci_id: int | None = None
    uuid: str | None = None
    shared: bool = False
    """The partition is offered as MPS shares: the claims holding it share one MIG device,
    made by the first, joined by the others, destroyed after the last."""

    @property
    def key(self) -> tuple[str, int, int]:
        """(parent UUID, GI profile ID, placement start): what identifies the GPU instance."""
        return (self.parent_uuid, self.gi_profile_id, self.placement_start)

    def to_json(self) -> dict[str, JsonValue]:
        value: dict[str, JsonValue] = {
            "device": self.device,
            "parentUUID": self.parent_uuid,
            "giProfileID": self.gi_profile_id,
            "placementStart": self.placement_start,
        }
        if self.gi_id is not None:
            value["giID"] = self.gi_id
        if self.ci_id is not None:
            value["ciID"] = self.ci_id
        if self.uuid is not None:
            value["uuid"] = self.uuid
        if self.shared:
            value["shared"] = True
        return value

    @classmethod
    def from_json(cls, item: Mapping[str, JsonValue]) -> MigIntent:
        """The intent ``item`` (`to_json`) describes; `KeyError` or `TypeError` naming the
        field when it is unusable."""
        return cls(
            device=_str(item, "device"),
            parent_uuid=_str(item, "parentUUID"),
            gi_profile_id=_int(item, "giProfileID"),
            placement_start=_int(item, "placementStart"),
            gi_id=_optional_int(item, "giID"),
            ci_id=_optional_int(item, "ciID"),
            uuid=_optional_str(item, "uuid"),
            shared=item.get("shared") is True,
        )


def _str(raw: Mapping[str, JsonValue], key: str) -> str:
    value = raw[key]
    if not isinstance(value, str):
        raise TypeError(f"{key} must be a string, got {value!r}")
    return value


def _int(raw: Mapping[str, JsonValue], key: str) -> int:
    value = raw[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(f"{key} must be a non-negative integer, got {value!r}")
    return value


def _optional_int(raw: Mapping[str, JsonValue], key: str) -> int | None:
    return None if raw.get(key) is None else _int(raw, key)


def _optional_str(raw: Mapping[str, JsonValue], key: str) -> str | None:
    return None if raw.get(key) is None else _str(raw, key)
