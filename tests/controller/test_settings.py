"""ControllerSettings: flags over environment over defaults; every field has both spellings."""

from __future__ import annotations

import socket
from dataclasses import fields
from pathlib import Path

import pytest

from gpu_dra.controller.settings import ControllerSettings, build_parser, options


def test_defaults_apply_without_flags_or_environment() -> None:
    assert ControllerSettings.from_env({}) == ControllerSettings()


def test_environment_sets_every_kind_of_field() -> None:
    settings = ControllerSettings.from_env(
        {
            "GPU_DRA_KUBECONFIG": "/root/.kube/config",
            "GPU_DRA_DEVICECLASSES_DIR": "/catalog",
            "GPU_DRA_RESYNC_INTERVAL": "30",
            "GPU_DRA_ONCE": "true",
            "GPU_DRA_METRICS_PORT": "0",
            "GPU_DRA_LOG_LEVEL": "debug",
        }
    )

    assert settings.kubeconfig == Path("/root/.kube/config")
    assert settings.deviceclasses_dir == Path("/catalog")
    assert settings.resync_interval_s == 30.0
    assert settings.once is True
    assert settings.metrics_port == 0
    assert settings.log_level == "DEBUG"


def test_flag_wins_over_environment() -> None:
    settings = ControllerSettings.from_args(
        ["--metrics-port", "9000", "--no-once"],
        {"GPU_DRA_METRICS_PORT": "8000", "GPU_DRA_ONCE": "1"},
    )

    assert (settings.metrics_port, settings.once) == (9000, False)


def test_empty_kubeconfig_means_in_cluster() -> None:
    assert ControllerSettings.from_env({"GPU_DRA_KUBECONFIG": ""}).kubeconfig is None


def test_every_field_has_a_flag_and_a_gpu_dra_environment_twin() -> None:
    spelled = options()

    assert set(spelled) == {item.name for item in fields(ControllerSettings)}
    for name, option in spelled.items():
        assert option.flag == "--" + option.env.removeprefix("GPU_DRA_").lower().replace("_", "-")
        assert option.env.startswith("GPU_DRA_"), name


def test_usage_names_each_environment_variable_and_default() -> None:
    usage = build_parser({}).format_help()

    for option in options().values():
        assert option.flag in usage
        assert option.env in usage
    assert "default: 600.0" in usage


def test_bad_environment_value_exits_with_usage_naming_the_variable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        ControllerSettings.from_env({"GPU_DRA_METRICS_PORT": "70000"})

    assert "GPU_DRA_METRICS_PORT" in capsys.readouterr().err


def test_bad_flag_value_exits_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        ControllerSettings.from_args(["--log-level", "loud"], {})

    assert "must be one of" in capsys.readouterr().err


def test_the_webhook_is_off_by_default_and_set_by_port_and_tls_files() -> None:
    assert ControllerSettings().webhook_port == 0

    settings = ControllerSettings.from_env(
        {
            "GPU_DRA_WEBHOOK_PORT": "8443",
            "GPU_DRA_WEBHOOK_TLS_CERT_FILE": "/tls/tls.crt",
            "GPU_DRA_WEBHOOK_TLS_PRIVATE_KEY_FILE": "/tls/tls.key",
        }
    )

    assert settings.webhook_port == 8443
    assert settings.webhook_tls_cert_file == Path("/tls/tls.crt")
    assert settings.webhook_tls_private_key_file == Path("/tls/tls.key")


def test_leader_election_durations_take_seconds_or_nvidias_go_durations() -> None:
    settings = ControllerSettings.from_args(
        [
            "--leader-election-enabled",
            "--leader-election-lease-duration=1m30s",
            "--leader-election-renew-deadline=20",
            "--leader-election-retry-period=500ms",
        ],
        {"GPU_DRA_LEADER_ELECTION_LEASE_LOCK_NAMESPACE": "gpu-system"},
    )

    assert settings.leader_election_enabled is True
    assert settings.leader_election_lease_duration_s == 90.0
    assert settings.leader_election_renew_deadline_s == 20.0
    assert settings.leader_election_retry_period_s == 0.5
    assert settings.leader_election_lease_lock_namespace == "gpu-system"
    defaults = ControllerSettings()
    assert (
        defaults.leader_election_lease_duration_s,
        defaults.leader_election_renew_deadline_s,
        defaults.leader_election_retry_period_s,
    ) == (15.0, 10.0, 2.0)  # client-go's


@pytest.mark.parametrize(
    ("argv", "complaint"),
    [
        (["--leader-election-lease-duration=15 s"], "a duration such as 15s"),
        (["--leader-election-retry-period=0s"], "more than 0 seconds"),
        (["--leader-election-renew-deadline=20s"], "lease duration > renew deadline"),
        (["--leader-election-retry-period=9s"], "> 1.2 x retry period"),
    ],
)
def test_bad_leader_election_durations_are_usage_errors(
    argv: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        ControllerSettings.from_args(argv, {})

    assert exit_info.value.code == 2
    assert complaint in capsys.readouterr().err


def test_the_identity_defaults_to_the_host_name() -> None:
    assert ControllerSettings().leader_election_identity_or_host == socket.gethostname()
    named = ControllerSettings(leader_election_identity="gpu-dra-controller-7d9f-abcde")
    assert named.leader_election_identity_or_host == "gpu-dra-controller-7d9f-abcde"
