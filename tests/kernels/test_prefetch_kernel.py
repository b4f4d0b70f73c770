"""kernels/prefetch.py: `l2_prefetch` asks L2 for a weight's lines and writes nothing. On a GPU it runs eagerly and
inside a captured graph on a side stream, and leaves every byte as it was; under the interpreter (which runs no
inline PTX) it is skipped; a strided tensor is refused everywhere."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from kernels.prefetch import LINE, LINES, l2_prefetch  # noqa: E402


def test_the_weight_is_unchanged_eagerly_and_in_a_graph_on_a_side_stream(device):
    w = torch.randn(3 * LINES + 5, LINE // 2, dtype=torch.bfloat16, device=device)  # a ragged last program
    before = w.clone()
    l2_prefetch(w)
    if device == "cuda":
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                l2_prefetch(w)
            torch.cuda.current_stream().wait_stream(side)
        graph.replay()
        main.synchronize()
    assert torch.equal(w, before)


def test_a_strided_tensor_is_refused(device):
    w = torch.zeros(64, 64, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        l2_prefetch(w.t())
    l2_prefetch(w[:0])  # nothing to prefetch: no launch
