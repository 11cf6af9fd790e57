"""helm/kvxfer: values schema, rendering (tools/helm-render) and what the manifests must say."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from . import contract
from .conftest import CHART, EXAMPLES, load_docs, min_kube_version, render_chart, run, tool, validate_manifests

SCHEMA = CHART / "values.schema.json"
VALUES = [CHART / "values.yaml", *EXAMPLES]
KV_TRANSFER_CONFIG = (
    '{"kv_connector":"KvxferConnector","kv_connector_module_path":"kvxfer.integrations.vllm","kv_role":"kv_both"}'
)


def _ids(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


# ------------------------------------------------------------------------------------ schema
@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_values_match_schema(values: Path) -> None:
    out = run([tool("check-jsonschema"), "--schemafile", str(SCHEMA), str(values)])
    assert out.returncode == 0, out.stdout + out.stderr


BAD_VALUES = {
    "unknown-top-level-key": ({"replica": 2}, "replica"),
    "unknown-key-in-role": ({"decode": {"replicaCount": 2}}, "replicaCount"),
    "unknown-key-deep": ({"sidecar": {"ucx": {"tlss": "rc"}}}, "tlss"),
    "wrong-type-replicas": ({"prefill": {"replicas": "two"}}, "two"),
    "wrong-type-port": ({"sidecar": {"ports": {"peer": "50051"}}}, "50051"),
    "wrong-enum-backend": ({"sidecar": {"backend": "rdma"}}, "rdma"),
    "wrong-type-hostnetwork": ({"hostNetwork": "false"}, "false"),
    "latest-tag": ({"image": {"tag": "latest"}}, "latest"),
    "bad-env-entry": ({"extraEnv": [{"name": "A", "val": "b"}]}, "val"),
    "rdma-resource-count": ({"rdma": {"resources": {"rdma/ib": "one"}}}, "one"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_schema_refuses(case: str, tmp_path: Path) -> None:
    values, word = BAD_VALUES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(yaml.safe_dump(values))
    out = run([tool("check-jsonschema"), "--schemafile", str(SCHEMA), str(path)])
    assert out.returncode != 0, f"{case} was accepted"
    assert word in out.stdout + out.stderr, out.stdout + out.stderr


def _object_schemas(node: Any, path: str = "#") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        if node.get("type") == "object" or "properties" in node:
            found.append((path, node))
        for k, v in node.items():
            found += _object_schemas(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            found += _object_schemas(v, f"{path}/{i}")
    return found


def test_schema_is_closed_everywhere() -> None:
    """Every object refuses unknown keys, except Kubernetes objects passed through verbatim
    (marked as such; the rendered manifests are checked by kubernetes-validate --strict)."""
    schema = json.loads(SCHEMA.read_text())
    for path, node in _object_schemas(schema):
        ap = node.get("additionalProperties")
        assert ap is not None, f"{path}: additionalProperties is not set"
        if ap is True:
            assert "Kubernetes object" in node.get("description", "") or "free-form" in node.get("description", ""), (
                f"{path}: open object without a reason"
            )
            assert "properties" not in node, path


def test_role_blocks_override_exactly_the_role_keys() -> None:
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    m = re.search(r'define "kvxfer.roleKeys" -}}\n(.*?)\n', helpers)
    assert m
    role_keys = set(m.group(1).split())
    schema = json.loads(SCHEMA.read_text())
    role = schema["definitions"]["role"]["properties"]
    assert set(role) - {"enabled", "replicas"} == role_keys
    assert role_keys <= set(schema["properties"]), "every role key has a global default"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert role_keys <= set(values), "every role key has a default in values.yaml"


# --------------------------------------------------------------------------------- rendering
def _render(helm_render: Path, values: Path) -> list[dict[str, Any]]:
    extra = [] if values.name == "values.yaml" else [values]
    out = render_chart(helm_render, *extra)
    assert out.returncode == 0, out.stderr
    return load_docs(out.stdout)


@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_rendered_chart_validates(values: Path, helm_render: Path, tmp_path: Path) -> None:
    docs = _render(helm_render, values)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds.count("Deployment") == 2, kinds
    validate_manifests(docs, tmp_path, min_kube_version(values))


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role -> pod spec of every Deployment."""
    return {
        d["spec"]["template"]["metadata"]["labels"]["kvxfer.io/role"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] == "Deployment"
    }


def check_worker_pod(role: str, spec: dict[str, Any]) -> None:
    """What every prefill/decode pod must look like, chart or plain manifests."""
    (sidecar,) = [c for c in spec["initContainers"] if c["name"] == "kvxfer"]
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    # Native sidecar.
    assert sidecar["restartPolicy"] == "Always"
    # Flags and environment only from the contract.
    args = sidecar["args"]
    assert args[0] == "serve"
    for a in args[1:]:
        flag = a.split("=", 1)[0]
        assert flag in contract.flags(), f"{role}: {flag} is not in docs/sidecar-contract.md"
    opts = dict(a.split("=", 1) for a in args[1:] if "=" in a)
    assert opts["--role"] == role
    contract_env = {contract.env_var(f) for f in contract.flags()}
    for e in sidecar.get("env", []):
        if e["name"].startswith("KVXFER_"):
            assert e["name"] in contract_env, e["name"]
    # Ports named as in the contract; probes on grpc.health.v1 at the peer port.
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert set(contract.ports()) <= set(ports)
    peer = ports["kvxfer-peer"]
    assert opts["--peer-listen"] == f"0.0.0.0:{peer}"
    assert opts["--metrics-listen"] == f"0.0.0.0:{ports['kvxfer-metrics']}"
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert sidecar[probe]["grpc"]["port"] == peer, probe
    # The startup probe gates the worker's start: it must not wait for the worker.
    assert sidecar["startupProbe"]["grpc"]["service"] == "liveness"
    assert sidecar["readinessProbe"]["grpc"]["service"] == ""
    # Drain on the way out, with time for it.
    assert sidecar["lifecycle"]["preStop"]["exec"]["command"] == ["kvxfer", "drain"]
    assert spec["terminationGracePeriodSeconds"] > float(opts["--drain-seconds"])
    # Security.
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert "ALL" in sc["capabilities"]["drop"]
    assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
    assert spec.get("hostNetwork", False) is False or spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    # Volumes: the socket directory shared, /dev/shm in memory.
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (sidecar, vllm)}
    socket_dir = opts["--local-socket"].rsplit("/", 1)[0]
    assert mounts["kvxfer"][socket_dir] == mounts["vllm"][socket_dir]
    assert "emptyDir" in volumes[mounts["kvxfer"][socket_dir]]
    if "/dev/shm" in mounts["kvxfer"]:
        assert volumes[mounts["kvxfer"]["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        assert mounts["vllm"]["/dev/shm"] == mounts["kvxfer"]["/dev/shm"]
    # Files named by flags are mounted.
    for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--token-file"):
        if flag in opts:
            assert any(opts[flag].startswith(p + "/") for p in mounts["kvxfer"]), flag
    # The worker loads the kvxfer connector.
    i = vllm["args"].index("--kv-transfer-config")
    assert json.loads(vllm["args"][i + 1]) == json.loads(KV_TRANSFER_CONFIG)
    assert {"name": "KVXFER_LOCAL_SOCKET", "value": opts["--local-socket"]} in vllm["env"]
    assert any(p["name"] == "http" for p in vllm["ports"])


@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_rendered_worker_pods(values: Path, helm_render: Path) -> None:
    pods = pod_specs(_render(helm_render, values))
    assert set(pods) == {"prefill", "decode"}
    for role, spec in pods.items():
        check_worker_pod(role, spec)


def test_default_render_exact_kv_transfer_config(helm_render: Path) -> None:
    out = render_chart(helm_render)
    assert f"'{KV_TRANSFER_CONFIG}'" in out.stdout


def test_rdma_and_per_role_overrides(helm_render: Path) -> None:
    pods = pod_specs(_render(helm_render, CHART / "examples" / "hetero-tp.yaml"))
    tp = {}
    for role, spec in pods.items():
        (sidecar,) = spec["initContainers"]
        (vllm,) = spec["containers"]
        tp[role] = vllm["resources"]["limits"]["nvidia.com/gpu"]
        assert f"--tensor-parallel-size={tp[role]}" in vllm["args"]
        assert sidecar["resources"]["limits"]["rdma/ib"] == sidecar["resources"]["requests"]["rdma/ib"] == 2
        assert sidecar["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert env["UCX_TLS"] == "rc,ud,sm,self,cuda_copy,cuda_ipc"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
        assert env["UCX_IB_GID_INDEX"] == "3"
    assert tp == {"prefill": 4, "decode": 2}
    # decode overrides one sidecar key; the other sidecar keys keep their global defaults.
    dec = pods["decode"]["initContainers"][0]["args"]
    pre = pods["prefill"]["initContainers"][0]["args"]
    assert "--transfer-timeout-seconds=60" in dec
    assert "--transfer-timeout-seconds=30" in pre
    assert "--lease-seconds=30" in dec


def test_host_network_is_off_by_default(helm_render: Path) -> None:
    for spec in pod_specs(_render(helm_render, CHART / "values.yaml")).values():
        assert "hostNetwork" not in spec


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
        ({"auth": {"enabled": True}}, "auth.enabled needs auth.secretName"),
        (
            {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
            "enable one of them",
        ),
        ({"gpu": {"sidecarAccess": "resourceClaims"}}, "needs gpu.resourceClaims"),
    ],
    ids=["tls-without-secret", "auth-without-secret", "two-monitors", "claims-without-claims"],
)
def test_render_refuses(values: dict[str, Any], message: str, helm_render: Path, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = render_chart(helm_render, path)
    assert out.returncode != 0, out.stdout
    assert message in out.stderr, out.stderr


def test_tls_and_token_files(helm_render: Path, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump({"tls": {"enabled": True, "secretName": "t"}, "auth": {"enabled": True, "secretName": "a"}})
    )
    out = render_chart(helm_render, path)
    assert out.returncode == 0, out.stderr
    for role, spec in pod_specs(load_docs(out.stdout)).items():
        check_worker_pod(role, spec)
        args = spec["initContainers"][0]["args"]
        assert "--tls-cert=/etc/kvxfer/tls/tls.crt" in args
        assert "--tls-key=/etc/kvxfer/tls/tls.key" in args
        assert "--tls-ca=/etc/kvxfer/tls/ca.crt" in args
        assert "--token-file=/etc/kvxfer/auth/token" in args
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets == {"t", "a"}
        settings = sidecar_settings(spec, tmp_path)
        assert settings.tls_ca is not None
        assert settings.token_file is not None


# ------------------------------------------------------------------ the sidecar accepts them
def _kubelet_expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def sidecar_settings(spec: dict[str, Any], tmp_path: Path) -> Any:
    """Parse a pod's sidecar args and KVXFER_* env with kvxfer's own settings loader, as
    `kvxfer serve` would in the pod (files named by flags are stood in for by temp files)."""
    from kvxfer.config import load_settings

    sidecar = spec["initContainers"][0]
    downward = {"POD_NAME": "kvxfer-decode-7c9f-abcde", "POD_IP": "10.1.2.3"}
    flags: dict[str, str] = {}
    for arg in sidecar["args"][1:]:
        name, _, value = arg.partition("=")
        value = _kubelet_expand(value, downward)
        if name in {"--tls-cert", "--tls-key", "--tls-ca", "--token-file"}:
            stand_in = tmp_path / name.strip("-")
            stand_in.write_text("stand-in\n")
            value = str(stand_in)
        flags[name.removeprefix("--")] = value
    env = {e["name"]: e["value"] for e in sidecar["env"] if e["name"].startswith("KVXFER_") and "value" in e}
    env.pop("KVXFER_TOKEN_FILE", None)  # the same file as --token-file, stood in for above
    return load_settings(flags, env)


@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_sidecar_accepts_rendered_settings(values: Path, helm_render: Path, tmp_path: Path) -> None:
    for role, spec in pod_specs(_render(helm_render, values)).items():
        settings = sidecar_settings(spec, tmp_path)
        assert settings.role == role
        assert settings.engine_id == "kvxfer-decode-7c9f-abcde"
