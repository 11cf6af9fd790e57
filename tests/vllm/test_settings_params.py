"""The connector's settings and kv_transfer_params: defaults, precedence, and errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvxfer.integrations.vllm.params import (
    ParamsError,
    RemoteGroup,
    RemotePrefill,
    prefill_response,
    push_params,
    wants_push,
)
from kvxfer.integrations.vllm.settings import DEFAULT_SOCKET, ConnectorSettings, ConnectorSettingsError, env_var

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_match_the_chart() -> None:
    s = ConnectorSettings.load({}, env={})
    assert s.sidecar_socket == DEFAULT_SOCKET == "/run/kvxfer/kvxfer-{rank}.sock"
    assert s.socket_for(rank=3, tp_rank=1, pp_rank=1) == "/run/kvxfer/kvxfer-3.sock"
    assert s.token() is None
    assert (s.lease_seconds, s.transfer_timeout_seconds, s.kv_cache_layout) == (0.0, 30.0, "HND")
    assert (s.data_plane, s.gather) == ("sidecar", "sidecar")


def test_docs_table_lists_every_setting_with_its_variable_and_default() -> None:
    """docs/vllm.md's table of connector settings: every key, its environment variable and its default."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    start = text.index("| key | environment | default | meaning |")
    rows = [ln.strip().strip("|").split("|") for ln in text[start:].split("\n\n", 1)[0].splitlines()[2:]]
    table = {r[0].strip().strip("`"): (r[1].strip().strip("`"), r[2].replace("`", "").strip()) for r in rows}
    assert set(table) == set(ConnectorSettings.__dataclass_fields__), sorted(table)
    for name, f in ConnectorSettings.__dataclass_fields__.items():
        d = f.default
        shown = str(d).lower() if isinstance(d, bool) else f"{d:g}" if isinstance(d, float) else d or "none"
        env, written = table[name]
        assert env == env_var(name), (name, env)
        assert written == shown or written.startswith(f"{shown} ("), (name, written, shown)


def test_extra_config_wins_over_environment(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    tok.write_text("s3cret\n")
    env = {"KVXFER_LOCAL_SOCKET": "/env/{tp_rank}-{dp_rank}.sock", "KVXFER_TOKEN_FILE": str(tok),
           "KVXFER_VLLM_LEASE_SECONDS": "12"}  # fmt: skip
    s = ConnectorSettings.load({"lease_seconds": 5}, env=env)
    assert s.socket_for(rank=0, tp_rank=2, dp_rank=1) == "/env/2-1.sock"
    assert s.token() == "s3cret"
    assert s.lease_seconds == 5.0
    assert ConnectorSettings.load({}, env=env).lease_seconds == 12.0
    # vLLM's NixlConnector keys may be left in a copied config; they are ignored, not refused.
    assert ConnectorSettings.load({"backends": ["UCX"], "num_threads": 4}, env={}) == ConnectorSettings()


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ({"sidecar_sockett": "/x"}, "kv_connector_extra_config: unknown key 'sidecar_sockett'"),
        ({"sidecar_socket": "/run/{node}.sock"}, "sidecar_socket: unknown placeholder {node}"),
        ({"sidecar_socket": " "}, "sidecar_socket: must not be empty"),
        ({"lease_seconds": -1}, "lease_seconds: must be a number >= 0, got -1.0"),
        ({"lease_seconds": "soon"}, "lease_seconds: must be a number, got 'soon'"),
        ({"transfer_timeout_seconds": True}, "transfer_timeout_seconds: must be a number, got True"),
        ({"call_timeout_seconds": 0}, "call_timeout_seconds: must be a number > 0, got 0.0"),
        ({"kv_cache_layout": "NHD"}, "kv_cache_layout: 'NHD' is not one of HND, cross_layer, auto"),
        ({"sidecar_socket": 5}, "sidecar_socket: must be a string, got 5"),
        ({"data_plane": "gpu"}, "data_plane: 'gpu' is not one of sidecar, worker"),
        ({"worker_backend": "worker"}, "worker_backend: 'worker' is not a library backend (e.g. nixl)"),
        ({"push_layerwise": "maybe"}, "push_layerwise: must be true or false, got 'maybe'"),
        ({"push_layerwise": 1}, "push_layerwise: must be true or false, got 1"),
        ({"idle_wait_ms": -1}, "idle_wait_ms: must be a number >= 0, got -1.0"),
        ({"gather": "gpu"}, "gather: 'gpu' is not one of sidecar, worker"),
        ({"gather": "worker", "data_plane": "worker"}, "gather: 'worker' needs data_plane 'sidecar'"),
    ],
)
def test_bad_settings_name_the_key(extra: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConnectorSettingsError) as info:
        ConnectorSettings.load(extra, env={})
    assert fragment in info.value.message


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"KVXFER_VLLM_IDLE_WAIT_MS": "soon"}, "KVXFER_VLLM_IDLE_WAIT_MS: must be a number, got 'soon'"),
        ({"KVXFER_VLLM_LEASE_SECONDS": "-1"}, "KVXFER_VLLM_LEASE_SECONDS: must be a number >= 0, got -1.0"),
        ({"KVXFER_VLLM_PREPARE_PULLS": "maybe"}, "KVXFER_VLLM_PREPARE_PULLS: must be true or false, got 'maybe'"),
        ({"KVXFER_LOCAL_SOCKET": "/run/{node}.sock"}, "KVXFER_LOCAL_SOCKET: unknown placeholder {node}"),
        ({"KVXFER_VLLM_GATHER": "worker", "KVXFER_VLLM_DATA_PLANE": "worker"}, "KVXFER_VLLM_GATHER: 'worker' needs"),
    ],
)
def test_bad_environment_names_the_variable(env: dict[str, str], fragment: str) -> None:
    """A bad value from the environment is reported under its variable, which is what the user set."""
    with pytest.raises(ConnectorSettingsError) as info:
        ConnectorSettings.load({}, env=env)
    assert fragment in info.value.message
    assert info.value.field in ConnectorSettings.__dataclass_fields__  # the setting, as before


def test_token_file_problems_are_named(tmp_path: Path) -> None:
    missing = ConnectorSettings(token_file=str(tmp_path / "none"))
    with pytest.raises(ConnectorSettingsError, match="token_file: cannot read"):
        missing.token()
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConnectorSettingsError, match=r"token_file: .* is empty"):
        ConnectorSettings(token_file=str(tmp_path / "empty")).token()


def test_prefill_response_round_trips() -> None:
    groups = [RemoteGroup("g0", (4, 5, 9), 32), RemoteGroup("g1", (7, 8), 32, first_block=1),
              RemoteGroup("g2", (3,), 32, first_block=2, tp_split=True, segments=(48, 12, 12, 512))]  # fmt: skip
    params = prefill_response(
        engine_id="vllm-p", request_id="cmpl-1", groups=groups, num_tokens=70,
        addresses=["10.0.0.7:50051", "10.0.0.7:50052"], sidecar_engine_id="pod-a", tp_size=2, pp_size=1,
    )  # fmt: skip
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.7", 50051)
    assert params["remote_block_ids"] == [[4, 5, 9], [7, 8], [3]]  # one list per KV-cache group, as vLLM's connectors
    assert params["remote_block_size"] == 32
    assert params["kvxfer_groups"] == [
        {"name": "g0", "block_size": 32, "first_block": 0}, {"name": "g1", "block_size": 32, "first_block": 1},
        {"name": "g2", "block_size": 32, "first_block": 2, "tp_split": True,
         "segments": [48, 12, 12, 512]},  # a Mamba group says so, with its split
    ]  # fmt: skip
    got = RemotePrefill.parse(params)
    assert got == RemotePrefill("cmpl-1", "vllm-p", ("10.0.0.7:50051", "10.0.0.7:50052"), tuple(groups), 70, "pod-a",
                                tp_size=2, pp_size=1)  # fmt: skip
    assert (got.block_ids, got.block_size) == ((4, 5, 9), 32)


def test_params_without_kvxfer_groups_read_vllms_group_order() -> None:
    """From a router or prefill instance that predates kvxfer_groups: groups g0, g1... of whole block tables."""
    got = RemotePrefill.parse({"remote_request_id": "r", "remote_block_ids": [[1, 2], [3]], "remote_block_size": 16,
                               "kvxfer_addresses": ["a:1"]})  # fmt: skip
    assert got.groups == (RemoteGroup("g0", (1, 2), 16), RemoteGroup("g1", (3,), 16))


def test_legacy_params_of_one_rank_use_remote_host_and_port() -> None:
    got = RemotePrefill.parse({"remote_request_id": "r", "remote_block_ids": [1, 2], "remote_host": "h",
                               "remote_port": 7, "tp_size": 1})  # fmt: skip
    assert got.addresses == ("h:7",)
    assert got.block_ids == (1, 2)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"]}, "remote_request_id: must be a non-empty string"),
        ({"remote_request_id": "r", "kvxfer_addresses": ["a:1"]}, "remote_block_ids: must be a non-empty list"),
        ({"remote_request_id": "r", "remote_block_ids": [[1], [2]], "kvxfer_addresses": ["a:1"],
          "kvxfer_groups": [{"name": "g0"}]}, "kvxfer_groups: must list the 2 groups of remote_block_ids"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"],
          "kvxfer_groups": [{"block_size": 16}]}, "kvxfer_groups[0]: must be {name, block_size, first_block}"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"],
          "kvxfer_groups": [{"name": "g0", "first_block": -1}]},
         "kvxfer_groups[0].first_block: must be an integer >= 0"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"],
          "kvxfer_groups": [{"name": "g0", "tp_split": "yes"}]},
         "kvxfer_groups[0].tp_split: must be a bool, got 'yes'"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"],
          "kvxfer_groups": [{"name": "g0", "tp_split": True, "segments": [48, 0]}]},
         "kvxfer_groups[0].segments: must be a list of byte sizes, got [48, 0]"),
        ({"remote_request_id": "r", "remote_block_ids": [[1], []], "kvxfer_addresses": ["a:1"]},
         "remote_block_ids[1]: must be a non-empty list of block ids"),
        ({"remote_request_id": "r", "remote_block_ids": [[1, -2]], "kvxfer_addresses": ["a:1"]},
         "remote_block_ids: -2 is not a block id"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "tp_size": 2},
         "kvxfer_addresses: missing, and tp_size is 2"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]]}, "kvxfer_addresses: missing, and so are remote_host"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": "a:1"},
         "kvxfer_addresses: must be a non-empty list"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1", ""]},
         "kvxfer_addresses: every entry must be 'host:port'"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"], "remote_num_tokens": -1},
         "remote_num_tokens: must be an integer >= 0, got -1"),
        ({"remote_request_id": "r", "remote_block_ids": [[1]], "kvxfer_addresses": ["a:1"], "kvxfer_engine_id": 3},
         "kvxfer_engine_id: must be a string, got 3"),
    ],
)  # fmt: skip
def test_bad_params_name_the_key(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ParamsError) as info:
        RemotePrefill.parse(params)
    assert fragment in info.value.message


def test_push_settings_from_the_environment() -> None:
    env = {"KVXFER_VLLM_PUSH_LAYERWISE": "true", "KVXFER_VLLM_IDLE_WAIT_MS": "0"}
    s = ConnectorSettings.load({}, env=env)
    assert (s.push_layerwise, s.idle_wait_ms) == (True, 0.0)
    assert ConnectorSettings.load({"push_layerwise": False}, env=env).push_layerwise is False  # extra config wins
    assert ConnectorSettings.load({}, env={}).push_layerwise is False


def test_push_params_round_trip() -> None:
    pre, dec = push_params(push_id="push-1", addresses=["p0:1", "p1:1"], sidecar_engine_id="pe", engine_id="vp")
    assert pre == {"do_remote_decode": True, "kvxfer_push": True, "kvxfer_push_id": "push-1"}
    assert wants_push(pre)
    assert wants_push(dec)
    r = RemotePrefill.parse_push(dec)
    assert (r.request_id, r.addresses, r.sidecar_engine_id, r.engine_id, r.push) == (
        "push-1",
        ("p0:1", "p1:1"),
        "pe",
        "vp",
        True,
    )
    assert r.groups == ()  # nothing is published yet


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"kvxfer_push": True, "kvxfer_addresses": ["a:1"]}, "kvxfer_push_id: must be a non-empty string"),
        ({"kvxfer_push": True, "kvxfer_push_id": "a b", "kvxfer_addresses": ["a:1"]},
         "kvxfer_push_id: at most 256 characters and no spaces, got 'a b'"),
        ({"kvxfer_push": True, "kvxfer_push_id": "x"}, "kvxfer_addresses: push mode needs the sidecar address"),
        ({"kvxfer_push": True, "kvxfer_push_id": "x", "kvxfer_addresses": ["a:1"], "kvxfer_engine_id": 3},
         "kvxfer_engine_id: must be a string, got 3"),
    ],
)  # fmt: skip
def test_bad_push_params_name_the_key(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ParamsError) as info:
        RemotePrefill.parse_push(params)
    assert fragment in info.value.message
