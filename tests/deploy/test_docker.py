"""docker/Dockerfile: hadolint, plus the project's own rules (no Docker engine runs here)."""

from __future__ import annotations

import re
import shlex

from .conftest import ROOT, run, tool

DOCKERFILE = ROOT / "docker" / "Dockerfile"
IGNORE = ROOT / "docker" / "Dockerfile.dockerignore"


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#") and not buf:
            continue
        if line.lstrip().startswith("#"):
            continue
        buf += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _stages() -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for ins in _instructions():
        if ins[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(ins)
    return stages


def test_hadolint() -> None:
    out = run([tool("hadolint"), "--failure-threshold", "info", str(DOCKERFILE)])
    assert out.returncode == 0, out.stdout + out.stderr


def test_base_images_pinned() -> None:
    ins = _instructions()
    global_args = {}
    for word, rest in ins:
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            global_args[k] = v.strip('"')
    stage_names: set[str] = set()
    for word, rest in ins:
        if word != "FROM":
            continue
        parts = rest.split()
        image = parts[0]
        if image in stage_names:
            continue
        m = re.fullmatch(r"\$\{(\w+)\}", image)
        if m:
            image = global_args[m.group(1)]
        assert ":" in image.split("/")[-1] or "@sha256:" in image, f"FROM {image} has no tag"
        tag = image.split("@")[0].rsplit(":", 1)[1]
        assert tag != "latest", f"FROM {image}: pin a versioned tag"
        assert re.search(r"\d", tag), f"FROM {image}: pin a versioned tag, not {tag!r}"
        if len(parts) == 3 and parts[1].upper() == "AS":
            stage_names.add(parts[2])
    assert "latest" not in DOCKERFILE.read_text().replace("--upgrade", "")


def test_runtime_stage() -> None:
    final = _stages()[-1]
    words = [w for w, _ in final]
    assert "HEALTHCHECK" not in [w for w, _ in _instructions()], "Kubernetes probes do health checks"
    users = [rest for w, rest in final if w == "USER"]
    assert users, "the final stage must switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, users
    assert ("ENTRYPOINT", '["kvxfer"]') in final
    assert ("CMD", '["serve"]') in final
    assert words.index("USER") > max(i for i, w in enumerate(words) if w == "RUN"), "USER after the last RUN"
    labels = " ".join(rest for w, rest in final if w == "LABEL")
    for key in ("title", "description", "version", "revision", "source", "licenses", "created"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    apt = " ".join(rest for w, rest in final if w == "RUN" and "apt-get install" in rest)
    for pkg in ("libibverbs1", "librdmacm1", "libnuma1", "ibverbs-providers"):
        assert pkg in shlex.split(apt), pkg
    assert "--no-install-recommends" in apt
    assert "rm -rf /var/lib/apt/lists" in apt
    # Only the venv comes from the build stage: no compilers, no sources.
    copies = [rest for w, rest in final if w == "COPY"]
    assert copies == ["--from=build /opt/kvxfer /opt/kvxfer"], copies


def test_variants() -> None:
    text = DOCKERFILE.read_text()
    assert "ARG VARIANT=" in text
    assert "mooncake-cpu" in text
    assert "mooncake-cuda" in text
    assert "download.pytorch.org/whl/cpu" in text
    # nixl[cu12] comes with kvxfer's own dependencies (pyproject.toml).
    assert '"nixl[cu12]' in (ROOT / "pyproject.toml").read_text()
    # Every package but torch at the versions CI tests.
    (install,) = [rest for w, rest in _stages()[0] if w == "RUN" and "pip install" in rest and "torch==" in rest]
    assert "pip install -c constraints.txt " in install, install
    for extra in ("mooncake-cpu", "mooncake-cuda"):
        assert f"{extra} = [" in (ROOT / "pyproject.toml").read_text(), extra


def test_dockerignore_is_an_allow_list() -> None:
    lines = [x for x in IGNORE.read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "*"
    assert {"!pyproject.toml", "!README.md", "!constraints.txt", "!kvxfer/"} <= set(lines)
    # Every file the Dockerfile COPYs from the context is allowed.
    for word, rest in [i for i in _instructions() if i[0] == "COPY" and "--from" not in i[1]]:
        for src in rest.split()[:-1]:
            assert f"!{src.rstrip('/')}" in {x.rstrip("/") for x in lines}, f"{word} {src} is ignored"


def _global_args() -> dict[str, str]:
    out = {}
    for word, rest in _instructions():
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            k, v = rest.split("=", 1)
            out[k] = v.strip('"')
    return out


def _stage(name: str) -> list[tuple[str, str]]:
    (stage,) = [s for s in _stages() if s[0][1].split()[-1] == name]
    return stage


def test_vllm_worker_image_is_a_supported_vllm() -> None:
    """The vllm-worker stage's default base is the vLLM release the repository pins for its vLLM 0.33
    checks (the Makefile's VLLM033_SPEC), one the connector supports; docs/deploy.md builds the same."""
    from kvxfer.integrations.vllm.spec import SUPPORTED_VLLM, vllm_version_supported

    image = _global_args()["VLLM_IMAGE"]
    assert _stage("vllm-worker")[0] == ("FROM", "${VLLM_IMAGE} AS vllm-worker")
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+\.\d+\.\d+)", image)
    assert m, image
    assert vllm_version_supported(m.group(1)), (image, SUPPORTED_VLLM)
    (spec,) = re.findall(r"^VLLM033_SPEC \?= vllm==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    assert m.group(1) == spec, (image, spec)
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert f"--build-arg VLLM_IMAGE={image}" in docs
    assert set(re.findall(r"vllm/vllm-openai:v[\d.]+", docs + DOCKERFILE.read_text())) == {image}


def test_vllm_worker_installs_with_constraints() -> None:
    """kvxfer's dependencies in the vLLM image come at the versions its tests run beside vLLM
    (constraints-vllm.txt, make vllm-setup), as docs/deploy.md says, not whatever pip picks that day."""
    stage = _stage("vllm-worker")
    (install,) = [rest for w, rest in stage if w == "RUN" and "pip install" in rest]
    assert "pip install --no-cache-dir -c /tmp/constraints-vllm.txt /tmp/wheels/kvxfer-*.whl" in install, install
    assert ("COPY", "constraints-vllm.txt /tmp/constraints-vllm.txt") in stage
    assert "make vllm-setup" in " ".join((ROOT / "constraints-vllm.txt").read_text().splitlines()[:2])
    assert "`constraints-vllm.txt`" in (ROOT / "docs" / "deploy.md").read_text()


def test_image_settings_are_documented_and_valid() -> None:
    """Every KVXFER_* variable the image sets is one the sidecar reads, and docs/deploy.md says it
    (the image then behaves unlike `kvxfer serve` with its defaults)."""
    from kvxfer.config import Settings, env_name

    known = {env_name(f) for f in Settings.model_fields}
    image_env = [
        pair
        for word, rest in _instructions()
        if word == "ENV"
        for pair in shlex.split(rest)
        if pair.startswith("KVXFER_")
    ]
    assert image_env, "the image sets no KVXFER_* variable"
    docs = (ROOT / "docs" / "deploy.md").read_text()
    for pair in image_env:
        assert pair.partition("=")[0] in known, pair
        assert f"`{pair}`" in docs, f"docs/deploy.md does not say that the image sets {pair}"
