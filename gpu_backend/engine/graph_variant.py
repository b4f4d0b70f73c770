"""The CUDA graphs captured per token bucket: which part of a step each one runs.

`GpuRunner.graphs` is keyed by (bucket, GraphVariant); the persistent loop lists them as its branches in
this order per bucket (SAMPLE, GREEDY; then LOGITS for the extended branches, whose POST graphs follow).
"""
from __future__ import annotations

import enum


class GraphVariant(enum.Enum):
    SAMPLE = "sample"            # the whole step, then the full sampler (temperature, top-k/p, min-p, seeds)
    GREEDY = "greedy"            # the whole step, then argmax: every sampled row is greedy
    LOGITS = "logits"            # the whole step up to the sampled rows' float32 logits (into logits_dev)
    POST = "post"                # the persistent loop's: sampling and logprobs over the adjusted logits_dev
    POST_GREEDY = "post_greedy"  # the same for steps whose rows are all greedy (argmax)

    @classmethod
    def sampling(cls, greedy: bool) -> GraphVariant:
        """The plain path's graph for a step: GREEDY when every sampled row is greedy, else SAMPLE."""
        return cls.GREEDY if greedy else cls.SAMPLE

    @classmethod
    def post(cls, greedy: bool) -> GraphVariant:
        return cls.POST_GREEDY if greedy else cls.POST
