"""Client-side helpers of the gRPC API tests: calls, their errors, and choices put back together."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
import pytest

from protocols import inference_pb2 as pb


def generate(stub, auth, timeout_s: float = 10, **fields) -> list[pb.GenerateResponse]:
    return list(stub.Generate(pb.GenerateRequest(**fields), metadata=auth, timeout=timeout_s))


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        list(result) if not isinstance(result, pb.TokenizeResponse) else None
    return info.value


def trailing(err: grpc.RpcError) -> dict:
    return dict(err.trailing_metadata() or ())


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.TokenLogprobs] = field(default_factory=list)
    finish_reason: str = ""
    num_messages: int = 0


def reassemble(replies: list[pb.GenerateResponse]) -> list[Choice]:
    """Each choice from the interleaved stream, by choice_index; nothing may follow a choice's finish."""
    choices: dict[int, Choice] = {}
    for reply in replies:
        choice = choices.setdefault(reply.choice_index, Choice())
        assert not choice.finish_reason, f"choice {reply.choice_index} has a message after its finish"
        choice.text += reply.text
        choice.token_ids += reply.token_ids
        choice.logprobs += reply.logprobs
        choice.finish_reason = reply.finish_reason
        choice.num_messages += 1
    assert sorted(choices) == list(range(len(choices)))
    return [choices[i] for i in range(len(choices))]
