"""The demo's examples and stages, checked without a cluster: every example runs in exactly one
stage, its opaque configs and CEL selectors pass `gpu-dra check-config` and `gpu-dra lint`, each
stage's plugin flags are accepted on the demo node and publish what its examples need, the chart
values the demo installs each stage with (rendered by the pinned helm) give the plugin pod
exactly those flags, and the claims the utilization step makes busy or expects idle are the last
stage's. (e2e/test_demo_examples.py runs the examples on the real local cluster.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from demo.idle import ADVICE, BURST_GPU, CONTEXT_MEMORY, IDLE_FOR, NOTEBOOK
from demo.install import UTILIZATION_INTERVAL_S, plugin_env, stage_values
from demo.observe import why_not_running
from demo.quotas import TEAMS
from demo.stages import (
    MPS_SHARE_GPU,
    PROFILE,
    STAGES,
    Stage,
    example_dirs,
    namespace_of,
    published_devices,
    stage_of,
)
from demo.utilization import (
    BUSY_GPU_CLAIM,
    BUSY_SHARE_CLAIM,
    BUSY_SHARE_MEMORY,
    IDLE_CLAIMS,
    IDLE_NAMESPACE,
)
from e2e.cluster import Cluster
from e2e.driver import DATA_DIR_LINK
from e2e.quotas import QUOTAS
from gpu_dra.cli.__main__ import main
from gpu_dra.cli.command import EXIT_OK
from gpu_dra.controller.settings import ControllerSettings
from gpu_dra.driver.cluster.idle_policy import (
    GRACE_ANNOTATION,
    LABEL,
    WINDOW_ANNOTATION,
    parse_duration,
)
from gpu_dra.driver.config.quantity import quantity_value
from gpu_dra.driver.rightsizing import Held, Observed, advise, gpu_shape, offered_options
from gpu_dra.kubelet_plugin.settings import KubeletPluginSettings
from tests.helmchart import Rendered, env_of

EXAMPLES = example_dirs()


def test_every_example_runs_in_exactly_one_stage_in_the_examples_order() -> None:
    assert [name for stage in STAGES for name in stage.examples] == [p.name for p in EXAMPLES]
    for example in EXAMPLES:
        assert stage_of(example).examples.count(example.name) == 1
        assert (example / "README.md").read_text().startswith("# ")
    namespaces = [namespace_of(example) for example in EXAMPLES]
    assert len(set(namespaces)) == len(namespaces)  # a stage deletes exactly its examples


def test_an_example_in_no_stage_is_named() -> None:
    with pytest.raises(ValueError, match=r"10-new is in no stage of demo/stages\.py"):
        stage_of(PROFILE.parent / "examples" / "10-new")


def test_examples_pass_check_config_and_lint_on_the_demo_node(
    capsys: pytest.CaptureFixture[str],
) -> None:
    files = [str(example / "example.yaml") for example in EXAMPLES]
    assert main(["check-config", *files], environ={}) == EXIT_OK, capsys.readouterr().out
    capsys.readouterr()
    code = main(["lint", "--profile", str(PROFILE), "deviceclasses", *files], environ={})
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    assert "ERROR" not in out


@pytest.mark.parametrize("stage", STAGES, ids=[s.flags for s in STAGES])
def test_each_stage_flags_publish_what_its_examples_ask_for(stage: Stage) -> None:
    published = published_devices(stage)
    types = {d["attributes"]["type"]["string"] for d in published}
    shared = [d for d in published if d.get("allowMultipleAllocations")]
    if "06-dynamic-mig" in stage.examples:
        assert "mig" in types
    if "07-mps-shares" in stage.examples:
        assert f"--mps-shares={MPS_SHARE_GPU}" in stage.plugin_args
    if f"--mps-shares={MPS_SHARE_GPU}" in stage.plugin_args:
        assert [d["name"] for d in shared] == [f"gpu-{MPS_SHARE_GPU}"]
        assert shared[0]["attributes"]["productName"]["string"] == "NVIDIA A100 80GB PCIe"
    else:
        assert shared == []


def test_plugin_flags_become_their_environment_twins() -> None:
    assert plugin_env(("--mps-shares=4", "--dynamic-mig", "--mps-share-daemon-warm=off")) == [
        {"name": "GPU_DRA_MPS_SHARES", "value": "4"},
        {"name": "GPU_DRA_DYNAMIC_MIG", "value": "true"},
        {"name": "GPU_DRA_MPS_SHARE_DAEMON_WARM", "value": "off"},
    ]
    with pytest.raises(ValueError, match="not a plugin flag: 'mps-shares=4'"):
        plugin_env(("mps-shares=4",))


DEMO_PROFILE = "/var/lib/kubelet/plugins/gpu.nvidia.com/demo-node.yaml"
MPS_CONTROL = Path("/var/lib/kubelet/plugins/gpu.nvidia.com/e2e-mps-double/bin/x")
DOWNWARD = {"NODE_NAME": "node-1", "POD_NAMESPACE": "gpu-dra", "POD_UID": "0-1-2"}


@pytest.mark.parametrize("stage", STAGES, ids=[s.flags for s in STAGES])
def test_each_stages_chart_values_give_the_plugin_pod_the_stages_flags(
    stage: Stage, tmp_path: Path
) -> None:
    cluster = Cluster()
    values = stage_values(
        cluster, "localhost/gpu-dra:0123456789ab", stage,
        profile=DEMO_PROFILE, mps_control=MPS_CONTROL, mps_image="localhost/mps-double:1",
    )  # fmt: skip
    rendered = Rendered.of(values, tmp_path)
    container = rendered.container("DaemonSet", "gpus")
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))  # helm 4's server-side apply refuses a repeated name

    pod = KubeletPluginSettings.parse([], env_of(container, DOWNWARD))
    flags = KubeletPluginSettings.parse(
        ["--node-name=node-1", f"--simulate={DEMO_PROFILE}", *stage.plugin_flags], env={}
    )

    assert container["image"] == "localhost/gpu-dra:0123456789ab"
    assert pod.simulate == DEMO_PROFILE
    assert pod.dynamic_mig_enabled == flags.dynamic_mig_enabled == stage.dynamic_mig
    assert pod.dynamic_mig_profiles == flags.dynamic_mig_profiles  # what the demo waits for
    assert pod.mps_shares == flags.mps_shares
    assert pod.mps_control_binary == str(MPS_CONTROL)
    assert pod.mps_daemon_image == "localhost/mps-double:1"
    assert pod.utilization_interval_s == UTILIZATION_INTERVAL_S
    assert pod.data_dir == cluster.paths.state / DATA_DIR_LINK
    # The idle-reclaim stage's quick claim status and the controller's idle policy; off else.
    controller = ControllerSettings.from_env(
        env_of(
            rendered.container("Deployment", "controller"),
            {"GPU_DRA_LEADER_ELECTION_IDENTITY": "c-0"},
        )
    )
    assert controller.idle_reclaim is stage.idle_reclaim
    if stage.idle_reclaim:
        assert (pod.claim_status_min_interval_s, pod.claim_status_idle_after_s) == (5, 10)
        assert controller.idle_reclaim_interval_s == 5
        assert controller.idle_reclaim_max_sample_age_s == 3 * (5 + 1 + 2)


def stage_objects(stage: Stage) -> list[dict[str, Any]]:
    return [
        document
        for example in stage.example_dirs()
        for document in yaml.safe_load_all((example / "example.yaml").read_text())
        if document
    ]


def test_the_utilization_step_names_claims_and_pods_of_its_stage() -> None:
    (stage,) = [s for s in STAGES if s.shows_utilization]
    objects = stage_objects(stage)
    claims = {
        (o["metadata"]["namespace"], o["metadata"]["name"]): o
        for o in objects
        if o["kind"] == "ResourceClaim"
    }
    assert BUSY_GPU_CLAIM in claims
    assert set(IDLE_CLAIMS) <= set(claims)
    assert {BUSY_GPU_CLAIM, BUSY_SHARE_CLAIM}.isdisjoint(IDLE_CLAIMS)
    assert IDLE_NAMESPACE in {o["metadata"]["name"] for o in objects if o["kind"] == "Namespace"}
    # The busy share: an MPS share whose pod of the same name uses it, with room for its memory.
    (request,) = claims[BUSY_SHARE_CLAIM]["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "mps.gpu.nvidia.com"
    assert quantity_value(request["exactly"]["capacity"]["requests"]["memory"]) > BUSY_SHARE_MEMORY
    (pod,) = [
        o
        for o in objects
        if o["kind"] == "Pod"
        and (o["metadata"]["namespace"], o["metadata"]["name"]) == BUSY_SHARE_CLAIM
    ]
    assert [c["resourceClaimName"] for c in pod["spec"]["resourceClaims"]] == [BUSY_SHARE_CLAIM[1]]


def test_a_pod_that_does_not_run_is_explained_by_its_conditions_and_containers() -> None:
    pending = {
        "metadata": {"name": "large"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": "0/1 nodes are available: 1 cannot allocate all claims."},
                {"type": "Initialized", "status": "True"},
            ],
        },
    }  # fmt: skip
    crashing = {
        "metadata": {"name": "small"},
        "status": {
            "phase": "Pending",
            "containerStatuses": [
                {"name": "ctr", "state": {"waiting": {"reason": "CreateContainerError",
                                                     "message": "CDI device not found"}}},
            ],
        },
    }  # fmt: skip

    assert why_not_running(pending) == (
        "large: Pending, PodScheduled: Unschedulable: "
        "0/1 nodes are available: 1 cannot allocate all claims."
    )
    assert why_not_running(crashing) == (
        "small: Pending, container ctr waiting: CreateContainerError CDI device not found"
    )
    assert why_not_running({"metadata": {"name": "new"}, "status": {}}) == "new: no phase"


def test_the_idle_reclaim_step_names_the_notebook_of_its_stage_and_the_advice_it_gets() -> None:
    """The last stage (its examples keep running) turns the idle policy on; its notebook's
    namespace opted in with the window the step waits for; the claim asks for a whole H100 on
    which the stage's flags publish 1g.10gb partitions, the advice the right-sizing rule gives
    for the notebook's peak."""
    (stage,) = [s for s in STAGES if s.idle_reclaim]
    assert stage is STAGES[-1]
    objects = stage_objects(stage)
    (namespace,) = [o for o in objects if o["kind"] == "Namespace"]
    assert namespace["metadata"]["name"] == NOTEBOOK[0]
    assert namespace["metadata"]["labels"][LABEL] == "enabled"
    annotations = namespace["metadata"]["annotations"]
    assert annotations[WINDOW_ANNOTATION] == IDLE_FOR
    # warned long before it would be evicted: the demo shows a warned, running pod
    assert parse_duration(annotations[GRACE_ANNOTATION]) >= 300
    (claim,) = [o for o in objects if o["kind"] == "ResourceClaim"]
    assert claim["metadata"]["name"] == NOTEBOOK[1]
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "hopper.gpu.nvidia.com"
    (pod,) = [o for o in objects if o["kind"] == "Pod"]
    assert pod["metadata"]["name"] == NOTEBOOK[1]

    product = "NVIDIA H100 80GB HBM3"
    offered = offered_options(published_devices(stage), product, "gpu.nvidia.com")
    shape = gpu_shape(product)
    assert shape is not None
    advice = advise(shape, Observed(CONTEXT_MEMORY, BURST_GPU, 1), Held("gpu"))
    recommended = advice.recommended(offered)
    assert recommended is not None
    assert recommended.text() == ADVICE
    assert "gpu" in offered  # the notebook's whole H100 is offered too


def test_the_teams_are_the_recipes_quotas_on_the_last_stage() -> None:
    """demo/quotas.py applies deployments/quotas/<team>.yaml to namespace <team>, beside the
    last stage's examples (their namespaces differ), after everything else."""
    assert {path.stem for path in QUOTAS.glob("*.yaml")} == set(TEAMS)
    assert not set(TEAMS) & {namespace_of(example) for example in EXAMPLES}
    assert [stage.shows_quotas for stage in STAGES] == [False] * (len(STAGES) - 1) + [True]
