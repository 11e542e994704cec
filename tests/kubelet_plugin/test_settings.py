"""KubeletPluginSettings: flags over GPU_DRA_* environment twins over defaults; bad input is a
usage error (exit status 2 with a message), never a traceback."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path, PurePosixPath

import pytest

from gpu_dra.driver.health import TaintEffect
from gpu_dra.driver.mig_policy import DEFAULT, EVERYTHING, parse_policy
from gpu_dra.driver.shares import MigShareSelection, PartitionShareSelection, ShareSelection
from gpu_dra.driver.slices import SliceLayout
from gpu_dra.kubelet_plugin.mps.warm_policy import WarmPolicy
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings

ALL_FLAGS = [
    "--node-name=node-a",
    "--driver-name=gpu.example.com",
    "--simulate=hgx-h100",
    "--driver-root=/driver-root",
    "--nvidia-driver-root=/run/nvidia/driver",
    "--nvidia-cdi-hook-path=/var/lib/gpu-dra/nvidia-cdi-hook",
    "--disable-cdi-hooks=update-application-profile,enable-cuda-compat",
    "--kubelet-plugins-dir=/k/plugins",
    "--kubelet-registry-dir=/k/registry",
    "--cdi-root=/etc/cdi",
    "--data-dir=/k/data",
    "--instance-id=4f1c2b9e-0000-4000-8000-00000000000a",
    "--kubeconfig=/root/.kube/config",
    "--call-timeout=12.5",
    "--metrics-port=9400",
    "--healthcheck-port=51516",
    "--kubelet-device-plugins-dir=/var/lib/k/device-plugins",
    "--allow-nvidia-device-plugin=true",
    "--event-namespace=gpu-system",
    "--log-level=debug",
    "--mps-control-binary=/opt/mps/nvidia-cuda-mps-control",
    "--nvidia-smi=/opt/nvidia/bin/nvidia-smi",
    "--mps-shares=0,GPU-a75cda02-62ce-2c30-9150-555ef08935e2",
    "--capped-shares=2,3",
    "--mps-shares-on-mig=3g.40gb,MIG-cb40a2a6-69c6-5d06-a49f-1a42bda0ba34",
    "--mps-shares-on-dynamic-mig=1g.10gb,3g.40gb",
    "--mps-share-max-percent=50",
    "--mps-share-replicas=8",
    "--mps-share-memory-limits=off",
    "--mps-memory-watchdog=report",
    "--mps-memory-watchdog-interval=2.5",
    "--mps-daemon-runner=pod",
    "--mps-daemon-image=registry.example/gpu-dra:1",
    "--mps-daemon-namespace=gpu-system",
    "--mps-daemon-priority-class=gpu-dra-mps",
    "--mps-daemon-image-pull-secrets=registry-a, registry-b",
    "--mps-exclusive-compute-mode=all",
    "--mps-daemon-check-interval=2.5",
    "--mps-share-daemon-warm=idle:5m",
    "--dynamic-mig=true",
    "--feature-gates=DynamicMIG=true,MPSSupport=false,TimeSlicingSettings=true",
    "--slice-layout=combined",
    "--dynamic-mig-profiles=H100=1g.10gb,1g+me;all",
    "--health-monitor=false",
    "--health-ignored-xids=13,31",
    "--additional-xids-to-ignore=48",
    "--health-taint-effect-degraded=None",
    "--health-taint-effect-lost=NoSchedule",
    "--health-taint-effect-unmonitored=NoSchedule",
    "--utilization-interval=2.5",
    "--utilization-idle-threshold=10",
    "--claim-status=false",
    "--claim-status-min-interval=5",
    "--claim-status-idle-after=60",
    "--guard-recheck-interval=7.5",
]

EXPECTED = KubeletPluginSettings(
    node_name="node-a",
    driver_name="gpu.example.com",
    simulate="hgx-h100",
    driver_root=Path("/driver-root"),
    nvidia_driver_root=PurePosixPath("/run/nvidia/driver"),
    nvidia_cdi_hook_path="/var/lib/gpu-dra/nvidia-cdi-hook",
    disable_cdi_hooks=frozenset({"update-application-profile", "enable-cuda-compat"}),
    kubelet_plugins_dir=Path("/k/plugins"),
    kubelet_registry_dir=Path("/k/registry"),
    cdi_root=Path("/etc/cdi"),
    data_dir=Path("/k/data"),
    instance_id="4f1c2b9e-0000-4000-8000-00000000000a",
    kubeconfig=Path("/root/.kube/config"),
    call_timeout_s=12.5,
    metrics_port=9400,
    healthcheck_port=51516,
    kubelet_device_plugins_dir=Path("/var/lib/k/device-plugins"),
    allow_nvidia_device_plugin=True,
    event_namespace="gpu-system",
    guard_recheck_interval_s=7.5,
    log_level="DEBUG",
    mps_control_binary="/opt/mps/nvidia-cuda-mps-control",
    nvidia_smi="/opt/nvidia/bin/nvidia-smi",
    mps_shares=ShareSelection(names=("0", "GPU-a75cda02-62ce-2c30-9150-555ef08935e2")),
    capped_shares=ShareSelection(names=("2", "3"), flag="--capped-shares"),
    mps_shares_on_mig=MigShareSelection(
        profiles=("3g.40gb",), uuids=("MIG-cb40a2a6-69c6-5d06-a49f-1a42bda0ba34",)
    ),
    mps_shares_on_dynamic_mig=PartitionShareSelection(profiles=("1g.10gb", "3g.40gb")),
    mps_share_max_percent=50,
    mps_share_replicas=8,
    mps_share_memory_limits="off",
    mps_memory_watchdog="report",
    mps_memory_watchdog_interval_s=2.5,
    mps_daemon_runner="pod",
    mps_daemon_image="registry.example/gpu-dra:1",
    mps_daemon_namespace="gpu-system",
    mps_daemon_priority_class="gpu-dra-mps",
    mps_daemon_image_pull_secrets=("registry-a", "registry-b"),
    mps_exclusive_compute_mode="all",
    mps_daemon_check_interval_s=2.5,
    mps_share_daemon_warm=WarmPolicy(warm=True, idle_s=300.0),
    dynamic_mig=True,
    feature_gates=("DynamicMIG", "TimeSlicingSettings"),
    slice_layout=SliceLayout.COMBINED,
    dynamic_mig_profiles=parse_policy("H100=1g+me,1g.10gb;all"),
    health_monitor=False,
    health_ignored_xids=frozenset({13, 31}),
    additional_xids_to_ignore=frozenset({48}),
    health_taint_effect_degraded=TaintEffect.NONE,
    health_taint_effect_lost=TaintEffect.NO_SCHEDULE,
    health_taint_effect_unmonitored=TaintEffect.NO_SCHEDULE,
    utilization_interval_s=2.5,
    utilization_idle_threshold=10.0,
    claim_status=False,
    claim_status_min_interval_s=5.0,
    claim_status_idle_after_s=60.0,
)


def env_twin(flag: str) -> str:
    """``--cdi-root=/x`` -> ``GPU_DRA_CDI_ROOT``."""
    return "GPU_DRA_" + flag.split("=", 1)[0].removeprefix("--").upper().replace("-", "_")


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str], env: dict[str, str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        KubeletPluginSettings.parse(argv, env)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_defaults_need_only_a_node_name() -> None:
    settings = KubeletPluginSettings.parse(["--node-name", "node-a"], {})

    assert settings == KubeletPluginSettings(node_name="node-a")
    assert settings.driver_name == "gpu.nvidia.com"
    assert settings.simulate is None
    assert settings.cdi_root == Path("/var/run/cdi")
    assert settings.call_timeout_s == 40.0
    assert settings.metrics_port == 8081
    assert settings.state_dir == Path("/var/lib/kubelet/plugins/gpu.nvidia.com")


def test_every_flag_sets_its_field() -> None:
    assert KubeletPluginSettings.parse(ALL_FLAGS, {}) == EXPECTED


def test_every_flag_has_a_gpu_dra_environment_twin() -> None:
    env = {env_twin(flag): flag.split("=", 1)[1] for flag in ALL_FLAGS}

    assert KubeletPluginSettings.parse([], env) == EXPECTED


def test_every_field_is_covered_by_a_flag() -> None:
    # ALL_FLAGS must set every field away from its default, or the tests above prove nothing.
    default = KubeletPluginSettings(node_name="")
    for item in fields(KubeletPluginSettings):
        assert getattr(EXPECTED, item.name) != getattr(default, item.name), item.name
    assert len(ALL_FLAGS) == len(fields(KubeletPluginSettings))


def test_flag_wins_over_its_environment_twin() -> None:
    settings = KubeletPluginSettings.parse(
        ["--node-name", "from-flag", "--call-timeout", "5"],
        {"GPU_DRA_NODE_NAME": "from-env", "GPU_DRA_CALL_TIMEOUT": "30"},
    )

    assert (settings.node_name, settings.call_timeout_s) == ("from-flag", 5.0)


def test_node_name_falls_back_to_the_downward_api_node_name() -> None:
    assert KubeletPluginSettings.parse([], {"NODE_NAME": "node-b"}).node_name == "node-b"


def test_gpu_dra_node_name_wins_over_node_name() -> None:
    env = {"NODE_NAME": "node-b", "GPU_DRA_NODE_NAME": "node-c"}

    assert KubeletPluginSettings.parse([], env).node_name == "node-c"


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        pytest.param([], {}, id="nothing"),
        pytest.param(["--node-name", ""], {}, id="empty-flag"),
        pytest.param([], {"NODE_NAME": ""}, id="empty-env"),
    ],
)
def test_missing_node_name_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], env: dict[str, str]
) -> None:
    error = usage_error(capsys, argv, env)

    assert "--node-name (or GPU_DRA_NODE_NAME / NODE_NAME) is required" in error


@pytest.mark.parametrize("timeout", ["0", "-1", "45", "60", "nan", "inf"])
def test_call_timeout_outside_the_kubelet_deadline_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], timeout: str
) -> None:
    error = usage_error(capsys, ["--node-name", "n", "--call-timeout", timeout], {})

    assert "--call-timeout must be between 0 and 45 seconds" in error


@pytest.mark.parametrize("timeout", ["0.1", "44.9"])
def test_call_timeout_just_inside_the_bounds_is_accepted(timeout: str) -> None:
    settings = KubeletPluginSettings.parse(["--node-name", "n", "--call-timeout", timeout], {})

    assert settings.call_timeout_s == float(timeout)


def test_call_timeout_that_is_not_a_number_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = usage_error(capsys, [], {"GPU_DRA_NODE_NAME": "n", "GPU_DRA_CALL_TIMEOUT": "40s"})

    assert "--call-timeout must be a number of seconds, got '40s'" in error


def test_data_dir_replaces_the_default_state_dir() -> None:
    default = KubeletPluginSettings.parse(
        ["--node-name", "n", "--kubelet-plugins-dir", "/p", "--driver-name", "gpu.example.com"],
        {},
    )
    explicit = KubeletPluginSettings.parse(["--node-name", "n", "--data-dir", "/d"], {})

    assert default.state_dir == Path("/p/gpu.example.com")
    assert explicit.state_dir == Path("/d")


def test_the_instance_id_is_the_pod_uid_from_the_downward_api_unless_set(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pod = {"POD_UID": "4f1c2b9e-0000-4000-8000-00000000000a"}
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).instance_id == ""
    assert KubeletPluginSettings.parse(["--node-name=n"], pod).instance_id == pod["POD_UID"]
    explicit = KubeletPluginSettings.parse(["--node-name=n"], {**pod, "GPU_DRA_INSTANCE_ID": "x1"})
    assert explicit.instance_id == "x1"

    error = usage_error(capsys, ["--node-name=n", "--instance-id=../a"], {})
    assert "--instance-id: instance id '../a' may only hold" in error


@pytest.mark.parametrize("variable", ["GPU_DRA_SIMULATE", "GPU_DRA_DATA_DIR", "GPU_DRA_KUBECONFIG"])
def test_empty_optional_setting_means_unset(variable: str) -> None:
    settings = KubeletPluginSettings.parse(["--node-name", "n"], {variable: ""})

    assert (settings.simulate, settings.data_dir, settings.kubeconfig) == (None, None, None)


def test_usage_names_each_environment_twin_and_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        KubeletPluginSettings.parse(["--help"], {})

    assert exit_info.value.code == 0
    usage = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    for flag in ALL_FLAGS:
        assert f"env {env_twin(flag)};" in usage, flag
    assert "[env GPU_DRA_CDI_ROOT; default: /var/run/cdi]" in usage
    assert "[env GPU_DRA_CALL_TIMEOUT; default: 40]" in usage


@pytest.mark.parametrize("value", ["http", "-1", "65536"])
def test_a_bad_metrics_port_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert "--metrics-port" in usage_error(capsys, ["--node-name=n", f"--metrics-port={value}"], {})


def test_an_unknown_log_level_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--log-level must be one of" in usage_error(
        capsys, ["--node-name=n", "--log-level=loud"], {}
    )


def test_metrics_port_zero_turns_the_endpoint_off() -> None:
    assert KubeletPluginSettings.parse(["--node-name=n", "--metrics-port=0"], {}).metrics_port == 0


def executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return path


def test_the_host_driver_root_defaults_to_the_plugins_view_of_it() -> None:
    host_install = KubeletPluginSettings.parse(["--node-name=n"], {})
    same_path = KubeletPluginSettings.parse(
        ["--node-name=n", "--driver-root=/run/nvidia/driver"], {}
    )

    assert (host_install.driver_root, host_install.host_driver_root) == (
        Path("/"),
        PurePosixPath("/"),
    )
    assert same_path.host_driver_root == PurePosixPath("/run/nvidia/driver")
    assert host_install.nvidia_cdi_hook_path == "/usr/bin/nvidia-cdi-hook"
    assert host_install.disable_cdi_hooks == frozenset()


def test_nvidias_environment_names_set_the_driver_roots_and_the_hook_path() -> None:
    """NVIDIA's DaemonSet: the host root mounted at /driver-root, the hook copied to the host."""
    env = {
        "NVIDIA_DRIVER_ROOT": "/run/nvidia/driver",
        "CONTAINER_DRIVER_ROOT": "/driver-root",
        "NVIDIA_CDI_HOOK_PATH": "/var/lib/kubelet/plugins/gpu.nvidia.com/nvidia-cdi-hook",
    }

    settings = KubeletPluginSettings.parse(["--node-name=n"], env)

    assert settings.driver_root == Path("/driver-root")
    assert settings.host_driver_root == PurePosixPath("/run/nvidia/driver")
    assert settings.nvidia_cdi_hook_path == env["NVIDIA_CDI_HOOK_PATH"]
    ours = KubeletPluginSettings.parse(
        ["--node-name=n"],
        {**env, "GPU_DRA_DRIVER_ROOT": "/host", "GPU_DRA_NVIDIA_DRIVER_ROOT": "/"},
    )
    assert (ours.driver_root, ours.host_driver_root) == (Path("/host"), PurePosixPath("/"))


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--nvidia-driver-root=run/nvidia/driver", "--nvidia-driver-root must be an absolute"),
        ("--nvidia-cdi-hook-path=nvidia-cdi-hook", "--nvidia-cdi-hook-path must be an absolute"),
        ("--disable-cdi-hooks=update-ldcache,chmod", "unknown CDI hook(s) chmod"),
    ],
)
def test_bad_driver_root_and_hook_settings_are_usage_errors(
    capsys: pytest.CaptureFixture[str], flag: str, message: str
) -> None:
    assert message in usage_error(capsys, ["--node-name=n", flag], {})


def test_all_cdi_hooks_can_be_disabled() -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n", "--disable-cdi-hooks=all"], {})

    assert settings.disable_cdi_hooks == frozenset({"all"})


def test_mps_control_binary_is_found_on_path_first(tmp_path: Path) -> None:
    on_path = executable(tmp_path / "bin" / "nvidia-cuda-mps-control")
    executable(tmp_path / "root" / "usr" / "bin" / "nvidia-cuda-mps-control")
    settings = KubeletPluginSettings(node_name="n", driver_root=tmp_path / "root")

    assert settings.mps_control_binary == "nvidia-cuda-mps-control"
    assert settings.resolved_mps_control_binary(path=str(tmp_path / "bin")) == on_path


def test_mps_control_binary_is_found_under_the_driver_root(tmp_path: Path) -> None:
    under_root = executable(tmp_path / "root" / "usr" / "bin" / "nvidia-cuda-mps-control")
    settings = KubeletPluginSettings(node_name="n", driver_root=tmp_path / "root")

    assert settings.resolved_mps_control_binary(path=str(tmp_path / "empty")) == under_root


def test_mps_control_binary_path_is_used_as_given_and_missing_means_none(tmp_path: Path) -> None:
    given = executable(tmp_path / "my-mps-control")
    settings = KubeletPluginSettings(node_name="n", mps_control_binary=str(given))
    missing = KubeletPluginSettings(node_name="n", driver_root=tmp_path)

    assert settings.resolved_mps_control_binary(path="") == given
    assert missing.resolved_mps_control_binary(path=str(tmp_path)) is None
    assert (
        KubeletPluginSettings(
            node_name="n", mps_control_binary=str(tmp_path / "nope")
        ).resolved_mps_control_binary()
        is None
    )


def test_nvidia_smi_defaults_to_the_name_and_is_found_on_path_then_under_the_driver_root(
    tmp_path: Path,
) -> None:
    on_path = executable(tmp_path / "bin" / "nvidia-smi")
    under_root = executable(tmp_path / "root" / "usr" / "bin" / "nvidia-smi")
    settings = KubeletPluginSettings(node_name="n", driver_root=tmp_path / "root")

    assert settings.nvidia_smi == "nvidia-smi"
    assert settings.resolved_nvidia_smi(path=str(tmp_path / "bin")) == on_path
    assert settings.resolved_nvidia_smi(path=str(tmp_path / "empty")) == under_root


def test_nvidia_smi_path_is_used_as_given_and_missing_means_none(tmp_path: Path) -> None:
    given = executable(tmp_path / "my-nvidia-smi")

    assert (
        KubeletPluginSettings(node_name="n", nvidia_smi=str(given)).resolved_nvidia_smi() == given
    )
    assert (
        KubeletPluginSettings(node_name="n", driver_root=tmp_path).resolved_nvidia_smi(
            path=str(tmp_path)
        )
        is None
    )
    assert (
        KubeletPluginSettings(
            node_name="n", nvidia_smi=str(tmp_path / "nope")
        ).resolved_nvidia_smi()
        is None
    )


def test_nvidia_smi_has_an_environment_twin() -> None:
    settings = KubeletPluginSettings.parse(
        ["--node-name=n"], {"GPU_DRA_NVIDIA_SMI": "/x/nvidia-smi"}
    )

    assert settings.nvidia_smi == "/x/nvidia-smi"


def test_mps_shares_default_to_none_and_all_means_every_gpu() -> None:
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).mps_shares.empty
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).capped_shares.empty
    capped = KubeletPluginSettings.parse(["--node-name=n"], {"GPU_DRA_CAPPED_SHARES": "all"})
    assert capped.capped_shares == ShareSelection(every_gpu=True, flag="--capped-shares")
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).mps_shares_on_mig.empty
    on_mig = KubeletPluginSettings.parse(["--node-name=n"], {"GPU_DRA_MPS_SHARES_ON_MIG": "all"})
    assert on_mig.mps_shares_on_mig == MigShareSelection(every_device=True)
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).mps_shares_on_dynamic_mig.empty
    dynamic = KubeletPluginSettings.parse(
        ["--node-name=n"], {"GPU_DRA_MPS_SHARES_ON_DYNAMIC_MIG": "all"}
    )
    assert dynamic.mps_shares_on_dynamic_mig == PartitionShareSelection(every_partition=True)
    assert KubeletPluginSettings.parse(["--node-name=n", "--mps-shares=all"], {}).mps_shares == (
        ShareSelection(every_gpu=True)
    )


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--mps-shares=gpu-0", "neither a GPU index"),
        ("--mps-shares-on-mig=gpu-0", "neither a MIG profile"),
        ("--mps-shares-on-dynamic-mig=MIG-cb40a2a6", "a partition has no UUID"),
        ("--mps-shares-on-dynamic-mig=1c.3g.40gb", "not a MIG profile that dynamic MIG offers"),
        ("--mps-share-max-percent=0", "between 1 and 100"),
        ("--mps-share-max-percent=half", "whole percentage"),
        ("--mps-share-replicas=0", "--mps-share-replicas must be between 1 and 100, got 0"),
        ("--mps-share-replicas=101", "between 1 and 100, got 101"),
        ("--mps-share-replicas=four", "--mps-share-replicas must be a whole number"),
        ("--capped-shares=gpu-0", "--capped-shares: 'gpu-0' is neither a GPU index"),
        ("--mps-share-memory-limits=on", "must be auto or off"),
    ],
)
def test_bad_mps_share_settings_are_usage_errors(
    capsys: pytest.CaptureFixture[str], flag: str, message: str
) -> None:
    assert message in usage_error(capsys, ["--node-name=n", flag], {})


def test_mps_daemons_run_as_host_processes_exclusive_on_share_gpus_by_default() -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n"], {})

    assert settings.mps_daemon_runner == "process"
    assert settings.mps_exclusive_compute_mode == "shares"
    assert settings.mps_daemon_namespace == "gpu-dra"


def test_the_daemon_pod_namespace_defaults_to_the_plugins_own() -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n"], {"POD_NAMESPACE": "nvidia-dra"})

    assert settings.mps_daemon_namespace == "nvidia-dra"


def test_node_events_go_to_default_whatever_the_pods_namespace() -> None:
    """The apiserver refuses an Event about a Node (cluster-scoped) outside default and
    kube-system: the chart's release namespace would lose every start-up refusal."""
    settings = KubeletPluginSettings.parse(["--node-name=n"], {"POD_NAMESPACE": "nvidia-dra"})

    assert settings.event_namespace == "default"


@pytest.mark.parametrize("interval", ["0", "-5", "soon", "inf", "nan"])
def test_a_guard_recheck_interval_that_is_not_positive_seconds_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], interval: str
) -> None:
    error = usage_error(capsys, ["--node-name=n", f"--guard-recheck-interval={interval}"], {})

    assert f"--guard-recheck-interval must be seconds > 0, got {interval!r}" in error


def test_the_pod_runner_without_an_image_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = usage_error(capsys, ["--node-name=n"], {"GPU_DRA_MPS_DAEMON_RUNNER": "pod"})

    assert "--mps-daemon-runner=pod needs --mps-daemon-image" in error


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        pytest.param(["--mps-daemon-runner=deployment"], {}, id="flag"),
        pytest.param([], {"GPU_DRA_MPS_DAEMON_RUNNER": "deployment"}, id="env"),
    ],
)
def test_an_unknown_daemon_runner_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], env: dict[str, str]
) -> None:
    error = usage_error(capsys, ["--node-name=n", *argv], env)

    assert "deployment" in error
    assert "process" in error


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_the_daemon_check_interval_must_be_seconds_or_zero(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    error = usage_error(capsys, ["--node-name=n", f"--mps-daemon-check-interval={value}"], {})

    assert f"--mps-daemon-check-interval must be seconds >= 0 (0 = off), got '{value}'" in error


def test_share_memory_limits_are_auto_or_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).mps_share_memory_limits == "auto"
    error = usage_error(capsys, ["--node-name=n", "--mps-share-memory-limits=on"], {})

    assert "--mps-share-memory-limits must be auto or off, got 'on'" in error


def test_a_zero_check_interval_turns_supervision_off() -> None:
    settings = KubeletPluginSettings.parse(["--node-name=n", "--mps-daemon-check-interval=0"], {})

    assert settings.mps_daemon_check_interval_s == 0.0


@pytest.mark.parametrize(
    ("value", "mode"),
    [
        ("shares", "shares"),
        ("ALL", "all"),
        ("none", "none"),
        ("true", "all"),
        ("yes", "all"),
        ("false", "none"),
        ("0", "none"),
    ],
)
def test_exclusive_compute_mode_takes_shares_all_none_and_booleans(value: str, mode: str) -> None:
    argv = ["--node-name=n", f"--mps-exclusive-compute-mode={value}"]

    assert KubeletPluginSettings.parse(argv, {}).mps_exclusive_compute_mode == mode


def test_an_unknown_exclusive_compute_mode_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    error = usage_error(capsys, ["--node-name=n", "--mps-exclusive-compute-mode=sometimes"], {})

    assert (
        "--mps-exclusive-compute-mode must be one of shares, all, none (or true = all, "
        "false = none), got 'sometimes'"
    ) in error


def test_dynamic_mig_is_off_by_default_and_a_bare_flag_turns_it_on() -> None:
    assert not KubeletPluginSettings.parse(["--node-name=a"], {}).dynamic_mig_enabled
    assert KubeletPluginSettings.parse(["--node-name=a", "--dynamic-mig"], {}).dynamic_mig
    env = {"GPU_DRA_DYNAMIC_MIG": "false"}
    assert not KubeletPluginSettings.parse(["--node-name=a"], env).dynamic_mig


def test_nvidia_dynamic_mig_gate_turns_dynamic_mig_on_from_flag_or_feature_gates_env() -> None:
    by_flag = KubeletPluginSettings.parse(["--node-name=a", "--feature-gates=DynamicMIG=true"], {})
    by_env = KubeletPluginSettings.parse(["--node-name=a"], {"FEATURE_GATES": "DynamicMIG=true,"})
    off = KubeletPluginSettings.parse(["--node-name=a"], {"FEATURE_GATES": "DynamicMIG=false"})

    assert (by_flag.dynamic_mig, by_flag.dynamic_mig_enabled) == (False, True)
    assert by_env.dynamic_mig_enabled
    assert not off.dynamic_mig_enabled


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dynamic-mig=maybe"], "--dynamic-mig must be true or false, got 'maybe'"),
        (["--feature-gates=DynamicMig=true"], "unknown feature gate 'DynamicMig'"),
        (["--feature-gates=DynamicMIG"], "must be written Name=true|false"),
        (["--feature-gates=PassthroughSupport=true"], "PassthroughSupport is not implemented"),
        (["--slice-layout=flat"], "--slice-layout must be auto, split or combined"),
        (
            ["--dynamic-mig-profiles=1g,3g.40"],
            "--dynamic-mig-profiles: dynamic MIG profiles entry '1g,3g.40': '3g.40' is not a "
            "MIG profile",
        ),
        (["--dynamic-mig-profiles=;"], "--dynamic-mig-profiles: dynamic MIG profiles ';': no"),
        (["--dynamic-mig-profiles=1g;3g"], "two entries without a model"),
    ],
)
def test_bad_dynamic_mig_settings_are_usage_errors(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert message in usage_error(capsys, ["--node-name=a", *argv], {})


def test_dynamic_mig_profiles_default_to_the_balanced_shapes_and_read_the_environment() -> None:
    assert KubeletPluginSettings.parse(["--node-name=a"], {}).dynamic_mig_profiles == DEFAULT
    env = {"GPU_DRA_DYNAMIC_MIG_PROFILES": "all"}
    assert KubeletPluginSettings.parse(["--node-name=a"], env).dynamic_mig_profiles == EVERYTHING


def test_slice_layout_auto_leaves_the_choice_to_the_apiserver_version() -> None:
    assert KubeletPluginSettings.parse(["--node-name=a"], {}).slice_layout is None
    split = KubeletPluginSettings.parse(["--node-name=a", "--slice-layout=split"], {})
    assert split.slice_layout is SliceLayout.SPLIT


@pytest.mark.parametrize(("value", "policy"), [("always", "always"), ("off", "off"),
                                               ("idle:90s", "idle:90s")])  # fmt: skip
def test_mps_share_daemon_warm_is_parsed(value: str, policy: str) -> None:
    settings = KubeletPluginSettings.parse(
        ["--node-name=n", f"--mps-share-daemon-warm={value}"], {}
    )
    assert str(settings.mps_share_daemon_warm) == policy


def test_mps_share_daemon_warm_is_always_by_default() -> None:
    policy = KubeletPluginSettings.parse(["--node-name=n"], {}).mps_share_daemon_warm
    assert policy.warm
    assert policy.idle_s is None


@pytest.mark.parametrize("value", ["on", "idle:", "idle:5", "idle:0s"])
def test_a_bad_mps_share_daemon_warm_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    error = usage_error(capsys, ["--node-name=n", f"--mps-share-daemon-warm={value}"], {})
    assert "--mps-share-daemon-warm" in error


def test_a_share_is_a_quarter_of_its_device_by_default_and_the_env_sets_it() -> None:
    assert KubeletPluginSettings.parse(["--node-name=n"], {}).mps_share_replicas == 4
    settings = KubeletPluginSettings.parse(["--node-name=n"], {"GPU_DRA_MPS_SHARE_REPLICAS": "2"})
    assert settings.mps_share_replicas == 2


def test_replicas_whose_part_is_larger_than_the_largest_share_are_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # A third of a GPU is more than 33 % of its memory (81559Mi / 3 > 81559Mi * 33 / 100).
    args = ["--node-name=n", "--mps-share-replicas=3", "--mps-share-max-percent=33"]
    assert (
        usage_error(capsys, args, {})
        .rstrip()
        .endswith(
            "--mps-share-replicas=3 makes an amount a share does not name 1/3 of its device, more "
            "than --mps-share-max-percent=33 allows, so every such share would be refused at "
            "prepare; use at least 4 replicas or a larger max percent"
        )
    )
    fits = ["--node-name=n", "--mps-share-replicas=2", "--mps-share-max-percent=50"]
    assert KubeletPluginSettings.parse(fits, {}).mps_share_replicas == 2
