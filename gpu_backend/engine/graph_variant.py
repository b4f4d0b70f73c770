"""The CUDA graphs captured per token bucket: which part of a step each one runs.

`GpuRunner.graphs` is keyed by (bucket, GraphVariant); the persistent loop lists them as its branches in
this order per bucket (SAMPLE, GREEDY; then LOGITS for the extended branches, whose POST graphs follow: with the
logprobs when some row of the step asked for them, else the sampling alone).
"""
from __future__ import annotations

import enum


class GraphVariant(enum.Enum):
    SAMPLE = "sample"            # the whole step, then the full sampler (temperature, top-k/p, min-p, seeds)
    GREEDY = "greedy"            # the whole step, then argmax: every sampled row is greedy
    LOGITS = "logits"            # the whole step up to the sampled rows' float32 logits (into logits_dev)
    POST = "post"                # the persistent loop's: sampling and logprobs over the adjusted logits_dev
    POST_GREEDY = "post_greedy"  # the same for steps whose rows are all greedy (argmax)
    POST_NO_LOGPROBS = "post_no_logprobs"  # POST's sampling alone: no row of the step asked for logprobs
    POST_GREEDY_NO_LOGPROBS = "post_greedy_no_logprobs"

    @classmethod
    def sampling(cls, greedy: bool) -> GraphVariant:
        """The plain path's graph for a step: GREEDY when every sampled row is greedy, else SAMPLE."""
        return cls.GREEDY if greedy else cls.SAMPLE

    @classmethod
    def post(cls, greedy: bool, logprobs: bool = True) -> GraphVariant:
        if logprobs:
            return cls.POST_GREEDY if greedy else cls.POST
        return cls.POST_GREEDY_NO_LOGPROBS if greedy else cls.POST_NO_LOGPROBS

    @property
    def is_post(self) -> bool:
        return self in (GraphVariant.POST, GraphVariant.POST_GREEDY, GraphVariant.POST_NO_LOGPROBS,
                        GraphVariant.POST_GREEDY_NO_LOGPROBS)
