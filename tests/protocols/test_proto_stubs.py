"""The committed gRPC stubs were generated from the committed control.proto."""
from pathlib import Path

from google.protobuf import descriptor_pb2

from protocols import control_pb2

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_the_proto(tmp_path):
    from grpc_tools import protoc

    out = tmp_path / "control.desc"
    rc = protoc.main(["protoc", f"-I{ROOT}", f"--descriptor_set_out={out}", "protocols/control.proto"])
    assert rc == 0
    fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    committed = descriptor_pb2.FileDescriptorProto.FromString(control_pb2.DESCRIPTOR.serialized_pb)
    for message in fresh.message_type:  # protoc adds derived json names; the stub leaves them out
        for f in message.field:
            f.ClearField("json_name")
    assert fresh == committed, "regenerate: python -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. protocols/control.proto"
