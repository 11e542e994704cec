"""Which MIG profiles dynamic MIG publishes: the ``--dynamic-mig-profiles`` policy (pure).

A policy is ``[<model>=]<profile>,...`` entries separated by ``;``. A profile is ``all``, a full
go-nvlib name (``1g.10gb``, ``1g.10gb+me``: offered where the GPU has that profile) or a shape
``<G>g[+attr]`` (``1g``, ``3g``, ``1g+me``: the profile of G compute slices with that attribute
suffix, none for a plain shape, that spans the fewest memory slices). An entry with ``<model>``
applies to GPUs whose product name contains it (case-insensitive; the first such entry wins), the
entry without one to every other GPU; a GPU no entry covers publishes no partition (it stays a
plain GPU). `DEFAULT` is ``1g,2g,3g,4g,7g``. See docs/mig.md#which-profiles-dynamic-mig-publishes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from gpu_dra.driver.model import Gpu, MigProfile

ALL: Final = "all"
DEFAULT_POLICY_TEXT: Final = "1g,2g,3g,4g,7g"
"""The default: one profile per compute-slice count, i.e. every shape the catalog's classes
(``mig-1g`` ... ``mig-7g``) ask for, without the ``+me`` variants and the double-memory 1g
(``1g.20gb``), which are on request. 4g costs one placement per H100 (docs/mig.md)."""

_SHAPE: Final = re.compile(r"^(?P<g>[1-9][0-9]?)g(?P<suffix>(?:[+-][a-z][a-z0-9.]*)*)$")
_NAME: Final = re.compile(r"^[1-9][0-9]?g\.[0-9]+gb(?P<suffix>(?:[+-][a-z][a-z0-9.]*)*)$")
_MODEL: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._-]*$")


class MigPolicyError(ValueError):
    """A policy text that cannot be read; the message names the entry and the token."""


@dataclass(frozen=True)
class ProfileSet:
    """The profiles of one policy entry: `everything`, exact `names`, or `shapes`."""

    everything: bool
    names: frozenset[str]
    shapes: frozenset[tuple[int, str]]
    """(compute slices, attribute suffix such as ``+me`` or ``""``)."""

    def select(self, profiles: tuple[MigProfile, ...]) -> tuple[MigProfile, ...]:
        """The profiles of `profiles` this set offers, in their given order."""
        if self.everything:
            return profiles
        chosen = {profile.name for profile in profiles if profile.name in self.names}
        for slices, suffix in self.shapes:
            matching = [
                p for p in profiles if p.slice_count == slices and profile_suffix(p.name) == suffix
            ]
            if matching:
                fewest = min(p.placement_size for p in matching)
                chosen.update(p.name for p in matching if p.placement_size == fewest)
        return tuple(profile for profile in profiles if profile.name in chosen)

    def __str__(self) -> str:
        if self.everything:
            return ALL
        shapes = [f"{g}g{suffix}" for g, suffix in sorted(self.shapes)]
        return ",".join(shapes + sorted(self.names))


@dataclass(frozen=True)
class MigPolicy:
    """The ``--dynamic-mig-profiles`` policy: per product-name match, the profiles offered."""

    entries: tuple[tuple[str | None, ProfileSet], ...]
    """(model substring or None for every other GPU, profiles), in the order given."""

    def profile_set(self, gpu: Gpu) -> ProfileSet | None:
        """The entry that covers `gpu`: the first whose model its product name contains, else
        the entry without a model; None when no entry covers it."""
        product = gpu.product_name.lower()
        for model, profiles in self.entries:
            if model is not None and model.lower() in product:
                return profiles
        return next((profiles for model, profiles in self.entries if model is None), None)

    def offered(self, gpu: Gpu, profiles: tuple[MigProfile, ...]) -> tuple[MigProfile, ...]:
        """The profiles of `gpu` (`profiles`, NVML order) that dynamic MIG publishes."""
        entry = self.profile_set(gpu)
        return () if entry is None else entry.select(profiles)

    @property
    def publishes_everything(self) -> bool:
        return all(profiles.everything for _, profiles in self.entries) and any(
            model is None for model, _ in self.entries
        )

    def __str__(self) -> str:
        return ";".join(
            str(profiles) if model is None else f"{model}={profiles}"
            for model, profiles in self.entries
        )


def profile_suffix(name: str) -> str:
    """The attribute suffix of a go-nvlib profile name: ``+me`` of ``1g.10gb+me``, else ``""``."""
    match = _NAME.match(name)
    return match.group("suffix") if match else ""


def parse_policy(text: str) -> MigPolicy:
    """Read a ``--dynamic-mig-profiles`` value (see the module docstring)."""
    entries: list[tuple[str | None, ProfileSet]] = []
    seen: set[str | None] = set()
    for raw in text.split(";"):
        entry = raw.strip()
        if not entry:
            continue
        model: str | None = None
        tokens = entry
        if "=" in entry:
            model_text, tokens = (part.strip() for part in entry.split("=", 1))
            if not _MODEL.match(model_text):
                raise MigPolicyError(
                    f"dynamic MIG profiles entry {entry!r}: {model_text!r} is not a GPU model "
                    "(letters, digits, spaces, '.', '_', '-'; matched against the product name)"
                )
            model = model_text
        key = None if model is None else model.lower()
        if key in seen:
            which = "without a model" if model is None else f"for model {model!r}"
            raise MigPolicyError(f"dynamic MIG profiles: two entries {which}")
        seen.add(key)
        entries.append((model, _profile_set(tokens, entry)))
    if not entries:
        raise MigPolicyError(
            f"dynamic MIG profiles {text!r}: no entry; name profiles (e.g. {DEFAULT_POLICY_TEXT}) "
            f"or {ALL}"
        )
    return MigPolicy(tuple(entries))


def _profile_set(tokens: str, entry: str) -> ProfileSet:
    everything = False
    names: set[str] = set()
    shapes: set[tuple[int, str]] = set()
    words = [word.strip() for word in tokens.split(",")]
    if not any(words):
        raise MigPolicyError(f"dynamic MIG profiles entry {entry!r}: no profile named")
    for word in words:
        token = word.lower()
        if not token:
            continue
        if token == ALL:
            everything = True
        elif shape := _SHAPE.match(token):
            shapes.add((int(shape.group("g")), shape.group("suffix")))
        elif _NAME.match(token):
            names.add(token)
        else:
            raise MigPolicyError(
                f"dynamic MIG profiles entry {entry!r}: {word!r} is not a MIG profile; use a "
                f"profile name (1g.10gb, 1g.10gb+me), a shape (1g, 3g, 1g+me) or {ALL}"
            )
    if everything:  # names and shapes add nothing to all
        return ProfileSet(True, frozenset(), frozenset())
    return ProfileSet(False, frozenset(names), frozenset(shapes))


DEFAULT: Final = parse_policy(DEFAULT_POLICY_TEXT)
EVERYTHING: Final = parse_policy(ALL)
