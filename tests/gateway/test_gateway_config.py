"""Configuration: defaults, BLINK_* environment variables, flags, validation."""

from __future__ import annotations

import pytest

from gateway.policy.auth import check_key
from gateway.config import GatewayConfig
from gateway.env import config_overrides
from gateway.errors import ApiError
from gateway.main import config_from_args, parse_args


def test_env_then_flags():
    env = {"BLINK_API_KEY": "a, b", "BLINK_BACKENDS": "h1:1,h2:2", "BLINK_GATEWAY_PORT": "9000"}
    assert config_overrides(env) == {"api_keys": frozenset({"a", "b"}), "backend_addrs": ("h1:1", "h2:2"), "port": 9000}
    cfg = config_from_args(parse_args(["--port", "9100", "--backend", "x:1", "--backend", "y:2"]), env)
    assert cfg.port == 9100 and cfg.backend_addrs == ("x:1", "y:2") and cfg.api_keys == {"a", "b"}
    cfg = config_from_args(parse_args(["--api-key", "k"]), {})
    assert cfg.api_keys == {"k"} and cfg.auth_enabled and cfg.backend_addrs == ("127.0.0.1:50051",)
    assert not config_from_args(parse_args([]), {}).auth_enabled


def test_grpc_port_and_log_format():
    assert GatewayConfig().grpc_port == 50052 and GatewayConfig().log_format == "text"
    env = {"BLINK_GRPC_PORT": "6000", "BLINK_LOG_FORMAT": "json"}
    cfg = config_from_args(parse_args([]), env)
    assert (cfg.grpc_port, cfg.log_format) == (6000, "json")
    cfg = config_from_args(parse_args(["--grpc-port", "0", "--log-format", "text"]), env)
    assert (cfg.grpc_port, cfg.log_format) == (0, "text")  # 0: no gRPC API


def test_native_stream_is_on_unless_turned_off(tmp_path):
    assert config_from_args(parse_args([]), {}).native_stream
    assert not config_from_args(parse_args(["--no-native-stream"]), {}).native_stream
    path = tmp_path / "gateway.yaml"
    path.write_text("backends: [127.0.0.1:1]\nnative_stream: false\n")
    assert not config_from_args(parse_args(["--config", str(path)]), {}).native_stream


def test_grammar_concurrency_comes_from_the_config_file(tmp_path):
    assert config_from_args(parse_args([]), {}).grammar_concurrency == 0  # automatic
    path = tmp_path / "gateway.yaml"
    path.write_text("backends: [127.0.0.1:1]\ngrammar_concurrency: 3\n")
    assert config_from_args(parse_args(["--config", str(path)]), {}).grammar_concurrency == 3


@pytest.mark.parametrize("bad", [{"port": 70000}, {"backend_addrs": ()}, {"max_body_bytes": 10},
                                 {"default_max_tokens": 0}, {"slot_wait_s": 0}, {"grpc_port": -1},
                                 {"log_format": "xml"}, {"grammar_concurrency": 65}, {"grammar_concurrency": -1}])
def test_invalid_config_is_refused(bad):
    with pytest.raises(ValueError):
        GatewayConfig(**bad)


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        GatewayConfig().port = 1


@pytest.mark.parametrize("header,ok", [("Bearer k2", True), ("bearer k1", True), ("Bearer  k1 ", True),
                                       (None, False), ("", False), ("Bearer", False), ("Bearer k3", False),
                                       ("Basic k1", False), ("k1", False)])
def test_check_key(header, ok):
    if ok:
        check_key(header, {"k1", "k2"})
    else:
        with pytest.raises(ApiError) as exc:
            check_key(header, {"k1", "k2"})
        assert exc.value.status == 401
