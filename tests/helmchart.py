"""Rendering the Helm chart (deployments/helm/gpu-dra) with the pinned helm, and reading what it
rendered: the objects by kind, what a ServiceAccount may do under the rendered RBAC, what the
rendered ValidatingAdmissionPolicy decides for a request, and which requests the rendered
admission webhook is sent (their CEL run on cel-expr-python)."""

from __future__ import annotations

import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from cel_expr_python import cel  # type: ignore[import-untyped]
from cel_expr_python.ext import ext_strings  # type: ignore[import-untyped]
from google.protobuf import descriptor_pool

from e2e import helm
from e2e.cluster.paths import ClusterPaths

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "deployments" / "helm" / "gpu-dra"
RELEASE = "gpu-dra"
NAMESPACE = "gpu-dra"

Obj = dict[str, Any]


@cache
def helm_binary() -> Path:
    """The pinned helm (built from e2e/toolchain/helm unless cached; needs Go then)."""
    return helm.binary(ClusterPaths.from_env())


def run_helm(args: Sequence[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm_binary()), *args], capture_output=True, text=True, timeout=120, check=False
    )


def template(values: Path | None = None, *sets: str) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart as release `RELEASE` in `NAMESPACE`."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if values is not None:
        args += ["--values", str(values)]
    for item in sets:
        args += ["--set", item]
    return run_helm(args)


@dataclass(frozen=True)
class Rendered:
    objects: tuple[Obj, ...]

    @classmethod
    def of(cls, values: Mapping[str, Any], tmp: Path, *sets: str) -> Rendered:
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(dict(values)))
        result = template(path, *sets)
        assert result.returncode == 0, result.stderr
        return cls(tuple(d for d in yaml.safe_load_all(result.stdout) if d))

    def all(self, kind: str) -> list[Obj]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> Obj:
        (found,) = [o for o in self.all(kind) if name is None or o["metadata"]["name"] == name]
        return found

    def pod_spec(self, kind: str) -> Obj:
        spec: Obj = self.one(kind)["spec"]["template"]["spec"]
        return spec

    def container(self, kind: str, name: str, init: bool = False) -> Obj:
        containers = self.pod_spec(kind)["initContainers" if init else "containers"]
        (found,) = [c for c in containers if c["name"] == name]
        return found

    def volume(self, kind: str, name: str) -> Obj:
        (found,) = [v for v in self.pod_spec(kind)["volumes"] if v["name"] == name]
        return found

    def may(
        self,
        service_account: str,
        verb: str,
        resource: str,
        namespace: str = "",
        name: str | None = None,
    ) -> bool:
        """Whether the rendered RBAC lets `service_account` (of `NAMESPACE`) do `verb` on
        `resource` ("pods", "resource.k8s.io/resourceslices",
        "resource.k8s.io/resourceclaims/status"); `namespace` "" = cluster-wide
        resources; `name` the object (None: any object, as for list or create), which a rule
        with resourceNames must name. Rules with nonResourceURLs are not rendered (asserted)."""
        head, _, rest = resource.partition("/")
        group, plural = (head, rest) if "." in head else ("", resource)
        subject = {"kind": "ServiceAccount", "name": service_account, "namespace": NAMESPACE}
        for binding in self.all("ClusterRoleBinding") + self.all("RoleBinding"):
            if subject not in binding["subjects"]:
                continue
            bound_in = binding["metadata"].get("namespace", "")
            if bound_in and bound_in != namespace:
                continue
            ref = binding["roleRef"]
            role_namespace = "" if ref["kind"] == "ClusterRole" else bound_in
            role = [
                r
                for r in self.all(ref["kind"])
                if r["metadata"]["name"] == ref["name"]
                and r["metadata"].get("namespace", "") == role_namespace
            ]
            for rule in role[0]["rules"] if role else []:
                assert "nonResourceURLs" not in rule
                if "resourceNames" in rule and name not in rule["resourceNames"]:
                    continue
                if (
                    group in rule["apiGroups"]
                    and plural in rule["resources"]
                    and (verb in rule["verbs"] or "*" in rule["verbs"])
                ):
                    return True
        return False


NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"


@dataclass(frozen=True)
class Decision:
    allowed: bool
    message: str = ""


class AdmissionPolicy:
    """A rendered ValidatingAdmissionPolicy, evaluated as the apiserver does: every match
    condition true, then the validations in order; the first false one denies with its message
    (or messageExpression). Variables are computed in order and reachable as ``variables.x``."""

    def __init__(self, policy: Obj) -> None:
        self.spec: Obj = policy["spec"]
        self._env = cel.NewEnv(
            descriptor_pool.DescriptorPool(),
            variables={
                v: cel.Type.DYN
                for v in (
                    "request",
                    "object",
                    "oldObject",
                    "namespaceObject",
                    "params",
                    "variables",
                )
            },
            functions=[],
            extensions=[ext_strings.ExtStrings()],
        )

    def matches(self, group: str, resource: str, operation: str) -> bool:
        rules = self.spec["matchConstraints"]["resourceRules"]
        return any(
            group in rule["apiGroups"]
            and resource in rule["resources"]
            and operation in rule["operations"]
            for rule in rules
        )

    def decide(
        self,
        *,
        user: str,
        node: str | None,
        operation: str,
        resource: str,
        obj: Obj | None = None,
        old: Obj | None = None,
        sub_resource: str = "",
        namespace: Obj | None = None,
        dry_run: bool = False,
        params: Obj | None = None,
    ) -> Decision:
        """`namespace`: the request's Namespace object (``namespaceObject``); `sub_resource`
        e.g. ``eviction``; `dry_run` the request's ``dryRun``; `params` the binding's parameter
        object (the policy's ``paramKind``)."""
        extra = {NODE_NAME_EXTRA: [node]} if node is not None else {}
        namespace_name = ((namespace or {}).get("metadata") or {}).get("name", "")
        data: dict[str, Any] = {
            "request": {
                "operation": operation,
                "resource": {"resource": resource},
                "subResource": sub_resource,
                "namespace": namespace_name,
                "dryRun": dry_run,
                "userInfo": {"username": user, "extra": extra},
            },
            "object": obj,
            "oldObject": old,
            "namespaceObject": namespace,
            "params": params,
            "variables": {},
        }
        for condition in self.spec.get("matchConditions", []):
            if self._eval(condition["expression"], data) is not True:
                return Decision(True, "not matched")
        for variable in self.spec.get("variables", []):
            data["variables"] = {
                **data["variables"],
                variable["name"]: self._eval(variable["expression"], data),
            }
        for validation in self.spec["validations"]:
            if self._eval(validation["expression"], data) is not True:
                message = validation.get("message", "")
                if "messageExpression" in validation:
                    message = str(self._eval(validation["messageExpression"], data))
                return Decision(False, message)
        return Decision(True)

    def _eval(self, expression: str, data: Mapping[str, Any]) -> Any:
        result = self._env.compile(expression).eval(data=dict(data))
        assert result.type() != cel.Type.ERROR, f"{expression}: {result.value()}"
        return result.plain_value()


def webhook_called(
    webhook: Obj, *, user: str, obj: Obj, operation: str = "CREATE", resource: str = ""
) -> bool:
    """Whether the apiserver sends a request to `webhook` (one entry of a rendered
    ValidatingWebhookConfiguration): a rule matches and every match condition is true. A
    condition that does not evaluate fails the test (the apiserver would apply failurePolicy)."""
    rules = webhook["rules"]
    plural = resource or _plural(obj["kind"])
    version = obj["apiVersion"].rpartition("/")[2]
    if not any(
        plural in rule["resources"]
        and version in rule["apiVersions"]
        and operation in rule["operations"]
        and obj["apiVersion"].startswith(tuple(f"{g}/" for g in rule["apiGroups"]))
        for rule in rules
    ):
        return False
    env = cel.NewEnv(
        descriptor_pool.DescriptorPool(),
        variables={v: cel.Type.DYN for v in ("request", "object", "oldObject")},
        functions=[],
        extensions=[],
    )
    data = {
        "request": {"operation": operation, "userInfo": {"username": user}},
        "object": obj,
        "oldObject": None,
    }
    for condition in webhook.get("matchConditions", []):
        result = env.compile(condition["expression"]).eval(data=data)
        assert result.type() != cel.Type.ERROR, f"{condition['expression']}: {result.value()}"
        if result.plain_value() is not True:
            return False
    return True


def _plural(kind: str) -> str:
    return kind.lower() + ("es" if kind.endswith("s") else "s")


def env_of(container: Obj, downward: Mapping[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet would give it: literal values, and `downward`
    for the ``valueFrom`` entries (by name; each must be given)."""
    env = {}
    for item in container["env"]:
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            env[item["name"]] = downward[item["name"]]
    return env
