"""The plugin's slice layout: `--slice-layout` wins; otherwise the apiserver's version decides,
and an unreadable version falls back to the split layout with a warning naming the flag."""

from __future__ import annotations

import logging

import pytest

from gpu_dra.driver.slices import SliceLayout
from gpu_dra.kube.errors import ApiError
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from gpu_dra.kubelet_plugin.startup.slice_publishing import slice_layout

AUTO = KubeletPluginSettings(node_name="node-a")


def never_asked() -> tuple[str, str]:
    raise AssertionError("the apiserver must not be asked when --slice-layout is set")


def test_the_flag_wins_without_asking_the_apiserver() -> None:
    settings = KubeletPluginSettings(node_name="node-a", slice_layout=SliceLayout.COMBINED)
    assert slice_layout(settings, never_asked) is SliceLayout.COMBINED


@pytest.mark.parametrize(
    ("version", "layout"),
    [(("1", "34"), SliceLayout.COMBINED), (("1", "35+"), SliceLayout.SPLIT)],
)
def test_auto_follows_the_apiserver_version(version: tuple[str, str], layout: SliceLayout) -> None:
    assert slice_layout(AUTO, lambda: version) is layout


def unreachable() -> tuple[str, str]:
    raise ApiError("read the apiserver version (/version): connection refused")


@pytest.mark.parametrize("version", [unreachable, lambda: ("", "")])
def test_unreadable_version_publishes_split_and_says_how_to_choose(
    version: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        assert slice_layout(AUTO, version) is SliceLayout.SPLIT  # type: ignore[arg-type]
    assert "set --slice-layout to choose" in caplog.text
