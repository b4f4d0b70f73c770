"""Messages both sides of a ring use, one dataclass each: a slot's news as the gateway reads it
(`TokenUpdate`), and a backend's description, as the backend announces it (`BackendDescription`) and as the
gateway reads it back from `Control.Describe` (`BackendInfo`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from protocols import control_pb2
from protocols.ring import RING_VERSION, ErrorCode, FinishReason, RingGeometry, TokenLogprob

# Engine modes that always apply penalties, logit_bias and logprobs, whatever their Describe says.
ALWAYS_EXTENDED = ("cpu", "host")


# Seconds a backend's heartbeat may stand still before it counts as stalled, per engine mode: the gateway's
# ejection (with work pending) and the backend's grpc.health.v1 read this one table. A cpu engine's step on a
# busy host can take seconds, and is no stall.
STALL_AFTER_S = {"persistent": 1.0, "host": 3.0, "cpu": 10.0}
STALL_AFTER_OTHER_S = 5.0  # an engine mode this table does not know

@dataclass(slots=True)  # one per poll with news: slots make it cheaper to build and to read
class TokenUpdate:
    """What a producer's `poll` found since the last poll of a slot (`ShmProducer.poll` builds it
    positionally: keep the field order)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token when the request asked
    finish: FinishReason = FinishReason.NONE  # 0 (false) while the request runs
    error: str = ""
    error_code: ErrorCode = ErrorCode.NONE
    prompt_len: int = 0
    started: bool = False  # the engine has taken the request
    cached_tokens: int = 0  # prompt tokens the engine took from its prefix cache (valid once started)


@dataclass(frozen=True)
class BackendDescription:
    """What a backend says about itself in `Control.Describe`, besides its ring (`to_reply` adds that)."""

    model_name: str
    model_dir: str
    model_fingerprint: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    engine_mode: str
    transport: str = "shm"  # shm | tcp | rdma
    tcp_endpoint: str = ""  # HOST:PORT gateways reach the tcp agent at
    sampling_extensions: bool = True  # penalties, logit_bias, logprobs (the persistent mode may run without)
    prefix_caching: bool = True  # the engine reuses cached prompt blocks (--no-prefix-caching: False)

    def to_reply(self, ring_name: str, geometry: RingGeometry) -> control_pb2.DescribeReply:
        """The `Describe` answer of a backend serving ring `ring_name` of this `geometry`."""
        return control_pb2.DescribeReply(
            model_name=self.model_name, model_dir=self.model_dir, model_fingerprint=self.model_fingerprint,
            context_len=self.context_len, vocab_size=self.vocab_size, eos_token_ids=list(self.eos_token_ids),
            engine_mode=self.engine_mode, transport=self.transport, tcp_endpoint=self.tcp_endpoint,
            ring_name=ring_name, geometry=control_pb2.RingGeometry(**dataclasses.asdict(geometry)),
            ring_version=RING_VERSION, sampling_extensions=self.sampling_extensions,
            prefix_caching=self.prefix_caching)


@dataclass(frozen=True)
class BackendInfo:
    """What a backend's `Describe` said, as the gateway keeps it: where it answered, and its ring."""

    addr: str
    model_name: str
    model_dir: str
    model_fingerprint: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    engine_mode: str
    ring_name: str
    geometry: RingGeometry
    transport: str = "shm"  # shm | tcp | rdma
    tcp_endpoint: str = ""  # HOST:PORT of the backend's tcp agent
    sampling_extensions: bool = True  # penalties, logit_bias and logprobs are applied
    prefix_caching: bool = True  # the engine keeps a prefix cache: requests carry block hashes, metrics count them

    @classmethod
    def from_reply(cls, addr: str, reply: control_pb2.DescribeReply) -> BackendInfo:
        """The description in `reply`; ValueError for a backend of another ring version (its geometry lacks
        fields this side needs: ring version 3's kv_block_size and mask_words)."""
        if reply.ring_version != RING_VERSION:
            raise ValueError(f"backend {addr} speaks ring version {reply.ring_version}, this side {RING_VERSION}: "
                             f"run the same release on both")
        g = reply.geometry
        geometry = RingGeometry(**{f.name: getattr(g, f.name) for f in dataclasses.fields(RingGeometry)})
        return cls(addr=addr, model_name=reply.model_name, model_dir=reply.model_dir,
                   model_fingerprint=reply.model_fingerprint, context_len=reply.context_len,
                   vocab_size=reply.vocab_size, eos_token_ids=tuple(reply.eos_token_ids),
                   engine_mode=reply.engine_mode, ring_name=reply.ring_name, geometry=geometry,
                   transport=reply.transport or "shm", tcp_endpoint=reply.tcp_endpoint,
                   sampling_extensions=reply.sampling_extensions or reply.engine_mode in ALWAYS_EXTENDED,
                   prefix_caching=reply.prefix_caching)
