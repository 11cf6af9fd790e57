"""deploy/: the kustomize overlays render offline and validate strictly; the base is the chart's."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from .conftest import OVERLAYS, ROOT, load_docs, render_chart, run, tool, validate_manifests
from .test_chart import check_metrics_objects, check_mps_pod, check_worker_pod, pod_specs, sidecars


def _kustomize(overlay: Path) -> str:
    out = run([tool("kubectl"), "kustomize", str(overlay)])
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_overlays_exist() -> None:
    assert {p.name for p in OVERLAYS} >= {"cpu", "rdma"}


def _worker_pods(overlay: Path, tmp_path: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """The overlay rendered and validated strictly: its objects, and the two roles' checked pod specs."""
    docs = load_docs(_kustomize(overlay))
    validate_manifests(docs, tmp_path)
    pods = pod_specs(docs)
    assert set(pods) == {"prefill", "decode"}
    for role, spec in pods.items():
        check_worker_pod(role, spec)
    return docs, pods


@pytest.mark.parametrize("overlay", OVERLAYS, ids=[p.name for p in OVERLAYS])
def test_overlay_validates(overlay: Path, tmp_path: Path) -> None:
    docs, _ = _worker_pods(overlay, tmp_path)
    check_metrics_objects(docs)


def test_cpu_overlay_has_no_gpu() -> None:
    text = _kustomize(ROOT / "deploy" / "overlays" / "cpu")
    assert "nvidia.com/gpu" not in text
    assert "NVIDIA_VISIBLE_DEVICES" not in text
    assert "ghcr.io/kvxfer/kvxfer:0.1.0-cpu" in text
    pods = pod_specs(load_docs(text))
    for spec in pods.values():
        (vllm,) = spec["containers"]
        # The overlay appends to vLLM's args: each role keeps its own kv_role from the base.
        assert vllm["args"][-2:] == ["--block-size=32", "--max-num-seqs=16"]
        (sidecar,) = sidecars(spec)
        assert {"name": "UCX_TLS", "value": "tcp,sm,self"} in sidecar["env"]


def test_rdma_overlay_resources() -> None:
    """GPU RDMA through the worker's own NIXL agent (the route docs/gpu.md calls sure): the sidecar
    runs --backend=worker and moves no bytes, so the device, IPC_LOCK and the UCX settings are vLLM's."""
    docs = load_docs(_kustomize(ROOT / "deploy" / "overlays" / "rdma"))
    for spec in pod_specs(docs).values():
        (sidecar,) = sidecars(spec)
        (vllm,) = spec["containers"]
        assert "--backend=worker" in sidecar["args"]
        assert "rdma/ib" not in sidecar["resources"]["limits"]
        assert "rdma/ib" not in sidecar["resources"]["requests"]
        assert sidecar["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert [e["name"] for e in sidecar["env"] if e["name"].startswith(("UCX_", "NIXL_"))] == []
        assert vllm["resources"]["limits"]["rdma/ib"] == vllm["resources"]["requests"]["rdma/ib"] == 1
        assert vllm["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env["KVXFER_VLLM_DATA_PLANE"] == "worker"
        assert {"UCX_TLS", "UCX_NET_DEVICES", "UCX_IB_GID_INDEX"} <= set(env)
    assert any(d["kind"] == "ServiceMonitor" for d in docs)


def test_rdma_overlay_is_what_the_chart_renders(helm_render: Path, tmp_path: Path) -> None:
    """The overlay's worker-mode pods say what the chart says for the same values (chart-values.yaml
    plus worker backend and RDMA): sidecar args, and vLLM's data-plane env, RDMA device and IPC_LOCK."""
    values = tmp_path / "rdma.yaml"
    values.write_text(
        "sidecar:\n  backend: worker\n  ucx: {tls: 'rc,ud,sm,self,cuda_copy,cuda_ipc', netDevices: 'mlx5_0:1',"
        " gidIndex: 3}\nrdma: {enabled: true}\n"
    )
    out = render_chart(helm_render, ROOT / "deploy" / "base" / "chart-values.yaml", values)
    assert out.returncode == 0, out.stderr
    chart = pod_specs(load_docs(out.stdout))
    overlay = pod_specs(load_docs(_kustomize(ROOT / "deploy" / "overlays" / "rdma")))
    for role, spec in overlay.items():
        want = chart[role]
        assert sidecars(spec)[0]["args"] == sidecars(want)[0]["args"], role
        (vllm,), (want_vllm,) = spec["containers"], want["containers"]

        def data_plane(c: dict[str, Any]) -> list[dict[str, Any]]:
            return [e for e in c["env"] if e["name"].startswith(("UCX_", "NIXL_", "KVXFER_VLLM_DATA_PLANE"))]

        assert data_plane(vllm) == data_plane(want_vllm), role
        assert data_plane(sidecars(spec)[0]) == data_plane(sidecars(want)[0]) == [], role
        assert vllm["securityContext"] == want_vllm["securityContext"], role
        for kind in ("requests", "limits"):
            assert vllm["resources"][kind]["rdma/ib"] == want_vllm["resources"][kind]["rdma/ib"], role
            assert "rdma/ib" not in sidecars(spec)[0]["resources"][kind], role


def test_base_is_generated_from_the_chart(helm_render: Path) -> None:
    out = run([sys.executable, "deploy/generate_base.py", "--check", "--renderer", str(helm_render)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_mps_component_joins_both_containers_to_the_node_daemon(tmp_path: Path) -> None:
    """components/mps on the base: what the chart's gpu.mps renders (test_chart.py), for kustomize users."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    deploy = ROOT / "deploy"
    base, mps = (os.path.relpath(deploy / p, overlay) for p in ("base", "components/mps"))
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {base}\ncomponents:\n  - {mps}\n"
    )
    _, pods = _worker_pods(overlay, tmp_path)
    for spec in pods.values():
        check_mps_pod(spec, "/tmp/nvidia-mps")
