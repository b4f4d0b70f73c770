"""The committed gRPC stubs were generated from the committed .proto files."""
import re
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from protocols import control_pb2, inference_pb2

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("proto, stub", [("protocols/control.proto", control_pb2),
                                         ("protocols/inference.proto", inference_pb2)])
def test_stubs_match_the_proto(tmp_path, proto, stub):
    from grpc_tools import protoc

    out = tmp_path / "stubs.desc"
    rc = protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}", proto])
    assert rc == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto.FromString(stub.DESCRIPTOR.serialized_pb)
    _clear_json_names(fresh.message_type)
    assert fresh == committed, f"regenerate: python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. {proto}"


def _clear_json_names(messages) -> None:
    """protoc adds derived json names; the stub leaves them out (nested types too: a map's entry)."""
    for message in messages:
        for f in message.field:
            f.ClearField("json_name")
        _clear_json_names(message.nested_type)


def test_inference_service_shape():
    """Generate streams its replies; Tokenize is unary (clients and reflection rely on both)."""
    service = inference_pb2.DESCRIPTOR.services_by_name["Inference"]
    generate, tokenize = service.methods_by_name["Generate"], service.methods_by_name["Tokenize"]
    assert generate.server_streaming and not generate.client_streaming
    assert not tokenize.server_streaming and not tokenize.client_streaming
    assert inference_pb2.DESCRIPTOR.package == "blink.inference.v1"


def _floor(requirement: str) -> tuple[int, ...]:
    """pyproject's lower bound for one package: `grpcio>=1.85.1` -> (1, 85, 1)."""
    text = (ROOT / "pyproject.toml").read_text()
    m = re.search(rf'"{re.escape(requirement)}>=([0-9.]+)', text)
    assert m, f"pyproject.toml has no lower bound for {requirement}"
    return tuple(int(x) for x in m.group(1).split("."))


@pytest.mark.parametrize("stub", ["control", "inference"])
def test_pyproject_asks_for_the_versions_the_stubs_check_at_import(stub):
    """The generated stubs refuse older grpcio / protobuf at import time; the install must not allow them."""
    grpc_text = (ROOT / "protocols" / f"{stub}_pb2_grpc.py").read_text()
    grpc_needed = tuple(int(x) for x in re.search(r"GRPC_GENERATED_VERSION = '([0-9.]+)'", grpc_text).group(1).split("."))
    for package in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert _floor(package) >= grpc_needed, package
    pb_text = (ROOT / "protocols" / f"{stub}_pb2.py").read_text()
    major, minor, patch = (int(x) for x in re.search(
        r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),\s*(\d+),",
        pb_text).groups())
    assert _floor("protobuf") >= (major, minor, patch)
    # protobuf refuses a runtime of another major version than the generated code
    assert f'"protobuf>={".".join(map(str, _floor("protobuf")))},<{major + 1}"' in (ROOT / "pyproject.toml").read_text()
