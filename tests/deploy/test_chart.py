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
    "zero-tensor-parallel": ({"vllm": {"tensorParallelSize": 0}}, "0"),
    "wrong-type-pipeline-parallel": ({"decode": {"vllm": {"pipelineParallelSize": "2"}}}, "2"),
    "net-devices-by-rank-not-a-list": ({"sidecar": {"ucx": {"netDevicesByRank": "mlx5_0:1"}}}, "mlx5_0:1"),
    "message-size-below-the-sidecars-minimum": ({"sidecar": {"maxMessageBytes": 1024}}, "1024"),
    "lease-above-the-sidecars-maximum": ({"sidecar": {"leaseSeconds": 100000}}, "100000"),
    "tls-server-name-not-a-dns-name": ({"tls": {"serverName": "kvxfer peer"}}, "kvxfer peer"),
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


def test_contract_flags_are_the_sidecars_settings() -> None:
    """The contract's flag table (what the chart may render) lists exactly kvxfer.config's settings."""
    from kvxfer.config import Settings, flag_name

    assert contract.flags() == {flag_name(f) for f in Settings.model_fields}


def test_contract_defaults_are_the_sidecars_defaults() -> None:
    """The contract's default column says what `kvxfer serve --help` shows (it may add a note in parentheses)."""
    from kvxfer.config import Settings, flag_name
    from kvxfer.server.cli import _default

    wrong = {}
    for name, field in Settings.model_fields.items():
        shown, written = _default(field, name), contract.flag_defaults()[flag_name(name)]
        if written != shown and not written.startswith(shown + " ("):
            wrong[flag_name(name)] = (written, shown)
    assert not wrong, f"docs/sidecar-contract.md's defaults differ from the sidecar's (table, code): {wrong}"


def test_chart_needs_native_sidecars(helm_render: Path) -> None:
    """Native sidecars (restartPolicy: Always init containers) are on by default from 1.29."""
    out = render_chart(helm_render, extra=["-kube-version", "1.28.15"])
    assert out.returncode != 0
    assert "incompatible with Kubernetes v1.28.15" in out.stderr, out.stderr


def pod_specs(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """role -> pod spec of every Deployment."""
    return {
        d["spec"]["template"]["metadata"]["labels"]["kvxfer.io/role"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] == "Deployment"
    }


def sidecars(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """The pod's kvxfer sidecar containers, in rank order (kvxfer-0, kvxfer-1, ...)."""
    found = [c for c in spec.get("initContainers", []) if c["name"].startswith("kvxfer")]
    assert [c["name"] for c in found] == [f"kvxfer-{r}" for r in range(len(found))], [c["name"] for c in found]
    return found


def _opts(container: dict[str, Any]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in container["args"][1:] if "=" in a)


def _arg(args: list[str], flag: str, default: str | None = None) -> str:
    values = [a.split("=", 1)[1] for a in args if a.startswith(flag + "=")]
    if not values and default is not None:
        return default
    (value,) = values
    return value


def worker_ranks(vllm: dict[str, Any]) -> int:
    """Worker ranks of the pod's vLLM instance: tensor x pipeline parallel size."""
    args = vllm["args"]
    tp = int(_arg(args, "--tensor-parallel-size"))
    pp = int(_arg(args, "--pipeline-parallel-size", "1"))
    return tp * pp


def parse_kvxfer(command: list[str], name: str) -> dict[str, Any]:
    """Parse a `kvxfer <name> ...` command (preStop, exec probe) with kvxfer's own CLI, without running it."""
    import typer.main

    from kvxfer.cli import app

    assert command[:2] == ["kvxfer", name], command
    # Typer's click (vendored in recent typer) parses exactly as `kvxfer <name>` would.
    cmd = typer.main.get_command(app).get_command(None, name)  # type: ignore[attr-defined]
    assert cmd is not None, f"kvxfer has no {name} command"
    try:
        ctx = cmd.make_context(name, list(command[2:]))
    except Exception as exc:  # the CLI's usage error: unknown option, bad value
        message = exc.format_message() if hasattr(exc, "format_message") else str(exc)
        raise AssertionError(f"`{' '.join(command)}`: {message}") from None
    return dict(ctx.params)


def parse_drain(command: list[str]) -> dict[str, Any]:
    """Parse a preStop command with kvxfer's own CLI (`kvxfer drain`), without running it."""
    return parse_kvxfer(command, "drain")


# What the kubelet leaves an exec probe beyond the answer's own deadline (`kvxfer health
# --timeout-seconds`): the CLI's start.
EXEC_PROBE_MARGIN_S = 3


def kv_transfer_config(role: str) -> dict[str, str]:
    return json.loads(KV_TRANSFER_CONFIG.replace("kv_both", "kv_producer" if role == "prefill" else "kv_consumer"))


# The users the images run as when neither the container nor the pod names one: root in the vLLM
# images, 10001 in kvxfer's (docker/Dockerfile's USER).
IMAGE_UID = {"vllm": 0, "kvxfer": 10001}


def effective_uid(spec: dict[str, Any], container: dict[str, Any]) -> int:
    """The UID a container's processes run as: its runAsUser, else the pod's, else its image's."""
    for ctx in (container.get("securityContext", {}), spec.get("securityContext", {})):
        if "runAsUser" in ctx:
            return int(ctx["runAsUser"])
    return IMAGE_UID["kvxfer" if container["name"].startswith("kvxfer") else "vllm"]


def check_mps_pod(spec: dict[str, Any], pipe: str) -> None:
    """A pod whose CUDA containers (vLLM and every sidecar) join the node's MPS daemon at ``pipe``:
    the host's IPC namespace, the pipe directory mounted once in each, CUDA_MPS_PIPE_DIRECTORY, and
    one UID for all (the daemon runs one server per UID; a client of another UID waits for the
    running server's clients to exit)."""
    assert spec["hostIPC"] is True
    containers = [*sidecars(spec), *spec["containers"]]
    assert len({effective_uid(spec, c) for c in containers}) == 1, {c["name"]: effective_uid(spec, c)
                                                                    for c in containers}  # fmt: skip
    (volume,) = [v for v in spec["volumes"] if v["name"] == "mps-pipe"]
    assert volume["hostPath"] == {"path": pipe, "type": "Directory"}
    for c in [*sidecars(spec), *spec["containers"]]:
        env = [e for e in c["env"] if e["name"] == "CUDA_MPS_PIPE_DIRECTORY"]
        assert env == [{"name": "CUDA_MPS_PIPE_DIRECTORY", "value": pipe}], c["name"]
        mounts = [m for m in c["volumeMounts"] if m["name"] == "mps-pipe"]
        assert mounts == [{"name": "mps-pipe", "mountPath": pipe}], c["name"]


def check_worker_pod(role: str, spec: dict[str, Any]) -> None:
    """What every prefill/decode pod must look like, chart or plain manifests: one native sidecar
    per worker rank, each with its own socket, ports, probes and drain."""
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    side = sidecars(spec)
    ranks = worker_ranks(vllm)
    assert len(side) == ranks, f"{role}: {ranks} worker ranks but {len(side)} sidecars"
    assert len(spec["initContainers"]) == ranks, "only the sidecars are init containers"
    vllm_env = {e["name"]: e for e in vllm["env"]}
    socket_template = vllm_env["KVXFER_LOCAL_SOCKET"]["value"]
    assert "{rank}" in socket_template, socket_template
    contract_env = {contract.env_var(f) for f in contract.flags()}
    volumes = {v["name"]: v for v in spec["volumes"]}
    vllm_mounts = {m["mountPath"]: m["name"] for m in vllm["volumeMounts"]}
    pod_port_names: list[str] = []
    pod_port_numbers: list[int] = [p["containerPort"] for p in vllm["ports"]]
    base = _opts(side[0])
    base_peer = int(base["--peer-listen"].rsplit(":", 1)[1])
    base_metrics = int(base["--metrics-listen"].rsplit(":", 1)[1])
    for r, sidecar in enumerate(side):
        where = f"{role} {sidecar['name']}"
        # Native sidecar.
        assert sidecar["restartPolicy"] == "Always", where
        # Flags and environment only from the contract.
        args = sidecar["args"]
        assert args[0] == "serve"
        for a in args[1:]:
            flag = a.split("=", 1)[0]
            assert flag in contract.flags(), f"{where}: {flag} is not in docs/sidecar-contract.md"
        opts = _opts(sidecar)
        assert opts["--role"] == role
        # One engine id for the whole instance (the rank tells its sidecars apart).
        assert opts["--engine-id"] == base["--engine-id"] == "$(POD_NAME)", where
        for e in sidecar.get("env", []):
            if e["name"].startswith("KVXFER_"):
                assert e["name"] in contract_env, e["name"]
        # Rank r: its own socket (what the worker of rank r gets from the {rank} template), and
        # ports base + r, named as in the contract for rank 0 and <kind>-<r> otherwise.
        assert opts["--local-socket"] == socket_template.replace("{rank}", str(r)), where
        ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
        assert ports[contract.port_name("peer", r)] == base_peer + r, where
        assert ports[contract.port_name("metrics", r)] == base_metrics + r, where
        if r == 0:
            assert set(contract.ports()) <= set(ports)
        assert opts["--peer-listen"] == f"0.0.0.0:{base_peer + r}"
        assert opts["--metrics-listen"] == f"0.0.0.0:{base_metrics + r}"
        if int(opts["--data-port"]):
            assert ports[contract.port_name("data", r)] == int(opts["--data-port"]), where
        pod_port_names += list(ports)
        pod_port_numbers += list(ports.values())
        # Probes on grpc.health.v1 at this rank's peer port; with TLS there (which Kubernetes' gRPC
        # probes cannot speak), `kvxfer health` on this rank's local socket. The startup probe gates
        # the worker's start: it must not wait for the worker (liveness, not readiness).
        for probe, service in (("startupProbe", "liveness"), ("livenessProbe", "liveness"), ("readinessProbe", "")):
            if "--tls-cert" in opts:
                command = sidecar[probe]["exec"]["command"]
                assert command[:4] == [
                    "kvxfer", "health", f"--target={opts['--local-socket']}", f"--service={service}"
                ], (where, probe)  # fmt: skip
                # The kubelet waits longer than the CLI waits for its answer: a slow sidecar fails
                # the probe with the CLI's message, not with a kill halfway through its start.
                params = parse_kvxfer(command, "health")
                assert sidecar[probe]["timeoutSeconds"] >= params["timeout_seconds"] + EXEC_PROBE_MARGIN_S, (
                    where, probe, params)  # fmt: skip
            else:
                assert sidecar[probe]["grpc"] == {"port": base_peer + r, "service": service}, (where, probe)
        # Drain this rank's sidecar on the way out (with the token when there is one), with time for it.
        drain = parse_drain(sidecar["lifecycle"]["preStop"]["exec"]["command"])
        assert drain["target"] == opts["--local-socket"], where
        assert drain["token_file"] == opts.get("--token-file"), where
        assert spec["terminationGracePeriodSeconds"] > float(opts["--drain-seconds"])
        # Security.
        sc = sidecar["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert "ALL" in sc["capabilities"]["drop"]
        assert set(sc["capabilities"].get("add", [])) <= {"IPC_LOCK"}
        # Volumes: the socket directory shared with the worker, /dev/shm in memory.
        mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
        socket_dir = opts["--local-socket"].rsplit("/", 1)[0]
        assert mounts[socket_dir] == vllm_mounts[socket_dir]
        assert "emptyDir" in volumes[mounts[socket_dir]]
        if "/dev/shm" in mounts:
            assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
            assert vllm_mounts["/dev/shm"] == mounts["/dev/shm"]
        # Files named by flags are mounted.
        for flag in ("--tls-cert", "--tls-key", "--tls-ca", "--token-file"):
            if flag in opts:
                assert any(opts[flag].startswith(p + "/") for p in mounts), flag
        if "--token-file" in opts:
            assert vllm_env["KVXFER_TOKEN_FILE"]["value"] == opts["--token-file"]
            token_dir = opts["--token-file"].rsplit("/", 1)[0]
            assert vllm_mounts[token_dir] == mounts[token_dir], "the worker reads the sidecar's token file"
        # The peer port listens on the pod's addresses: a credential, or an explicit --insecure.
        assert "--token-file" in opts or "--tls-ca" in opts or opts.get("--insecure") == "true", where
        assert opts["--metrics-auth"] in {"token", "none"}, where
        assert opts["--metrics-auth"] == "none" or "--token-file" in opts, where
    # Port names and numbers are unique in the pod; names fit Kubernetes' 15 characters.
    assert len(pod_port_names) == len(set(pod_port_names)), pod_port_names
    assert len(pod_port_numbers) == len(set(pod_port_numbers)), pod_port_numbers
    assert all(len(n) <= 15 for n in pod_port_names), pod_port_names
    assert spec.get("hostNetwork", False) is False or spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    # The worker loads the kvxfer connector, as producer (prefill) or consumer (decode).
    i = vllm["args"].index("--kv-transfer-config")
    assert json.loads(vllm["args"][i + 1]) == kv_transfer_config(role)
    assert any(p["name"] == "http" for p in vllm["ports"])
    gpus = {k: v for k, v in vllm.get("resources", {}).get("limits", {}).items() if k.endswith("/gpu")}
    assert all(v == ranks for v in gpus.values()), (gpus, ranks)


@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_rendered_worker_pods(values: Path, helm_render: Path) -> None:
    pods = pod_specs(_render(helm_render, values))
    assert set(pods) == {"prefill", "decode"}
    for role, spec in pods.items():
        check_worker_pod(role, spec)


def test_default_render_exact_kv_transfer_config(helm_render: Path) -> None:
    out = render_chart(helm_render)
    for kv_role in ("kv_producer", "kv_consumer"):
        assert "'" + KV_TRANSFER_CONFIG.replace("kv_both", kv_role) + "'" in out.stdout
    assert "kv_both" not in out.stdout


def _render_values(helm_render: Path, tmp_path: Path, values: dict[str, Any]) -> list[dict[str, Any]]:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = run([tool("check-jsonschema"), "--schemafile", str(SCHEMA), str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    out = render_chart(helm_render, path)
    assert out.returncode == 0, out.stderr
    return load_docs(out.stdout)


def test_one_sidecar_per_rank(helm_render: Path, tmp_path: Path) -> None:
    """TP=4: four sidecars per pod, rank r on its own socket and ports, one GPU per rank."""
    docs = _render_values(helm_render, tmp_path, {"vllm": {"tensorParallelSize": 4}})
    validate_manifests(docs, tmp_path)
    for role, spec in pod_specs(docs).items():
        check_worker_pod(role, spec)
        side = sidecars(spec)
        assert [_opts(c)["--local-socket"] for c in side] == [f"/run/kvxfer/kvxfer-{r}.sock" for r in range(4)]
        assert [_opts(c)["--peer-listen"] for c in side] == [f"0.0.0.0:{50051 + r}" for r in range(4)]
        assert [_opts(c)["--metrics-listen"] for c in side] == [f"0.0.0.0:{9400 + r}" for r in range(4)]
        assert [[p["name"] for p in c["ports"]] for c in side] == [
            ["kvxfer-peer", "kvxfer-metrics"],
            ["peer-1", "metrics-1"],
            ["peer-2", "metrics-2"],
            ["peer-3", "metrics-3"],
        ]
        assert [c["readinessProbe"]["grpc"]["port"] for c in side] == [50051, 50052, 50053, 50054]
        assert [c["lifecycle"]["preStop"]["exec"]["command"][2] for c in side] == [
            f"--target=/run/kvxfer/kvxfer-{r}.sock" for r in range(4)
        ]
        (vllm,) = spec["containers"]
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_pipeline_parallel_ranks(helm_render: Path, tmp_path: Path) -> None:
    """TP=2 x PP=2 is four ranks in the pod; roles may differ (decode at TP=1 keeps one sidecar)."""
    docs = _render_values(
        helm_render,
        tmp_path,
        {"prefill": {"vllm": {"tensorParallelSize": 2, "pipelineParallelSize": 2}}},
    )
    pods = pod_specs(docs)
    for role, spec in pods.items():
        check_worker_pod(role, spec)
    assert len(sidecars(pods["prefill"])) == 4
    assert len(sidecars(pods["decode"])) == 1
    (vllm,) = pods["prefill"]["containers"]
    assert "--pipeline-parallel-size=2" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 4


def _metrics_ports(spec: dict[str, Any]) -> dict[str, int]:
    out = {}
    for r, c in enumerate(sidecars(spec)):
        (port,) = [p["containerPort"] for p in c["ports"] if p["name"] == contract.port_name("metrics", r)]
        out[contract.port_name("metrics", r)] = port
    return out


def check_metrics_objects(docs: list[dict[str, Any]]) -> None:
    """The metrics Services and the ServiceMonitor/PodMonitor reach every rank's metrics port."""
    pods = pod_specs(docs)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    wanted: dict[str, set[str]] = {}
    for role, spec in pods.items():
        metrics = _metrics_ports(spec)
        (svc,) = [
            s
            for s in services.values()
            if s["metadata"]["labels"].get("app.kubernetes.io/component") == "metrics"
            and s["metadata"]["labels"].get("kvxfer.io/role") == role
        ]
        assert svc["spec"]["selector"]["kvxfer.io/role"] == role, "a role's metrics Service selects that role only"
        got = {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]}
        assert got == {name: (port, port) for name, port in metrics.items()}, (role, got, metrics)
        for name in metrics:
            wanted.setdefault(name, set()).add(role)
    for d in docs:
        if d["kind"] not in {"ServiceMonitor", "PodMonitor"}:
            continue
        endpoints = d["spec"]["endpoints" if d["kind"] == "ServiceMonitor" else "podMetricsEndpoints"]
        assert {e["port"] for e in endpoints} == set(wanted), d["kind"]
        for e in endpoints:
            rank = 0 if e["port"] == "kvxfer-metrics" else int(e["port"].split("-")[1])
            relabel = {r["targetLabel"]: r for r in e["relabelings"]}
            assert relabel["role"]["sourceLabels"] == ["__meta_kubernetes_pod_label_kvxfer_io_role"]
            assert relabel["rank"]["replacement"] == str(rank)


@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_metrics_cover_every_rank(values: Path, helm_render: Path) -> None:
    check_metrics_objects(_render(helm_render, values))


@pytest.mark.parametrize("monitor", ["serviceMonitor", "podMonitor"])
def test_monitors_cover_every_rank(monitor: str, helm_render: Path, tmp_path: Path) -> None:
    docs = _render_values(
        helm_render,
        tmp_path,
        {
            "metrics": {monitor: {"enabled": True}},
            "prefill": {"vllm": {"tensorParallelSize": 4}},
            "decode": {"vllm": {"tensorParallelSize": 2}},
        },
    )
    (mon,) = [d for d in docs if d["kind"] in {"ServiceMonitor", "PodMonitor"}]
    validate_manifests(docs, tmp_path)
    check_metrics_objects(docs)
    endpoints = mon["spec"]["endpoints" if monitor == "serviceMonitor" else "podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == ["kvxfer-metrics", "metrics-1", "metrics-2", "metrics-3"]


def test_rdma_and_per_role_overrides(helm_render: Path) -> None:
    pods = pod_specs(_render(helm_render, CHART / "examples" / "hetero-tp.yaml"))
    tp = {}
    for role, spec in pods.items():
        (vllm,) = spec["containers"]
        tp[role] = vllm["resources"]["limits"]["nvidia.com/gpu"]
        assert f"--tensor-parallel-size={tp[role]}" in vllm["args"]
        assert len(sidecars(spec)) == tp[role]
        for r, sidecar in enumerate(sidecars(spec)):
            assert sidecar["resources"]["limits"]["rdma/ib"] == sidecar["resources"]["requests"]["rdma/ib"] == 1
            assert sidecar["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
            env = {e["name"]: e.get("value") for e in sidecar["env"]}
            assert env["UCX_TLS"] == "rc,ud,sm,self,cuda_copy,cuda_ipc"
            # Each rank on the HCA next to its GPU.
            assert env["UCX_NET_DEVICES"] == f"mlx5_{r}:1"
            assert env["UCX_IB_GID_INDEX"] == "3"
    assert tp == {"prefill": 4, "decode": 2}
    # decode overrides its sidecars' resources; the other sidecar keys keep the global values.
    for dec in sidecars(pods["decode"]):
        assert dec["resources"]["limits"]["memory"] == "8Gi"
        assert "--lease-seconds=30" in dec["args"]
    for role, spec in pods.items():
        for side in sidecars(spec):
            assert "--transfer-timeout-seconds=60" in side["args"], role
        # The vLLM connector asks for the same deadline per pull (it used to stay at its own 30 s).
        (vllm,) = spec["containers"]
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env["KVXFER_VLLM_TRANSFER_TIMEOUT_SECONDS"] == "60", role


def test_rdma_gpu_example_uses_the_workers_agent(helm_render: Path) -> None:
    """examples/rdma-gpu-1p1d.yaml: GPU to GPU over RDMA through each worker's own NIXL agent
    (docs/gpu.md calls that route sure; a sidecar cannot register the worker's IPC-opened VRAM with
    a NIC), so vLLM holds the NIC, IPC_LOCK and the UCX settings, and the sidecars none of them."""
    for spec in pod_specs(_render(helm_render, CHART / "examples" / "rdma-gpu-1p1d.yaml")).values():
        (vllm,) = spec["containers"]
        (sidecar,) = sidecars(spec)
        assert _opts(sidecar)["--backend"] == "worker"
        assert _data_plane_env_of(vllm) == [
            *WORKER,
            {"name": "UCX_TLS", "value": "rc,ud,sm,self,cuda_copy,cuda_ipc"},
            {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1"},
            {"name": "UCX_IB_GID_INDEX", "value": "3"},
        ]
        assert vllm["resources"]["requests"]["rdma/ib"] == vllm["resources"]["limits"]["rdma/ib"] == 1
        assert vllm["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert _data_plane_env_of(sidecar) == []
        assert "rdma/ib" not in sidecar["resources"]["requests"]
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_mooncake_devices_and_data_ports_per_rank(helm_render: Path) -> None:
    pods = pod_specs(_render(helm_render, CHART / "examples" / "mooncake-rdma.yaml"))
    data = {"prefill": 50100, "decode": 51100}
    for role, spec in pods.items():
        assert spec["hostNetwork"] is True
        for r, sidecar in enumerate(sidecars(spec)):
            opts = _opts(sidecar)
            assert opts["--backend"] == "mooncake"
            assert opts["--mooncake-device"] == f"mlx5_{r}"
            assert opts["--data-port"] == str(data[role] + r)


def test_host_network_is_off_by_default(helm_render: Path) -> None:
    for spec in pod_specs(_render(helm_render, CHART / "values.yaml")).values():
        assert "hostNetwork" not in spec


def test_mps_joins_both_containers_to_the_node_daemon(helm_render: Path, tmp_path: Path) -> None:
    """gpu.mps: every container that runs CUDA (vLLM and each rank's sidecar) reaches the node's MPS
    daemon through its pipe directory and the host's IPC namespace; off by default."""
    for spec in pod_specs(_render(helm_render, CHART / "values.yaml")).values():
        assert "hostIPC" not in spec
        assert "mps-pipe" not in [v["name"] for v in spec["volumes"]]
    as_sidecar = {"runAsUser": 10001}
    mps = {"enabled": True, "pipeDirectory": "/run/nvidia/mps/pipe"}
    values = {"vllm": {"tensorParallelSize": 2, "securityContext": as_sidecar}, "gpu": {"mps": mps}}
    docs = _render_values(helm_render, tmp_path, values)
    validate_manifests(docs, tmp_path)
    for spec in pod_specs(docs).values():
        assert [c["name"] for c in [*sidecars(spec), *spec["containers"]]] == ["kvxfer-0", "kvxfer-1", "vllm"]
        check_mps_pod(spec, "/run/nvidia/mps/pipe")
    docs = _render_values(helm_render, tmp_path, {"gpu": {"mps": {"enabled": True, "hostIPC": False}},
                                                  "vllm": {"securityContext": as_sidecar}})  # fmt: skip
    for spec in pod_specs(docs).values():
        assert "hostIPC" not in spec
        assert [v["hostPath"]["path"] for v in spec["volumes"] if v["name"] == "mps-pipe"] == ["/tmp/nvidia-mps"]


@pytest.mark.parametrize(
    ("values", "uids"),
    [
        ({"vllm": {"securityContext": {"runAsUser": 10001}}}, (10001, 10001)),
        ({"sidecar": {"securityContext": {"runAsUser": 0, "runAsNonRoot": False}}}, (None, 0)),
        ({"podSecurityContext": {"runAsUser": 10001}}, (None, 10001)),
    ],
    ids=["vllm-as-the-sidecars-uid", "sidecars-as-vllms-uid", "pod-level-uid"],
)
def test_mps_renders_when_vllm_and_sidecars_share_a_uid(
    values: dict[str, Any], uids: tuple[int | None, int], helm_render: Path, tmp_path: Path
) -> None:
    """The two ways out of the MPS UID refusal (docs/gpu.md), and a pod-level runAsUser both inherit."""
    docs = _render_values(helm_render, tmp_path, {"gpu": {"mps": {"enabled": True}}, **values})
    validate_manifests(docs, tmp_path)
    vllm_uid, sidecar_uid = uids
    for role, spec in pod_specs(docs).items():
        if sidecar_uid != 0:  # check_worker_pod holds sidecars to the chart's defaults: non-root
            check_worker_pod(role, spec)
        check_mps_pod(spec, "/tmp/nvidia-mps")
        (vllm,) = spec["containers"]
        assert vllm.get("securityContext", {}).get("runAsUser") == vllm_uid
        assert [s["securityContext"]["runAsUser"] for s in sidecars(spec)] == [sidecar_uid]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
        (
            {"auth": {"enabled": False}},
            "auth.enabled is false and TLS is not mutual (tls.enabled with tls.caKey): any process that reaches "
            "a pod's peer port could handshake and read every registered KV byte",
        ),
        (
            {"auth": {"enabled": False}, "tls": {"enabled": True, "secretName": "t", "caKey": ""}},
            "auth.enabled is false and TLS is not mutual",
        ),
        (
            {"auth": {"enabled": False}, "insecure": True},
            "metrics.auth is token but auth.enabled is false: there is no token for /metrics to ask for",
        ),
        (
            {"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
            "enable one of them",
        ),
        ({"gpu": {"sidecarAccess": "resourceClaims"}}, "needs gpu.resourceClaims"),
        (
            {"decode": {"gpu": {"sidecarAccess": "none", "mps": {"enabled": True}}}},
            "decode: gpu.mps.enabled needs GPU containers that both see the GPU "
            "(variant is cuda, gpu.sidecarAccess is none)",
        ),
        (
            {"gpu": {"mps": {"enabled": True}}},
            "prefill: gpu.mps.enabled needs vLLM and the sidecars to run as one UID, but vLLM runs as 0 "
            "(vllm.securityContext.runAsUser unset: the vLLM images' root) and the sidecars as 10001 "
            "(sidecar.securityContext.runAsUser). The MPS control daemon runs one server per UID: a client of "
            "another UID hangs in CUDA context creation until the running server's clients exit. Set "
            "vllm.securityContext.runAsUser: 10001 (the sidecars' UID), or run the sidecars as vLLM's UID "
            "(sidecar.securityContext.runAsUser: 0, with runAsNonRoot: false for 0)",
        ),
        (
            {
                "gpu": {"mps": {"enabled": True}},
                "podSecurityContext": {"runAsUser": 10001},
                "decode": {"vllm": {"securityContext": {"runAsUser": 1000}}},
            },
            "decode: gpu.mps.enabled needs vLLM and the sidecars to run as one UID, but vLLM runs as 1000 "
            "(vllm.securityContext.runAsUser) and the sidecars as 10001 (sidecar.securityContext.runAsUser)",
        ),
        (
            {"vllm": {"tensorParallelSize": 2}, "sidecar": {"ports": {"data": 50052}}},
            "port 50052 is both sidecar.ports.data and sidecar.ports.peer+1 (rank 1)",
        ),
        (
            {"decode": {"vllm": {"tensorParallelSize": 4, "port": 9402}}},
            "decode: port 9402 is both vllm.port and sidecar.ports.metrics+2 (rank 2)",
        ),
        (
            {"vllm": {"tensorParallelSize": 2, "pipelineParallelSize": 2}, "sidecar": {"ports": {"metrics": 50049}}},
            "port 50051 is both sidecar.ports.peer and sidecar.ports.metrics+2 (rank 2)",
        ),
        (
            {"vllm": {"tensorParallelSize": 8}, "sidecar": {"ports": {"peer": 65530}}},
            "sidecar.ports.peer+6 (rank 6) = 65536 is above 65535",
        ),
        (
            {"vllm": {"tensorParallelSize": 4}, "sidecar": {"ucx": {"netDevicesByRank": ["mlx5_0:1", "mlx5_1:1"]}}},
            "sidecar.ucx.netDevicesByRank has 2 entries for 4 ranks",
        ),
        (
            {"vllm": {"tensorParallelSize": 2}, "sidecar": {"mooncake": {"deviceByRank": ["mlx5_0"]}}},
            "sidecar.mooncake.deviceByRank has 1 entries for 2 ranks",
        ),
        (
            {"sidecar": {"backend": "mooncake"}},
            "prefill: sidecar.backend mooncake: the Mooncake transfer engine tells anyone who reaches its ports",
        ),
        (
            {"sidecar": {"extraArgs": ["--peer-frames-port=50200"]}},
            "sidecar.extraArgs: --peer-frames-port is set by the chart, per rank",
        ),
        (
            {
                "vllm": {"tensorParallelSize": 2},
                "decode": {"sidecar": {"backend": "worker", "ucx": {"netDevicesByRank": ["mlx5_0:1", "mlx5_1:1"]}}},
            },
            "decode: sidecar.ucx.netDevicesByRank cannot be applied with sidecar.backend worker: every rank's "
            "agent runs in the one vLLM container and shares its environment (one UCX_NET_DEVICES)",
        ),
        (
            {"sidecar": {"extraArgs": ["--local-socket=/run/kvxfer/kvxfer.sock"]}},
            "sidecar.extraArgs: --local-socket is set by the chart, per rank",
        ),
        (
            {"terminationGracePeriodSeconds": 20},
            "terminationGracePeriodSeconds (20) must exceed sidecar.drainSeconds (20)",
        ),
    ],
    ids=[
        "tls-without-secret",
        "no-credentials",
        "tls-without-client-certificates",
        "metrics-token-without-auth",
        "two-monitors",
        "claims-without-claims",
        "mps-without-sidecar-gpu",
        "mps-vllm-root-sidecars-10001",
        "mps-role-vllm-uid-differs",
        "data-port-collides-with-rank-1",
        "vllm-port-collides-with-rank-2",
        "metrics-range-overlaps-peer-range",
        "port-above-65535",
        "net-devices-short",
        "mooncake-devices-short",
        "mooncake-needs-insecure",
        "extra-args-peer-frames-port",
        "worker-agent-per-rank-devices",
        "extra-args-chart-flag",
        "grace-not-above-drain",
    ],
)
def test_render_refuses(values: dict[str, Any], message: str, helm_render: Path, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    # The schema accepts these: only the chart, seeing all values at once, can tell.
    out = run([tool("check-jsonschema"), "--schemafile", str(SCHEMA), str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    out = render_chart(helm_render, path)
    assert out.returncode != 0, out.stdout
    assert message in out.stderr, out.stderr


def test_tls_and_token_files(helm_render: Path, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tls": {"enabled": True, "secretName": "t"},
                "auth": {"enabled": True, "secretName": "a"},
                "vllm": {"tensorParallelSize": 2},
            }
        )
    )
    out = render_chart(helm_render, path)
    assert out.returncode == 0, out.stderr
    for role, spec in pod_specs(load_docs(out.stdout)).items():
        check_worker_pod(role, spec)
        for sidecar in sidecars(spec):
            args = sidecar["args"]
            assert "--tls-cert=/etc/kvxfer/tls/tls.crt" in args
            assert "--tls-key=/etc/kvxfer/tls/tls.key" in args
            assert "--tls-ca=/etc/kvxfer/tls/ca.crt" in args
            assert "--tls-server-name=kvxfer-peer" in args
            assert "--token-file=/etc/kvxfer/auth/token" in args
            # The preStop drain calls the local API, which wants the token too.
            assert "--token-file=/etc/kvxfer/auth/token" in sidecar["lifecycle"]["preStop"]["exec"]["command"]
        secrets = {v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        assert secrets == {"t", "a"}
        for settings in sidecar_settings(spec, tmp_path):
            assert settings.tls_ca is not None
            assert settings.tls_server_name == "kvxfer-peer"
            assert settings.token_file is not None


# ------------------------------------------------------------------ the sidecar accepts them
def _kubelet_expand(value: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def sidecar_settings(spec: dict[str, Any], tmp_path: Path) -> list[Any]:
    """Parse every sidecar's args and KVXFER_* env with kvxfer's own settings loader, as
    `kvxfer serve` would in the pod (files named by flags are stood in for by temp files)."""
    from kvxfer.config import load_settings

    downward = {"POD_NAME": "kvxfer-decode-7c9f-abcde", "POD_IP": "10.1.2.3"}
    out = []
    for sidecar in sidecars(spec):
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
        out.append(load_settings(flags, env))
    return out


@pytest.mark.parametrize("values", VALUES, ids=_ids(VALUES))
def test_sidecar_accepts_rendered_settings(values: Path, helm_render: Path, tmp_path: Path) -> None:
    for role, spec in pod_specs(_render(helm_render, values)).items():
        base = None
        for r, settings in enumerate(sidecar_settings(spec, tmp_path)):
            assert settings.role == role
            assert settings.engine_id == "kvxfer-decode-7c9f-abcde"
            port = settings.peer_host_port[1]
            base = port if base is None else base
            assert port == base + r
            # What the sidecar tells its worker (and the worker tells decode) to dial.
            assert settings.advertise_address() == f"10.1.2.3:{base + r}"


# The sidecar's bounds (kvxfer/config.py) and the schema's must agree: a value the schema lets
# through must start the sidecar.
SCHEMA_BOUNDS = {
    "leaseSeconds": "lease_seconds",
    "transferTimeoutSeconds": "transfer_timeout_seconds",
    "drainSeconds": "drain_seconds",
    "maxMessageBytes": "max_message_bytes",
    "busyPollSeconds": "busy_poll_seconds",
    "busyPollAboveRate": "busy_poll_above_rate",
    "nixlThreadPostBytes": "nixl_thread_post_bytes",
}


@pytest.mark.parametrize("bound", ["minimum", "maximum"])
def test_schema_bounds_start_the_sidecar(bound: str, helm_render: Path, tmp_path: Path) -> None:
    props = json.loads(SCHEMA.read_text())["definitions"]["sidecar"]["properties"]
    sidecar = {key: props[key][bound] for key in SCHEMA_BOUNDS}
    values = {"sidecar": sidecar, "terminationGracePeriodSeconds": int(sidecar["drainSeconds"]) + 30}
    docs = _render_values(helm_render, tmp_path, values)
    for spec in pod_specs(docs).values():
        (settings,) = sidecar_settings(spec, tmp_path)
        for key, field in SCHEMA_BOUNDS.items():
            assert getattr(settings, field) == sidecar[key], key


def _data_plane_env(spec: dict[str, Any]) -> list[dict[str, Any]]:
    (vllm,) = [c for c in spec["containers"] if c["name"] == "vllm"]
    return [e for e in vllm["env"] if e["name"] == "KVXFER_VLLM_DATA_PLANE"]


WORKER = [{"name": "KVXFER_VLLM_DATA_PLANE", "value": "worker"}]


def test_worker_backend_tells_the_connector(helm_render: Path, tmp_path: Path) -> None:
    """sidecar.backend worker: every sidecar runs --backend=worker and vLLM's connector gets data_plane worker."""
    docs = _render_values(helm_render, tmp_path, {"sidecar": {"backend": "worker"}})
    validate_manifests(docs, tmp_path)
    for spec in pod_specs(docs).values():
        assert all(_opts(s)["--backend"] == "worker" for s in sidecars(spec))
        assert _data_plane_env(spec) == WORKER
    for spec in pod_specs(_render(helm_render, CHART / "values.yaml")).values():
        assert _data_plane_env(spec) == []


@pytest.mark.parametrize(
    ("values", "backends"),
    [
        ({"decode": {"sidecar": {"backend": "worker"}}}, {"prefill": "nixl", "decode": "worker"}),
        ({"sidecar": {"backend": "worker"}, "prefill": {"sidecar": {"backend": "nixl"}}},
         {"prefill": "nixl", "decode": "worker"}),
    ],
    ids=["role-worker-global-nixl", "global-worker-role-nixl"],
)  # fmt: skip
def test_worker_backend_per_role(values: dict[str, Any], backends: dict[str, str], helm_render: Path,
                                 tmp_path: Path) -> None:  # fmt: skip
    """A role's own sidecar.backend decides both its sidecars' --backend and its vLLM container's
    KVXFER_VLLM_DATA_PLANE: a worker-mode sidecar whose worker has no agent refuses its registration."""
    pods = pod_specs(_render_values(helm_render, tmp_path, values))
    for role, spec in pods.items():
        assert [_opts(s)["--backend"] for s in sidecars(spec)] == [backends[role]], role
        assert _data_plane_env(spec) == (WORKER if backends[role] == "worker" else []), role


RDMA_VALUES: dict[str, Any] = {
    "vllm": {"tensorParallelSize": 2},
    "sidecar": {
        "nixlPluginDir": "/opt/nixl/plugins",
        "ucx": {"tls": "rc,ud,sm,self,cuda_copy,cuda_ipc", "netDevices": "mlx5_0:1,mlx5_1:1", "gidIndex": 3},
    },
    "rdma": {"enabled": True, "resources": {"rdma/ib": 1}, "ipcLock": True},
}
UCX_ENV = [
    {"name": "UCX_TLS", "value": "rc,ud,sm,self,cuda_copy,cuda_ipc"},
    {"name": "UCX_NET_DEVICES", "value": "mlx5_0:1,mlx5_1:1"},
    {"name": "UCX_IB_GID_INDEX", "value": "3"},
    {"name": "NIXL_PLUGIN_DIR", "value": "/opt/nixl/plugins"},
]


def _data_plane_env_of(container: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in container["env"] if e["name"].startswith(("UCX_", "NIXL_", "KVXFER_VLLM_DATA_PLANE"))]


@pytest.mark.parametrize("worker_role", ["decode", "both"])
def test_worker_backend_gives_vllm_the_rdma_devices(worker_role: str, helm_render: Path, tmp_path: Path) -> None:
    """sidecar.backend worker with rdma.enabled: the vLLM process's own NIXL agent does the READs, so
    the vLLM container gets the RDMA device (the device plugin exposes /dev/infiniband only to the
    containers that ask for it; count x ranks), IPC_LOCK and the UCX/NIXL environment; its sidecars,
    which then move nothing, get none of them. A role on the sidecar's own agent keeps them there."""
    values = json.loads(json.dumps(RDMA_VALUES))
    if worker_role == "both":
        values["sidecar"]["backend"] = "worker"
    else:
        values[worker_role] = {"sidecar": {"backend": "worker"}}
    docs = _render_values(helm_render, tmp_path, values)
    validate_manifests(docs, tmp_path)
    for role, spec in pod_specs(docs).items():
        check_worker_pod(role, spec)
        (vllm,) = spec["containers"]
        worker = worker_role in (role, "both")
        for sidecar in sidecars(spec):
            assert _opts(sidecar)["--backend"] == ("worker" if worker else "nixl")
            if worker:
                assert sidecar["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi"},
                                                "limits": {"memory": "4Gi"}}  # fmt: skip
                assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
                assert _data_plane_env_of(sidecar) == []
            else:
                assert sidecar["resources"] == {"requests": {"cpu": "500m", "memory": "1Gi", "rdma/ib": 1},
                                                "limits": {"memory": "4Gi", "rdma/ib": 1}}  # fmt: skip
                assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
                assert _data_plane_env_of(sidecar) == UCX_ENV
        if worker:
            assert vllm["resources"] == {"requests": {"rdma/ib": 2, "nvidia.com/gpu": 2},
                                         "limits": {"rdma/ib": 2, "nvidia.com/gpu": 2}}  # fmt: skip
            assert vllm["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
            assert _data_plane_env_of(vllm) == WORKER + UCX_ENV
        else:
            assert vllm["resources"] == {"limits": {"nvidia.com/gpu": 2}}
            assert "securityContext" not in vllm
            assert _data_plane_env_of(vllm) == []


def test_worker_backend_keeps_vllms_own_security_context(helm_render: Path, tmp_path: Path) -> None:
    """IPC_LOCK joins what vllm.securityContext already adds; without RDMA no device and no IPC_LOCK,
    but the UCX settings still go to the agent's container, vLLM's."""
    vllm_values = {"securityContext": {"runAsUser": 10001, "capabilities": {"add": ["SYS_NICE"]}}}
    values = {**RDMA_VALUES, "sidecar": {**RDMA_VALUES["sidecar"], "backend": "worker"}, "vllm": vllm_values}
    for spec in pod_specs(_render_values(helm_render, tmp_path, values)).values():
        (vllm,) = spec["containers"]
        assert vllm["securityContext"] == {"runAsUser": 10001, "capabilities": {"add": ["SYS_NICE", "IPC_LOCK"]}}
        assert vllm["resources"]["limits"] == {"rdma/ib": 1, "nvidia.com/gpu": 1}
    values["rdma"] = {"enabled": False}
    for spec in pod_specs(_render_values(helm_render, tmp_path, values)).values():
        (vllm,) = spec["containers"]
        assert vllm["securityContext"] == {"runAsUser": 10001, "capabilities": {"add": ["SYS_NICE"]}}
        assert vllm["resources"] == {"limits": {"nvidia.com/gpu": 1}}
        assert _data_plane_env_of(vllm) == WORKER + UCX_ENV
        assert _data_plane_env_of(sidecars(spec)[0]) == []


def test_notes_give_each_roles_ports(helm_render: Path, tmp_path: Path) -> None:
    """NOTES name each role's backend and ports (a role may override sidecar.ports and sidecar.backend)."""
    path = tmp_path / "values.yaml"
    decode = {"sidecar": {"backend": "worker", "ports": {"peer": 51051, "metrics": 9500}}}
    path.write_text(yaml.safe_dump({"decode": decode}))
    out = render_chart(helm_render, path, extra=["-notes"])
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("\nNOTES:\n", 1)[1]
    assert (
        "  prefill: deployment/kvxfer-prefill (1 replica(s)),\n"
        "    1 worker rank(s) per pod, sidecars kvxfer-0..kvxfer-0 (backend nixl),\n"
        "    rank r's peer port 50051+r, metrics port 9400+r,\n"
    ) in notes
    assert (
        "  decode: deployment/kvxfer-decode (1 replica(s)),\n"
        "    1 worker rank(s) per pod, sidecars kvxfer-0..kvxfer-0 (backend worker),\n"
        "    rank r's peer port 51051+r, metrics port 9500+r,\n"
    ) in notes
    assert "Metrics:         each role's metrics port + r for rank r" in notes


def test_busy_poll_is_off_unless_asked(helm_render: Path, tmp_path: Path) -> None:
    """sidecar.busyPollSeconds: no flag by default (the sidecar's own default, off), the value when set."""
    for values, want in (({}, None), ({"sidecar": {"busyPollSeconds": 0.05}}, 0.05)):
        for spec in pod_specs(_render_values(helm_render, tmp_path, values)).values():
            for sidecar, settings in zip(sidecars(spec), sidecar_settings(spec, tmp_path), strict=True):
                flags = [a for a in sidecar["args"] if a.startswith("--busy-poll-seconds")]
                assert flags == ([] if want is None else [f"--busy-poll-seconds={want}"])
                assert settings.busy_poll_seconds == (want or 0.0)


def test_busy_poll_above_a_rate_is_the_sidecars_default_unless_set(helm_render: Path, tmp_path: Path) -> None:
    """sidecar.busyPollAboveRate: no flag by default (the sidecar's 500 a second, off under a tight CPU
    limit); a value, 0 included, is passed as is."""
    for values, want in (({}, None), ({"sidecar": {"busyPollAboveRate": 0}}, 0.0),
                         ({"sidecar": {"busyPollAboveRate": 2000}}, 2000.0)):  # fmt: skip
        for spec in pod_specs(_render_values(helm_render, tmp_path, values)).values():
            for sidecar, settings in zip(sidecars(spec), sidecar_settings(spec, tmp_path), strict=True):
                flags = [a for a in sidecar["args"] if a.startswith("--busy-poll-above-rate")]
                assert flags == ([] if want is None else [f"--busy-poll-above-rate={want:g}"])
                assert settings.busy_poll_above_rate == (500.0 if want is None else want)
                assert ("busy_poll_above_rate" in settings.model_fields_set) == (want is not None)


def test_nixl_thread_posts_are_the_sidecars_default_unless_set(helm_render: Path, tmp_path: Path) -> None:
    """sidecar.nixlThreadPostBytes: no flag by default (the sidecar's 4 MiB); a value, 0 included, as is."""
    for values, want in (({}, None), ({"sidecar": {"nixlThreadPostBytes": 0}}, 0),
                         ({"sidecar": {"nixlThreadPostBytes": 16777216}}, 16777216)):  # fmt: skip
        for spec in pod_specs(_render_values(helm_render, tmp_path, values)).values():
            for sidecar, settings in zip(sidecars(spec), sidecar_settings(spec, tmp_path), strict=True):
                flags = [a for a in sidecar["args"] if a.startswith("--nixl-thread-post-bytes")]
                assert flags == ([] if want is None else [f"--nixl-thread-post-bytes={want}"])
                assert settings.nixl_thread_post_bytes == (4 << 20 if want is None else want)
                assert settings.transport_config().nixl_thread_post_bytes == settings.nixl_thread_post_bytes


def _docs_extra_args() -> list[str]:
    """Every sidecar flag the docs tell users to put in sidecar.extraArgs ("add `X` to `sidecar.extraArgs`")."""
    text = "\n".join(p.read_text() for p in sorted((CHART.parents[1] / "docs").glob("*.md")))
    return re.findall(r"add\s+`(--[^`]+)`\s+to\s+`sidecar\.extraArgs`", text)


def test_docs_extra_args_start_the_sidecar(helm_render: Path, tmp_path: Path) -> None:
    """What the docs tell users to add to sidecar.extraArgs is one argv item each (the chart renders
    every list item as one argument) that `kvxfer serve`'s own parser accepts: `--peer-frames false`
    as one item is an unknown flag, and the sidecar exits 2."""
    from kvxfer.server.cli import parse_serve_args

    suggested = _docs_extra_args()
    assert suggested, "docs/*.md suggest no sidecar.extraArgs"
    downward = {"POD_NAME": "kvxfer-decode-7c9f-abcde", "POD_IP": "10.1.2.3"}
    token = tmp_path / "token"
    token.write_text("stand-in\n")
    for arg in suggested:
        for spec in pod_specs(_render_values(helm_render, tmp_path, {"sidecar": {"extraArgs": [arg]}})).values():
            (sidecar,) = sidecars(spec)
            assert sidecar["args"][-1] == arg
            argv = [_kubelet_expand(a, downward) for a in sidecar["args"][1:]]
            argv = [f"--token-file={token}" if a.startswith("--token-file=") else a for a in argv]
            settings = parse_serve_args(argv)
            if arg == "--peer-frames=false":
                assert settings.peer_frames is False
    assert "--peer-frames=false" in suggested, suggested


@pytest.mark.parametrize("tls", [False, True], ids=["cleartext", "tls"])
def test_peer_ports_app_protocol(tls: bool, helm_render: Path, tmp_path: Path) -> None:
    """The headless Services declare the peer ports as kubernetes.io/h2c (gRPC over cleartext HTTP/2)
    only without TLS: with tls.enabled they speak TLS, and h2c would make a mesh or gateway that
    trusts the declaration send them cleartext."""
    values: dict[str, Any] = {"vllm": {"tensorParallelSize": 2}}
    if tls:
        values["tls"] = {"enabled": True, "secretName": "t"}
    docs = _render_values(helm_render, tmp_path, values)
    for role in ("prefill", "decode"):
        (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == f"kvxfer-{role}"]
        peers = [p for p in svc["spec"]["ports"] if p["name"] != "http"]
        assert [p["name"] for p in peers] == ["kvxfer-peer", "peer-1"]
        if tls:
            assert [p.get("appProtocol") for p in peers] == [None, None], peers
        else:
            assert [p["appProtocol"] for p in peers] == ["kubernetes.io/h2c"] * 2, peers


def test_tls_exec_probes_outwait_the_cli(helm_render: Path, tmp_path: Path) -> None:
    """With TLS the probes run `kvxfer health`: the sidecar gets the probe's timeoutSeconds to answer
    (--timeout-seconds), the kubelet 3 s more for the CLI's start (2 and 5 by default). Equal, the
    kubelet killed a probe whose CLI was still starting or about to report its own timeout."""
    values: dict[str, Any] = {"tls": {"enabled": True, "secretName": "t"}}
    values["sidecar"] = {"livenessProbe": {"timeoutSeconds": 4}}
    for spec in pod_specs(_render_values(helm_render, tmp_path, values)).values():
        (sidecar,) = sidecars(spec)
        got = {p: (sidecar[p]["exec"]["command"][-1], sidecar[p]["timeoutSeconds"])
               for p in ("startupProbe", "livenessProbe", "readinessProbe")}  # fmt: skip
        assert got == {
            "startupProbe": ("--timeout-seconds=2", 5),
            "livenessProbe": ("--timeout-seconds=4", 7),
            "readinessProbe": ("--timeout-seconds=2", 5),
        }
    # Kubernetes' own gRPC probes keep the value as it is.
    for spec in pod_specs(_render(helm_render, CHART / "values.yaml")).values():
        (sidecar,) = sidecars(spec)
        assert [sidecar[p]["timeoutSeconds"] for p in ("startupProbe", "livenessProbe", "readinessProbe")] == [2] * 3


@pytest.mark.parametrize(
    ("tls", "want"),
    [
        ({"enabled": True, "secretName": "t"}, ["--tls-server-name=kvxfer-peer"]),
        ({"enabled": True, "secretName": "t", "serverName": "peers.kvxfer.example"},
         ["--tls-server-name=peers.kvxfer.example"]),
        ({"enabled": True, "secretName": "t", "serverName": ""}, []),
        ({"enabled": False, "serverName": "peers.kvxfer.example"}, []),
    ],
    ids=["default", "own-name", "empty", "no-tls"],
)  # fmt: skip
def test_tls_server_name_on_every_sidecar(tls: dict[str, Any], want: list[str], helm_render: Path,
                                          tmp_path: Path) -> None:  # fmt: skip
    """tls.serverName: every sidecar of every role and rank expects that name in a peer's certificate
    (--tls-server-name), since peers advertise pod IPs that a shared certificate cannot list; only
    with TLS (the sidecar refuses the flag without it), and not when set empty."""
    values = {"tls": tls, "prefill": {"vllm": {"tensorParallelSize": 2}}}
    for role, spec in pod_specs(_render_values(helm_render, tmp_path, values)).items():
        check_worker_pod(role, spec)
        for sidecar, settings in zip(sidecars(spec), sidecar_settings(spec, tmp_path), strict=True):
            assert [a for a in sidecar["args"] if a.startswith("--tls-server-name")] == want
            assert settings.tls_server_name == (want[0].split("=", 1)[1] if want else None)


def test_notes_name_the_tls_server_name(helm_render: Path, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"tls": {"enabled": True, "secretName": "kvxfer-peer-tls"}}))
    out = render_chart(helm_render, path, extra=["-notes"])
    assert out.returncode == 0, out.stderr
    assert (
        "Sidecars check a peer's certificate for the DNS name kvxfer-peer (tls.serverName):\n"
        "                 the certificate of Secret kvxfer-peer-tls must carry it as a subject alternative name."
    ) in out.stdout


def test_tls_server_name_schema_is_the_sidecars() -> None:
    """A tls.serverName the schema lets through must start the sidecar: same pattern and length."""
    from kvxfer.config import Settings

    schema = json.loads(SCHEMA.read_text())["properties"]["tls"]["properties"]["serverName"]
    field = Settings.model_fields["tls_server_name"]
    (pattern,) = [m.pattern for m in field.metadata if getattr(m, "pattern", None)]
    (max_length,) = [m.max_length for m in field.metadata if getattr(m, "max_length", None)]
    assert schema["pattern"] == "^$|" + pattern
    assert schema["maxLength"] == max_length
