"""``generate``'s CUDA-graph decode steps on the GPU: real ``torch.cuda.CUDAGraph`` captures.

fp32: every strategy gives the tokens of ``generate(..., cuda_graphs=False)``. bf16: teacher-forced (the graph run is
forced onto the eager run's tokens), the raw logits of every step agree within 2e-2 relative to their largest
magnitude (the graph replays the eager kernels on a static cache; the static cache attends over its capacity with the
rows past the length masked, which changes bf16 rounding, not the math). The compile path
(``cache_implementation="static"`` + ``compile_config``, reduce-overhead) must not skip inductor's cudagraphs.
"""

import pytest
import torch
from transformers import CompileConfig, LogitsProcessor, LogitsProcessorList

from kimi_hybrid import KimiHybridCache, KimiHybridForCausalLM
from kimi_hybrid.compat_kimi_hybrid import GENERATION_CACHE_NAME
from kimi_hybrid.engine_kimi_hybrid import CudaGraphCapture
from decoding_helpers import CountingCapture
from presets import preset_config

CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.skipif(not CUDA, reason="needs CUDA")
BF16_REL = 2e-2


def model_on_cuda(preset="tiny-kda-first", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = KimiHybridForCausalLM(preset_config(preset)).eval().to("cuda", dtype)
    graphs = m.decode_graphs()
    graphs.capture = CountingCapture(CudaGraphCapture())
    graphs.min_bucket = 64
    return m, graphs.capture


def ids_of(b, t, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (b, t), generator=g).cuda()


def gen(m, ids, seed=0, **kw):
    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        return m.generate(ids, **kw)


STRATEGIES = {
    "greedy": dict(max_new_tokens=80),  # 12 + 80 positions: buckets 64 and 128
    "sample": dict(do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=30),
    "top_k_min_p_penalty": dict(do_sample=True, top_k=20, min_p=0.02, repetition_penalty=1.2,
                                no_repeat_ngram_size=3, max_new_tokens=30),
    "num_return_sequences": dict(do_sample=True, num_return_sequences=3, max_new_tokens=20),
    "beam": dict(num_beams=4, max_new_tokens=20),
    "static": dict(cache_implementation="static", max_new_tokens=20),
    "prompt_lookup": dict(prompt_lookup_num_tokens=3, max_new_tokens=20),
}


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_graph_tokens_equal_eager_fp32(preset, strategy):
    m, cap = model_on_cuda(preset)
    batch = 1 if strategy == "prompt_lookup" else 2  # (transformers' assisted decoding takes batch 1 only)
    ids = ids_of(batch, 12)
    mask = torch.ones_like(ids)
    mask[-1, :5] = 0  # a left-padded row
    kw = dict(attention_mask=mask, **STRATEGIES[strategy])
    eager = gen(m, ids, cuda_graphs=False, disable_compile=True, **kw)  # (static: no auto-compile either)
    graph = gen(m, ids, **kw)
    assert torch.equal(eager, graph)
    if strategy != "prompt_lookup":  # (its cache records rollback history: eager by design)
        assert cap.replays > 0 and cap.captures >= 1


def test_user_cache_and_prefix_reuse_fp32():
    m, cap = model_on_cuda()
    ids = ids_of(1, 20)
    caches = {g: KimiHybridCache(m.config) for g in (False, True)}
    outs = {g: gen(m, ids, max_new_tokens=16, cuda_graphs=g, **{GENERATION_CACHE_NAME: c}) for g, c in caches.items()}
    assert torch.equal(outs[False], outs[True]) and cap.replays == 15
    assert caches[True].get_seq_length() == caches[False].get_seq_length() == 35
    pc = m.prefill_prefix(ids[:, :10])
    suffixes = [ids[0, 10:13], ids[0, 13:20]]
    with torch.no_grad():
        x = m.generate_from_prefix(pc, ids[:, :10], suffixes, max_new_tokens=8, do_sample=False, cuda_graphs=False)
        y = m.generate_from_prefix(pc, ids[:, :10], suffixes, max_new_tokens=8, do_sample=False)
    assert torch.equal(x, y)


class Force(LogitsProcessor):
    """Teacher forcing: every step picks the given run's next token."""

    def __init__(self, sequences, start):
        self.sequences, self.start = sequences, start

    def __call__(self, input_ids, scores):
        t = input_ids.shape[1]
        forced = torch.full_like(scores, float("-inf"))
        forced.scatter_(1, self.sequences[:, t:t + 1], 0.0)
        return forced


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-mla-first"])
def test_graph_logits_bf16_teacher_forced(preset):
    m, cap = model_on_cuda(preset, torch.bfloat16)
    ids = ids_of(2, 16)
    kw = dict(max_new_tokens=24, min_new_tokens=24, return_dict_in_generate=True, output_logits=True)
    eager = gen(m, ids, cuda_graphs=False, **kw)
    graph = gen(m, ids, logits_processor=LogitsProcessorList([Force(eager.sequences, 16)]), **kw)
    assert torch.equal(graph.sequences, eager.sequences) and cap.replays == 23
    for a, b in zip(eager.logits, graph.logits):
        assert (a.float() - b.float()).abs().max() / a.float().abs().max() < BF16_REL


def test_memory_stated_and_released():
    m, cap = model_on_cuda()
    gen(m, ids_of(1, 8), max_new_tokens=8)
    mem = m.cuda_graphs_memory()
    assert mem["graphs"] == 1 and mem["total_bytes"] > 0
    before = torch.cuda.memory_allocated()
    assert m.release_cuda_graphs() == mem["total_bytes"]
    assert torch.cuda.memory_allocated() < before and m.cuda_graphs_memory()["graphs"] == 0


def test_default_capture_on_cuda():
    """No injection: generate on CUDA captures with torch.cuda.CUDAGraph by default."""
    torch.manual_seed(0)
    m = KimiHybridForCausalLM(preset_config("tiny-kda-first")).eval().cuda()
    ids = ids_of(1, 8)
    assert torch.equal(gen(m, ids, max_new_tokens=8), gen(m, ids, max_new_tokens=8, cuda_graphs=False))
    assert m.cuda_graphs_memory()["graphs"] == 1


def test_compile_path_keeps_inductor_cudagraphs():
    """transformers' compile path (static cache, reduce-overhead): every cache buffer at a static address, so
    inductor does not skip its cudagraphs, and a longer request inside the bucket does not recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    m, _ = model_on_cuda()
    ids = ids_of(1, 8)
    kw = dict(cache_implementation="static", compile_config=CompileConfig(mode="reduce-overhead"),
              max_new_tokens=6)
    a = gen(m, ids, **kw)
    graphs = counters["stats"]["unique_graphs"]
    b = gen(m, ids, **dict(kw, max_new_tokens=12))
    assert counters["stats"]["unique_graphs"] == graphs, "a longer request inside the bucket recompiled"
    assert not counters["inductor"]["cudagraph_skips"], "inductor skipped cudagraphs"
    ref = gen(m, ids, max_new_tokens=12, cuda_graphs=False)
    assert torch.equal(a, ref[:, :a.shape[1]]) and torch.equal(b, ref)
    torch._dynamo.reset()
