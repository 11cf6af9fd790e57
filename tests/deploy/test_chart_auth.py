"""The chart and the manifests are secure by default: a token for every sidecar and worker, /metrics
behind it, and no render without credentials unless `insecure: true` says so."""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import ROOT, load_docs, render_chart, run, tool, validate_manifests
from .test_chart import SCHEMA, _opts, _render_values, check_worker_pod, pod_specs, sidecar_settings, sidecars


def _secret_volumes(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v["secret"] for v in spec["volumes"] if "secret" in v}


def _token_wiring(spec: dict[str, Any]) -> set[tuple[str, str]]:
    """(Secret name, key) behind the token file of every sidecar, its drain, and the vLLM worker
    (all of which must name the same file, mounted from that Secret)."""
    secrets = _secret_volumes(spec)
    found: set[tuple[str, str]] = set()

    def source(container: dict[str, Any], path: str) -> tuple[str, str]:
        directory, name = path.rsplit("/", 1)
        (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
        assert mount.get("readOnly") is True, container["name"]
        secret = secrets[mount["name"]]
        (item,) = [i for i in secret["items"] if i["path"] == name]
        return secret["secretName"], item["key"]

    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    for sidecar in sidecars(spec):
        path = _opts(sidecar)["--token-file"]
        drain = sidecar["lifecycle"]["preStop"]["exec"]["command"]
        assert f"--token-file={path}" in drain, sidecar["name"]
        assert env["KVXFER_TOKEN_FILE"] == path
        found |= {source(sidecar, path), source(vllm, path)}
    return found


def test_default_render_creates_a_token_and_wires_it_to_every_sidecar_and_worker(
    helm_render: Path, tmp_path: Path
) -> None:
    docs = _render_values(helm_render, tmp_path, {"prefill": {"vllm": {"tensorParallelSize": 2}}})
    validate_manifests(docs, tmp_path)
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == "kvxfer-token"
    assert secret["type"] == "Opaque"
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token), "48 random letters and digits"
    pods = pod_specs(docs)
    assert [len(sidecars(spec)) for spec in pods.values()] == [2, 1]
    for role, spec in pods.items():
        check_worker_pod(role, spec)
        assert _token_wiring(spec) == {("kvxfer-token", "token")}, role
        for sidecar in sidecars(spec):
            assert "--metrics-auth=token" in sidecar["args"]
            assert not any(a.startswith("--insecure") for a in sidecar["args"])
    # Each Deployment's pods carry the token's checksum: a new token rolls every pod onto it together.
    checksum = hashlib.sha256(token.encode()).hexdigest()
    for d in docs:
        if d["kind"] == "Deployment":
            assert d["spec"]["template"]["metadata"]["annotations"]["kvxfer.io/token-checksum"] == checksum


def test_every_render_without_a_cluster_makes_a_new_token(helm_render: Path) -> None:
    """`helm template` cannot look the Secret up; `helm upgrade` keeps the one in the cluster."""
    tokens = set()
    for _ in range(2):
        out = render_chart(helm_render)
        assert out.returncode == 0, out.stderr
        (secret,) = [d for d in load_docs(out.stdout) if d["kind"] == "Secret"]
        tokens.add(secret["data"]["token"])
    assert len(tokens) == 2
    template = (ROOT / "helm" / "kvxfer" / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace (include "kvxfer.tokenSecretName" .)' in template


def test_an_existing_secret_is_used_and_none_created(helm_render: Path, tmp_path: Path) -> None:
    docs = _render_values(helm_render, tmp_path, {"auth": {"secretName": "shared-kv-token", "tokenKey": "bearer"}})
    validate_manifests(docs, tmp_path)
    assert [d for d in docs if d["kind"] == "Secret"] == []
    for role, spec in pod_specs(docs).items():
        check_worker_pod(role, spec)
        assert _token_wiring(spec) == {("shared-kv-token", "bearer")}, role
        for sidecar in sidecars(spec):
            assert _opts(sidecar)["--token-file"] == "/etc/kvxfer/auth/bearer"
    for d in docs:
        if d["kind"] == "Deployment":
            assert "kvxfer.io/token-checksum" not in d["spec"]["template"]["metadata"].get("annotations", {})


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_monitors_send_the_token(monitor: str, helm_render: Path, tmp_path: Path) -> None:
    docs = _render_values(helm_render, tmp_path, {"metrics": {monitor: {"enabled": True}}})
    validate_manifests(docs, tmp_path)
    (mon,) = [d for d in docs if d["kind"] in {"ServiceMonitor", "PodMonitor"}]
    for endpoint in mon["spec"]["endpoints" if monitor == "serviceMonitor" else "podMetricsEndpoints"]:
        assert endpoint["authorization"] == {"type": "Bearer", "credentials": {"name": "kvxfer-token", "key": "token"}}
    docs = _render_values(helm_render, tmp_path, {"metrics": {monitor: {"enabled": True}, "auth": "none"}})
    (mon,) = [d for d in docs if d["kind"] in {"ServiceMonitor", "PodMonitor"}]
    for endpoint in mon["spec"]["endpoints" if monitor == "serviceMonitor" else "podMetricsEndpoints"]:
        assert "authorization" not in endpoint
    for spec in pod_specs(docs).values():
        assert all("--metrics-auth=none" in c["args"] for c in sidecars(spec))


def test_insecure_is_explicit_and_reaches_the_sidecars(helm_render: Path, tmp_path: Path) -> None:
    docs = _render_values(
        helm_render, tmp_path, {"auth": {"enabled": False}, "insecure": True, "metrics": {"auth": "none"}}
    )
    assert [d for d in docs if d["kind"] == "Secret"] == []
    for role, spec in pod_specs(docs).items():
        check_worker_pod(role, spec)
        assert "kvxfer-auth" not in _secret_volumes(spec)
        for settings in sidecar_settings(spec, tmp_path):
            assert settings.insecure is True
            assert settings.token_file is None
            assert settings.peer_listen.startswith("0.0.0.0:")


def test_mutual_tls_alone_needs_no_insecure(helm_render: Path, tmp_path: Path) -> None:
    docs = _render_values(
        helm_render, tmp_path,
        {"auth": {"enabled": False}, "tls": {"enabled": True, "secretName": "kv-tls"}, "metrics": {"auth": "none"}},
    )  # fmt: skip
    for role, spec in pod_specs(docs).items():
        check_worker_pod(role, spec)
        for sidecar in sidecars(spec):
            assert not any(a.startswith("--insecure") for a in sidecar["args"])
        # kvxfer's own settings loader, as `kvxfer serve` runs in the pod, accepts them.
        for settings in sidecar_settings(spec, tmp_path):
            assert settings.tls_ca is not None
            assert settings.insecure is False


def _notes(helm_render: Path, tmp_path: Path, values: dict[str, Any]) -> str:
    path = tmp_path / "notes-values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = render_chart(helm_render, path, extra=["-notes"])
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\nNOTES:\n", 1)[1]


def test_notes_say_how_metrics_and_peers_are_protected(helm_render: Path, tmp_path: Path) -> None:
    notes = _notes(helm_render, tmp_path, {})
    assert '/metrics needs "Authorization: Bearer <token>" (metrics.auth: token)' in notes
    assert "Secret kvxfer-token; the ServiceMonitor/PodMonitor send it" in notes
    assert "the shared token of Secret kvxfer-token (key token), made by the chart" in notes
    assert "kubectl -n kvxfer get secret kvxfer-token -o jsonpath='{.data.token}' | base64 -d" in notes
    assert "WARNING" not in notes
    notes = _notes(helm_render, tmp_path, {"auth": {"secretName": "mine"}, "metrics": {"auth": "none"}})
    assert "/metrics is open to whoever reaches the pods (metrics.auth: none)" in notes
    assert "the shared token of Secret mine (key token)," in notes
    assert "made by the chart" not in notes
    notes = _notes(helm_render, tmp_path, {"auth": {"enabled": False}, "insecure": True, "metrics": {"auth": "none"}})
    assert "WARNING:         neither the token nor mutual TLS (insecure: true)" in notes


@pytest.mark.parametrize(
    ("values", "word"),
    [
        ({"metrics": {"auth": "basic"}}, "basic"),
        ({"insecure": "yes"}, "yes"),
        ({"auth": {"secretName": "Not_A_Secret"}}, "Not_A_Secret"),
        ({"auth": {"tokenKey": ""}}, "tokenKey"),
    ],
    ids=["metrics-auth-enum", "insecure-not-bool", "secret-name-not-dns", "empty-token-key"],
)
def test_schema_refuses_bad_auth_values(values: dict[str, Any], word: str, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = run([tool("check-jsonschema"), "--schemafile", str(SCHEMA), str(path)])
    assert out.returncode != 0, f"{values} was accepted"
    assert word in out.stdout + out.stderr or "''" in out.stdout + out.stderr, out.stdout + out.stderr


# ------------------------------------------------------------------------------ kustomize
def test_manifests_take_the_token_from_the_documented_secret() -> None:
    """deploy/: no token is committed; every sidecar, drain, worker and the ServiceMonitor use the
    Secret kvxfer-token, which deploy/base/chart-values.yaml and docs/deploy.md say how to create."""
    create = 'kubectl -n kvxfer create secret generic kvxfer-token --from-literal=token="$(openssl rand -hex 32)"'
    assert create in (ROOT / "deploy" / "base" / "chart-values.yaml").read_text()
    assert create in (ROOT / "docs" / "deploy.md").read_text()
    for overlay in ("cpu", "rdma"):
        out = run([tool("kubectl"), "kustomize", str(ROOT / "deploy" / "overlays" / overlay)])
        assert out.returncode == 0, out.stderr
        docs = load_docs(out.stdout)
        assert [d for d in docs if d["kind"] == "Secret"] == [], "a committed token would be everyone's"
        for role, spec in pod_specs(docs).items():
            check_worker_pod(role, spec)
            assert _token_wiring(spec) == {("kvxfer-token", "token")}, (overlay, role)
            assert all("--metrics-auth=token" in c["args"] for c in sidecars(spec))
        for mon in (d for d in docs if d["kind"] == "ServiceMonitor"):
            for endpoint in mon["spec"]["endpoints"]:
                assert endpoint["authorization"]["credentials"] == {"name": "kvxfer-token", "key": "token"}


def test_with_tls_the_probes_ask_the_local_socket(helm_render: Path, tmp_path: Path) -> None:
    # Kubernetes' gRPC probes cannot speak TLS: on a TLS peer port they would never pass.
    values = {"tls": {"enabled": True, "secretName": "kvxfer-tls", "caKey": "ca.crt"},
              "prefill": {"vllm": {"tensorParallelSize": 2}}}  # fmt: skip
    docs = _render_values(helm_render, tmp_path, values)
    validate_manifests(docs, tmp_path)
    for spec in pod_specs(docs).values():
        for sidecar in sidecars(spec):
            socket = _opts(sidecar)["--local-socket"]
            for probe, service in (("startupProbe", "liveness"), ("livenessProbe", "liveness"), ("readinessProbe", "")):
                assert "grpc" not in sidecar[probe], (sidecar["name"], probe)
                assert sidecar[probe]["exec"]["command"] == [
                    "kvxfer", "health", f"--target={socket}", f"--service={service}", "--timeout-seconds=2"
                ]  # fmt: skip
                assert sidecar[probe]["timeoutSeconds"] == 5, (sidecar["name"], probe)
