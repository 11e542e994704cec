"""Certificates and kubeconfigs for the e2e cluster: one CA, client certificates per identity.

Uses the openssl CLI. Identities follow the Node+RBAC conventions: the kubelet is
`system:node:<node>` in `system:nodes`, the scheduler and controller manager use their built-in
user names, tests and the demo act as a `system:masters` admin.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import yaml

from e2e.cluster import versions

DAYS = "3650"


@dataclass(frozen=True)
class Identity:
    name: str  # file stem
    common_name: str
    organization: str | None = None


IDENTITIES = (
    Identity("admin", "gpu-dra-admin", "system:masters"),
    Identity("kubelet", f"system:node:{versions.NODE_NAME}", "system:nodes"),
    Identity("scheduler", "system:kube-scheduler"),
    Identity("controller-manager", "system:kube-controller-manager"),
    Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", "system:masters"),
    Identity("gpu-dra-driver", "gpu-dra-driver"),
)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True)


def _sign(pki: Path, stem: str, subject: str, extensions: str) -> None:
    key, csr, crt, ext = (pki / f"{stem}.{s}" for s in ("key", "csr", "crt", "ext"))
    _openssl("genrsa", "-out", str(key), "2048")
    _openssl("req", "-new", "-key", str(key), "-subj", subject, "-out", str(csr))
    ext.write_text(extensions)
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(pki / "ca.crt"), "-CAkey", str(pki / "ca.key"),
        "-CAcreateserial", "-days", DAYS, "-sha256", "-extfile", str(ext), "-out", str(crt),
    )  # fmt: skip
    csr.unlink()
    ext.unlink()


def create(pki: Path) -> None:
    """Create the CA, the apiserver serving cert, client certs and the service-account key."""
    if (pki / "ca.crt").exists() and (pki / "sa.key").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)
    pki.chmod(0o700)
    _openssl("genrsa", "-out", str(pki / "ca.key"), "2048")
    _openssl(
        "req", "-x509", "-new", "-key", str(pki / "ca.key"), "-subj", "/CN=gpu-dra-e2e-ca",
        "-days", DAYS, "-sha256", "-out", str(pki / "ca.crt"),
    )  # fmt: skip
    sans = ",".join(
        [
            f"IP:{versions.NODE_IP}",
            "IP:127.0.0.1",
            f"IP:{versions.SERVICE_IP}",
            "DNS:kubernetes",
            "DNS:kubernetes.default",
            "DNS:kubernetes.default.svc",
            "DNS:localhost",
        ]
    )
    _sign(
        pki,
        "apiserver",
        "/CN=kube-apiserver",
        f"subjectAltName={sans}\nextendedKeyUsage=serverAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
    )
    for identity in IDENTITIES:
        subject = f"/CN={identity.common_name}"
        if identity.organization:
            subject = f"/O={identity.organization}{subject}"
        _sign(
            pki,
            identity.name,
            subject,
            "extendedKeyUsage=clientAuth\nkeyUsage=digitalSignature,keyEncipherment\n",
        )
    _openssl("genrsa", "-out", str(pki / "sa.key"), "2048")
    _openssl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))


def write_kubeconfig(path: Path, pki: Path, identity: str, *, server: str | None = None) -> None:
    """A kubeconfig for `identity`'s client certificate; `server` defaults to the e2e
    cluster's apiserver (bench/scheduler_scale.py passes its own)."""
    server = server or f"https://{versions.NODE_IP}:{versions.APISERVER_PORT}"
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "gpu-dra-e2e",
                "cluster": {"server": server, "certificate-authority": str(pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": identity,
                "user": {
                    "client-certificate": str(pki / f"{identity}.crt"),
                    "client-key": str(pki / f"{identity}.key"),
                },
            }
        ],
        "contexts": [
            {"name": "gpu-dra-e2e", "context": {"cluster": "gpu-dra-e2e", "user": identity}}
        ],
        "current-context": "gpu-dra-e2e",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
