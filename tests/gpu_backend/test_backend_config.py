"""BackendConfig (flags, config file, validation) and the one registry of the backend's environment variables."""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

import pytest

from gpu_backend import env
from gpu_backend.config import BackendConfig, ConfigError, read_config_file
from gpu_backend.main import add_backend_args, config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_backend_args(p)
    return p.parse_args(list(argv))


def test_flags_become_one_frozen_config(monkeypatch):
    monkeypatch.delenv("BLINK_BACKEND_CONFIG", raising=False)
    c = config_from_args(_parse("--mode", "host", "--max-num-seqs", "32", "--no-graphs", "--no-sampling-extensions"))
    assert (c.mode, c.max_num_seqs, c.use_graphs, c.sampling_extensions) == ("host", 32, False, False)
    with pytest.raises(AttributeError):
        c.mode = "cpu"  # frozen
    gc = c.gpu_runner_config(4096)
    assert (gc.max_num_batched_tokens, gc.max_num_seqs, gc.use_graphs, gc.context_len) == (512, 32, False, 4096)
    assert BackendConfig(mode="persistent", use_graphs=False).gpu_runner_config(64).use_graphs  # the loop needs graphs


def test_the_memory_share_takes_vllms_flag_and_the_old_one(monkeypatch):
    monkeypatch.delenv("BLINK_BACKEND_CONFIG", raising=False)
    assert config_from_args(_parse()).gpu_memory_fraction == 0.9
    assert config_from_args(_parse("--gpu-memory-utilization", "0.95")).gpu_memory_fraction == 0.95
    assert config_from_args(_parse("--gpu-memory-fraction", "0.8")).gpu_memory_fraction == 0.8
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        config_from_args(_parse("--gpu-memory-utilization", "1.5"))


def test_defaults_depend_on_the_mode():
    cpu, host = BackendConfig(), BackendConfig(mode="host")
    assert (cpu.batched_tokens, cpu.num_seqs, cpu.device) == (256, 64, "cpu")
    assert (host.batched_tokens, host.num_seqs, host.device) == (512, 256, "cuda")
    assert BackendConfig(mode="host", max_num_batched_tokens=128).num_seqs == 128
    e = cpu.engine_config()
    assert (e.max_num_batched_tokens, e.max_num_seqs, e.block_size) == (256, 64, 16)
    assert cpu.context_len_for(32768) == 8192 and BackendConfig(context_len=100).context_len_for(32768) == 100


def test_file_then_flags(tmp_path, monkeypatch):
    path = tmp_path / "backend.yaml"
    path.write_text("mode: host\nmax_num_seqs: 16\nsampling_extensions: false\nrdma_device: null\n")
    c = config_from_args(_parse("--config", str(path), "--max-num-seqs", "8"))
    assert (c.mode, c.max_num_seqs, c.sampling_extensions) == ("host", 8, False)
    monkeypatch.setenv("BLINK_BACKEND_CONFIG", str(path))
    assert config_from_args(_parse()).mode == "host"  # the variable names the file when --config does not


@pytest.mark.parametrize("text, message", [
    ("mode: tpu\n", "mode: 'tpu' is not one of cpu, host, persistent"),
    ("max_num_seqs: many\n", "max_num_seqs: 'many' is not a int"),
    ("use_graphs: 1\n", "use_graphs: 1 is not a bool"),
    ("max_num_sequences: 4\n", "unknown settings max_num_sequences"),
    ("- mode\n", "the top level must be a mapping"),
    ("gpu_memory_fraction: 1.5\n", "gpu_memory_fraction: 1.5 is outside 0.05..0.99"),
    ("mode: host\nmax_num_batched_tokens: 8\nmax_num_seqs: 16\n", "max_num_seqs: 16 is over max_num_batched_tokens 8"),
    ("block_size: 0\n", "block_size: 0 must be at least 1"),
])
def test_bad_settings_are_named(tmp_path, text, message):
    path = tmp_path / "backend.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        BackendConfig(**read_config_file(path))


def test_a_bad_config_stops_the_backend_with_a_message(tmp_path):
    path = tmp_path / "backend.yaml"
    path.write_text("num_slots: 0\n")
    run = subprocess.run([sys.executable, "-m", "blink.cli", "backend", "--config", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "num_slots: 0 must be at least 1" in run.stderr


def test_environment_is_read_in_one_place(monkeypatch):
    """No module under gpu_backend/ but env.py reads os.environ or os.getenv; every variable is documented."""
    readers = []
    for path in (ROOT / "gpu_backend").rglob("*.py"):
        if path.name == "env.py" and path.parent.name == "gpu_backend":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv"):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []
    assert all(v.doc and v.name.isupper() for v in env.VARS.values())
    monkeypatch.setenv("BLINK_CACHE", "/tmp/blink-cache-test")
    assert env.cache_dir() == Path("/tmp/blink-cache-test")
    monkeypatch.setenv("BLINK_CACHE", "")
    assert env.cache_dir() == Path("~/.cache/blink").expanduser()
    with pytest.raises(KeyError):
        env.get("NOT_DECLARED")


@pytest.mark.parametrize("fields, message", [
    ({"control_ssl_keyfile": "k.pem"}, "control_ssl_keyfile: needs control_ssl_certfile"),
    ({"control_ssl_ca_certs": "ca.pem"}, "control_ssl_ca_certs: needs control_ssl_certfile"),
    ({"control_ssl_certfile": "c.pem"}, "control_ssl_ca_certs: control_ssl_cert_reqs 2 checks"),
    ({"control_ssl_certfile": "c.pem", "control_ssl_cert_reqs": 1}, "control_ssl_ca_certs: control_ssl_cert_reqs 1"),
    ({"control_ssl_certfile": "c.pem", "control_ssl_ca_certs": "ca.pem", "control_ssl_cert_reqs": 3},
     "control_ssl_cert_reqs: 3 is not 0"),
])
def test_half_a_tls_configuration_is_refused(fields, message):
    with pytest.raises(ConfigError, match=message):
        BackendConfig(**fields)


def test_tls_without_client_certificates_is_a_choice():
    config = BackendConfig(control_ssl_certfile="c.pem", control_ssl_cert_reqs=0)
    assert config.control_tls and not BackendConfig().control_tls


def test_tls_settings_come_from_file_env_and_flags_and_reach_the_agent(tmp_path, monkeypatch):
    from gpu_backend.control_tls import agent_tls_argv, agent_tls_config
    from gpu_backend.tcp_agent import add_agent_args

    path = tmp_path / "backend.yaml"
    path.write_text("control_ssl_certfile: /file/cert.pem\ncontrol_ssl_ca_certs: /file/ca.pem\n")
    monkeypatch.setenv("BLINK_BACKEND_CONFIG", str(path))
    monkeypatch.setenv("BLINK_CONTROL_SSL_KEYFILE", "/env/key.pem")
    monkeypatch.setenv("BLINK_CONTROL_SSL_CA_CERTS", "/env/ca.pem")
    config = config_from_args(_parse("--control-ssl-certfile", "/flag/cert.pem"))
    assert (config.control_ssl_certfile, config.control_ssl_keyfile, config.control_ssl_ca_certs,
            config.control_ssl_cert_reqs) == ("/flag/cert.pem", "/env/key.pem", "/env/ca.pem", 2)
    agent = argparse.ArgumentParser()
    add_agent_args(agent)
    args = agent.parse_args(["--ring", "r", "--listen", "127.0.0.1:1", *agent_tls_argv(config)])
    assert agent_tls_config(args).control_ssl_keyfile == "/env/key.pem"
    monkeypatch.setenv("BLINK_CONTROL_SSL_CERT_REQS", "two")
    with pytest.raises(ConfigError, match="BLINK_CONTROL_SSL_CERT_REQS: 'two' is not an integer"):
        config_from_args(_parse())


def test_a_missing_tls_file_stops_the_backend_before_the_model_loads(tmp_path):
    run = subprocess.run([sys.executable, "-m", "blink.cli", "backend", "--control", "127.0.0.1:0",
                          "--control-ssl-certfile", str(tmp_path / "absent.pem"), "--control-ssl-ca-certs",
                          str(tmp_path / "ca.pem")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and f"cannot read the TLS key {tmp_path / 'absent.pem'}" in run.stderr


def test_prefix_caching_is_on_by_default_and_turned_off_by_flag_file_or_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("BLINK_BACKEND_CONFIG", raising=False)
    monkeypatch.delenv("BLINK_PREFIX_CACHING", raising=False)
    assert config_from_args(_parse()).enable_prefix_caching and BackendConfig().engine_config().enable_prefix_caching
    for flag in ("--no-prefix-caching", "--no-enable-prefix-caching"):  # the name and vLLM's
        c = config_from_args(_parse(flag))
        assert not c.enable_prefix_caching and not c.engine_config().enable_prefix_caching
    path = tmp_path / "backend.yaml"
    path.write_text("enable_prefix_caching: false\n")
    assert not config_from_args(_parse("--config", str(path))).enable_prefix_caching
    assert config_from_args(_parse("--config", str(path), "--enable-prefix-caching")).enable_prefix_caching
    monkeypatch.setenv("BLINK_PREFIX_CACHING", "0")
    assert not config_from_args(_parse()).enable_prefix_caching
    assert config_from_args(_parse("--enable-prefix-caching")).enable_prefix_caching  # a flag wins
    monkeypatch.setenv("BLINK_PREFIX_CACHING", "maybe")
    with pytest.raises(ConfigError, match="BLINK_PREFIX_CACHING='maybe' is not a boolean"):
        config_from_args(_parse())


def test_the_l2_prefetch_switch_takes_0_1_or_2_and_refuses_the_rest(monkeypatch):
    from gpu_backend.engine.gpu_ops import l2_prefetch_mode
    monkeypatch.delenv("BLINK_L2_PREFETCH", raising=False)
    assert l2_prefetch_mode() == 0
    for value in ("0", "1", "2"):
        monkeypatch.setenv("BLINK_L2_PREFETCH", value)
        assert l2_prefetch_mode() == int(value)
    monkeypatch.setenv("BLINK_L2_PREFETCH", "yes")
    with pytest.raises(ValueError, match="BLINK_L2_PREFETCH='yes'"):
        l2_prefetch_mode()
