"""The step's kernels inside one captured CUDA graph: replays follow whatever batch the static device
tensors hold (lengths, block tables, sampling parameters), with no host planning in between."""
import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (CI may not install it)")

from gpu_backend.engine import sampler as cpu_sampler  # noqa: E402
from gpu_backend.engine.sampler import SamplingRow  # noqa: E402
from kernel_batches import make_batch, reference_attention  # noqa: E402
from kernels.paged_attention import paged_attention  # noqa: E402
from kernels.rmsnorm import add_rmsnorm  # noqa: E402
from kernels.rope_kv import rope_and_cache_kv  # noqa: E402
from kernels.sampling import sample  # noqa: E402
from kernels.swiglu import swiglu  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here; CUDA graphs need one")]

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, VOCAB = 8, 2, 128, 512, 4096
NUM_TOKENS, MAX_SEQS, MAX_BLOCKS, NUM_BLOCKS = 64, 8, 40, 160
BATCHES = [([1, 1, 30, 1], [1, 600, 30, 17]), ([5, 1, 1, 1, 1, 40], [300, 16, 2, 33, 640, 40]), ([1], [1])]


class Step:
    """Static tensors of one bucket and the kernels of one step over them."""

    def __init__(self, gen):
        dev = "cuda"
        first = make_batch(*BATCHES[0], NUM_TOKENS, MAX_SEQS, MAX_BLOCKS, NUM_BLOCKS, dev, gen)
        self.meta = {k: getattr(first, k).clone() for k in
                     ("positions", "slot_mapping", "seq_ids_of_token", "q_start", "ctx_lens_t", "block_tables",
                      "num_seqs")}
        self.cache = torch.randn(2, NUM_BLOCKS, 16, KV_HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
        self.qkv = torch.randn(NUM_TOKENS, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=gen).to(dev, torch.bfloat16)
        self.x, self.res = (torch.randn(NUM_TOKENS, HIDDEN, generator=gen).to(dev, torch.bfloat16) for _ in range(2))
        self.w = torch.randn(HIDDEN, generator=gen).to(dev, torch.bfloat16)
        self.gate_up = torch.randn(NUM_TOKENS, 2 * HIDDEN, generator=gen).to(dev, torch.bfloat16)
        self.logits = torch.randn(MAX_SEQS, VOCAB, generator=gen).mul(3).to(dev)
        self.params = dict(temperature=torch.ones(MAX_SEQS, device=dev), top_p=torch.full((MAX_SEQS,), 0.9, device=dev),
                           top_k=torch.full((MAX_SEQS,), 50, dtype=torch.int32, device=dev),
                           min_p=torch.zeros(MAX_SEQS, device=dev),
                           seeds=torch.arange(MAX_SEQS, dtype=torch.int64, device=dev),
                           positions=torch.arange(MAX_SEQS, dtype=torch.int64, device=dev))
        pos = torch.arange(2048, dtype=torch.float32)[:, None] / 10000 ** (torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        self.cos, self.sin = pos.cos().to(dev), pos.sin().to(dev)
        self.q_in = self.qkv[:, :HEADS].clone()
        self.attn_out = torch.empty(NUM_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        self.tokens = torch.empty(MAX_SEQS, dtype=torch.int64, device=dev)

    def run(self):
        m = self.meta
        q, k, v = self.qkv[:, :HEADS], self.qkv[:, HEADS: HEADS + KV_HEADS], self.qkv[:, HEADS + KV_HEADS:]
        q.copy_(self.q_in)                         # rope rotates q in place: start each replay from q_in
        add_rmsnorm(self.x, self.res, self.w, 1e-5)
        rope_and_cache_kv(q, k, v, m["positions"], self.cos, self.sin, m["slot_mapping"], self.cache)
        paged_attention(q, self.cache, m["seq_ids_of_token"], m["q_start"], m["ctx_lens_t"], m["block_tables"],
                        m["num_seqs"], HEAD_DIM ** -0.5, out=self.attn_out)
        swiglu(self.gate_up)
        sample(self.logits, **self.params, out=self.tokens)

    def load(self, batch):
        for name, t in self.meta.items():
            t.copy_(getattr(batch, name))


def test_one_graph_serves_batches_of_different_shapes():
    gen = torch.Generator().manual_seed(7)
    step = Step(gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step.run()                                 # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.run()
    for i, (q_lens, ctx_lens) in enumerate(BATCHES):
        batch = make_batch(q_lens, ctx_lens, NUM_TOKENS, MAX_SEQS, MAX_BLOCKS, NUM_BLOCKS, "cuda", gen)
        step.load(batch)
        step.params["seeds"].copy_(torch.arange(MAX_SEQS) * 1000 + i)
        graph.replay()
        torch.cuda.synchronize()
        real = batch.num_real_tokens
        q = step.qkv[:, :HEADS]
        ref = reference_attention(q, step.cache, batch, HEAD_DIM ** -0.5)
        torch.testing.assert_close(step.attn_out[:real].float(), ref, atol=1.5e-2, rtol=2e-2)
        assert (step.attn_out[real:] == 0).all()
        rows = [SamplingRow(1.0, 0.9, 50, 0.0, seed=s * 1000 + i, position=s) for s in range(MAX_SEQS)]
        assert step.tokens.cpu().tolist() == cpu_sampler.sample(step.logits.cpu(), rows)
