"""The messages both sides share (`protocols/messages.py`): a backend's description goes out through
`Describe` and comes back to the gateway field for field."""
from __future__ import annotations

import dataclasses

import pytest

from protocols.messages import BackendDescription, BackendInfo, TokenUpdate
from protocols.ring import RING_VERSION, FinishReason, RingGeometry

GEOMETRY = RingGeometry(num_slots=8, max_prompt_len=64, max_output_len=16, max_stop_ids=4, logprob_window=8)


def describe(**changes) -> BackendDescription:
    fields = dict(model_name="m", model_dir="/models/m", model_fingerprint="fp", context_len=128, vocab_size=300,
                  eos_token_ids=(2, 7), engine_mode="persistent", transport="tcp", tcp_endpoint="h:9",
                  sampling_extensions=False)
    return BackendDescription(**(fields | changes))


def test_a_description_comes_back_from_describe_field_for_field():
    desc = describe()
    info = BackendInfo.from_reply("backend:1", desc.to_reply("ring-a", GEOMETRY))
    assert info.addr == "backend:1" and info.ring_name == "ring-a" and info.geometry == GEOMETRY
    for f in dataclasses.fields(BackendDescription):
        assert getattr(info, f.name) == getattr(desc, f.name), f.name


@pytest.mark.parametrize("mode, extended", [("persistent", False), ("cpu", True), ("host", True)])
def test_cpu_and_host_engines_always_apply_the_sampling_extensions(mode, extended):
    reply = describe(engine_mode=mode, sampling_extensions=False).to_reply("r", GEOMETRY)
    assert BackendInfo.from_reply("a", reply).sampling_extensions is extended


def test_a_describe_of_another_ring_version_is_refused_by_name():
    reply = describe().to_reply("r", GEOMETRY)
    reply.ring_version = RING_VERSION - 1  # e.g. 2, before block hashes and masks: no kv_block_size
    reply.geometry.kv_block_size = 0
    with pytest.raises(ValueError, match=f"backend a speaks ring version {RING_VERSION - 1}, this side {RING_VERSION}"):
        BackendInfo.from_reply("a", reply)


def test_an_empty_transport_reads_as_shm():
    reply = describe(transport="").to_reply("r", GEOMETRY)
    assert BackendInfo.from_reply("a", reply).transport == "shm"


def test_a_token_update_is_built_positionally_in_its_field_order():
    # ShmProducer.poll builds it positionally: a reordering would swap fields silently
    assert [f.name for f in dataclasses.fields(TokenUpdate)] == [
        "tokens", "logprobs", "finish", "error", "error_code", "prompt_len", "started", "cached_tokens"]
    assert not TokenUpdate().finish and TokenUpdate(finish=FinishReason.STOP).finish
