"""``generate``'s graph decode steps against the eager path, on CPU.

The graph object is :class:`EagerCapture` wrapped to count captures and replays: everything of the graph machinery
except ``torch.cuda.CUDAGraph`` runs (capacity buckets and their growth, static workspace caches, the copy in and
back, beam reordering in place, the graph cache per (batch, bucket)), so every strategy must give the tokens of
``generate(..., cuda_graphs=False)``. Scores and logits agree to 1e-5 (a static cache attends over its whole
capacity with the rows past the length masked: the same values, summed in another order).
"""

import pytest
import torch
from transformers import DynamicCache, GenerationConfig, LogitsProcessor, LogitsProcessorList, StaticCache
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from decoding_helpers import PAD, CountingCapture, gen, rand_ids, tiny_random_model, _one_thread  # noqa: F401
from kimi_hybrid import KimiHybridCache
from kimi_hybrid.compat_kimi_hybrid import GENERATION_CACHE_NAME, output_cache
from kimi_hybrid.engine_kimi_hybrid import EagerCapture

TOL = 1e-5
PRESETS = ["tiny-kda-first", "tiny-mla-first"]


def graph_model(name="tiny-kda-first", min_bucket=16, **over):
    model = tiny_random_model(name, **over)
    graphs = model.decode_graphs()
    graphs.capture = CountingCapture(EagerCapture())
    graphs.min_bucket = min_bucket
    return model, graphs.capture


def both(model, ids, seed=0, **kw):
    """(eager result, graph result) of the same generate call under the same seed."""
    torch.manual_seed(seed)
    eager = gen(model, ids, cuda_graphs=False, **kw)
    torch.manual_seed(seed)
    graph = gen(model, ids, **kw)
    return eager, graph


def seqs(out):
    return out if isinstance(out, torch.Tensor) else out.sequences


@pytest.mark.parametrize("preset", PRESETS + ["tiny-k3"])
def test_greedy_equal_through_bucket_growth(preset):
    model, cap = graph_model(preset)
    model.decode_graphs().size_for_request = False  # start from the prompt's bucket: grow through three
    ids = rand_ids(2, 12)
    eager, graph = both(model, ids, max_new_tokens=40)
    assert torch.equal(eager, graph)
    assert cap.replays == 39  # every decode step replayed (the first token comes from the prefill)
    # 12 -> 52 positions: one graph per bucket (16, 32, 64); each outgrown slot is freed
    assert cap.captures == 3 and [s["capacity"] for s in model.cuda_graphs_memory()["slots"]] == [64]
    # cached across calls: the same request captures nothing new (it starts in the 16 bucket again: one capture)
    n = cap.captures + 2
    graph2 = gen(model, ids, max_new_tokens=40)
    assert torch.equal(graph2, eager) and cap.captures == n


def test_first_bucket_sized_for_the_request():
    model, cap = graph_model()
    ids = rand_ids(2, 12)
    eager, graph = both(model, ids, max_new_tokens=40)  # at most 51 cached tokens: the 64 bucket at once
    assert torch.equal(eager, graph) and cap.captures == 1 and cap.replays == 39
    assert [s["capacity"] for s in model.cuda_graphs_memory()["slots"]] == [64]
    graph2 = gen(model, rand_ids(2, 20, seed=7), max_new_tokens=30)  # 49: the same bucket, no new capture
    assert cap.captures == 1 and torch.equal(graph2, gen(model, rand_ids(2, 20, seed=7), max_new_tokens=30,
                                                         cuda_graphs=False))


def test_buckets():
    graphs = tiny_random_model().decode_graphs()
    graphs.min_bucket, graphs.bucket_step = 16, 64
    assert [graphs.bucket(n) for n in (1, 16, 17, 33, 64, 65, 129)] == [16, 16, 32, 64, 64, 128, 192]
    graphs = tiny_random_model().decode_graphs()  # the defaults: 1K minimum, powers of two to 16K, then 16K steps
    assert [graphs.bucket(n) for n in (5, 4097, 16384, 131073)] == [1024, 8192, 16384, 147456]


def test_graph_cache_per_batch_and_release():
    model, cap = graph_model()
    for b in (1, 3):
        eager, graph = both(model, rand_ids(b, 5), max_new_tokens=4)
        assert torch.equal(eager, graph)
    mem = model.cuda_graphs_memory()
    assert sorted((s["batch"], s["capacity"]) for s in mem["slots"]) == [(1, 16), (3, 16)]
    assert mem["total_bytes"] == sum(s["bytes"] for s in mem["slots"]) > 0
    assert model.release_cuda_graphs() == mem["total_bytes"]
    assert model.cuda_graphs_memory()["graphs"] == 0
    eager, graph = both(model, rand_ids(1, 5), max_new_tokens=4)  # captures again
    assert torch.equal(eager, graph) and model.cuda_graphs_memory()["graphs"] == 1


SAMPLING = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(top_k=10),
    "top_p": dict(top_p=0.9, temperature=0.8),
    "min_p": dict(min_p=0.05),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "no_repeat_ngram": dict(no_repeat_ngram_size=2),
    "min_new_tokens": dict(min_new_tokens=12, eos_token_id=2),
    "bad_words_ids": dict(bad_words_ids=[[5], [7, 8]]),
}


@pytest.mark.parametrize("setting", sorted(SAMPLING))
def test_sampling_equal_under_seed(setting):
    model, cap = graph_model()
    ids = rand_ids(2, 9)
    eager, graph = both(model, ids, seed=3, do_sample=True, max_new_tokens=14, **SAMPLING[setting])
    assert torch.equal(eager, graph)
    assert cap.replays > 0


def test_num_return_sequences():
    model, cap = graph_model()
    eager, graph = both(model, rand_ids(2, 7), seed=1, do_sample=True, num_return_sequences=3, max_new_tokens=10)
    assert eager.shape[0] == 6 and torch.equal(eager, graph)
    assert {s["batch"] for s in model.cuda_graphs_memory()["slots"]} == {6}


@pytest.mark.parametrize("preset", PRESETS)
def test_beam_search_reorders_workspace_in_place(preset):
    model, cap = graph_model(preset)
    model.decode_graphs().size_for_request = False  # reorder in the 16 bucket, then in the 32 one
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=20, return_dict_in_generate=True,
              output_scores=True)
    eager, graph = both(model, rand_ids(2, 6), **kw)
    assert torch.equal(eager.sequences, graph.sequences)
    assert (eager.sequences_scores - graph.sequences_scores).abs().max() < TOL
    assert cap.replays == 19 and cap.captures == 2
    assert [s["capacity"] for s in model.cuda_graphs_memory()["slots"]] == [32]


def test_left_padded_batch():
    model, cap = graph_model()
    ids = rand_ids(3, 10)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    mask[2, :7] = 0
    ids = ids.masked_fill(mask == 0, PAD)
    eager, graph = both(model, ids, attention_mask=mask, max_new_tokens=15)
    assert torch.equal(eager, graph) and cap.replays == 14


def test_scores_logits_and_dict_output():
    model, cap = graph_model()
    kw = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    eager, graph = both(model, rand_ids(2, 8), **kw)
    assert torch.equal(eager.sequences, graph.sequences)
    for a, b in zip(eager.scores + eager.logits, graph.scores + graph.logits):
        assert (a - b).abs().max() < TOL
    # the returned cache is the request's own (not a workspace), holding the same state as on the eager path
    ce, cg = output_cache(eager), output_cache(graph)
    assert type(cg) is type(ce) and not model.decode_graphs().workspace(cg)
    assert ce.get_seq_length() == cg.get_seq_length() == 8 + 11
    nxt = eager.sequences[:, -1:]
    with torch.no_grad():
        le = model(nxt, past_key_values=ce).logits
        lg = model(nxt, past_key_values=cg).logits
    assert (le - lg).abs().max() < TOL


@pytest.mark.parametrize("flag", ["output_attentions", "output_hidden_states"])
def test_output_flags_take_the_eager_path(flag):
    model, cap = graph_model("tiny-mla-first")
    kw = dict(max_new_tokens=6, return_dict_in_generate=True, **{flag: True})
    eager, graph = both(model, rand_ids(1, 5), **kw)
    assert torch.equal(eager.sequences, graph.sequences) and cap.replays == 0
    field = "attentions" if flag == "output_attentions" else "hidden_states"
    for a, b in zip(getattr(eager, field), getattr(graph, field)):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


class Collect(BaseStreamer):
    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value.clone())

    def end(self):
        self.tokens.append(None)


def test_streamer_and_stopping_criteria():
    model, cap = graph_model()
    ids = rand_ids(1, 6)

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 6 + 9, dtype=torch.bool)

    streams = []
    outs = []
    for graphs in (False, True):
        s = Collect()
        outs.append(gen(model, ids, max_new_tokens=30, streamer=s, cuda_graphs=graphs,
                        stopping_criteria=StoppingCriteriaList([StopAfter()])))
        streams.append(s.tokens)
    assert torch.equal(outs[0], outs[1]) and outs[0].shape[1] == 15
    assert len(streams[0]) == len(streams[1]) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(*streams))
    assert cap.replays > 0


def char_tokenizer():
    """A character-level fast tokenizer over the tiny vocabulary (token i is the character ``CHARS[i]``)."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE({c: i for i, c in enumerate(CHARS)}, merges=[]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=CHARS[0], eos_token=CHARS[2])


CHARS = [chr(ord("!") + i) for i in range(94)] + [chr(0x100 + i) for i in range(34)]


def test_stop_strings_with_tokenizer():
    model, cap = graph_model()
    ids = rand_ids(1, 6)
    full = gen(model, ids, max_new_tokens=20, cuda_graphs=False)
    stop = CHARS[int(full[0, 6 + 5])]  # the sixth new token's character
    tok = char_tokenizer()
    outs = [gen(model, ids, max_new_tokens=20, stop_strings=[stop], tokenizer=tok, cuda_graphs=g)
            for g in (False, True)]
    assert torch.equal(outs[0], outs[1])
    assert outs[0].shape[1] <= 6 + 6 and torch.equal(outs[0], full[:, :outs[0].shape[1]])


@pytest.mark.parametrize("mode", ["assistant_model", "prompt_lookup"])
def test_assisted_and_prompt_lookup_equal_eager(mode):
    model, cap = graph_model("tiny-kda-first")
    ids = torch.cat([rand_ids(1, 8), rand_ids(1, 8)], dim=1)  # repeats: prompt lookup finds candidates
    kw = dict(max_new_tokens=16)
    if mode == "assistant_model":
        kw["assistant_model"] = tiny_random_model("tiny-mla-first", seed=5)
    else:
        kw["prompt_lookup_num_tokens"] = 3
    eager, graph = both(model, ids, **kw)
    plain = gen(model, ids, max_new_tokens=16, cuda_graphs=False)
    assert torch.equal(eager, graph) and torch.equal(graph, plain)
    assert cap.replays == 0  # the caches record their rollback history (host-side): eager by design


def test_user_cache_fast_path_and_reuse():
    model, cap = graph_model()
    ids = rand_ids(1, 10)
    ce, cg = KimiHybridCache(model.config), KimiHybridCache(model.config)
    a = gen(model, ids, max_new_tokens=8, cuda_graphs=False, **{GENERATION_CACHE_NAME: ce})
    b = gen(model, ids, max_new_tokens=8, **{GENERATION_CACHE_NAME: cg})
    assert torch.equal(a, b) and cap.replays == 7 and not cg.static
    assert ce.get_seq_length() == cg.get_seq_length() == 17
    # continuing: the ids extend what the cache holds
    more = torch.cat([a, rand_ids(1, 3, seed=4)], dim=1)
    a2 = gen(model, more, max_new_tokens=6, cuda_graphs=False, **{GENERATION_CACHE_NAME: ce})
    b2 = gen(model, more, max_new_tokens=6, **{GENERATION_CACHE_NAME: cg})
    ref = gen(model, more, max_new_tokens=6, cuda_graphs=False)
    assert torch.equal(a2, ref) and torch.equal(b2, ref)


def test_graphs_recaptured_after_weights_change():
    model, cap = graph_model()
    ids = rand_ids(1, 6)
    gen(model, ids, max_new_tokens=5)
    assert cap.captures == 1
    gen(model, ids, max_new_tokens=5)
    assert cap.captures == 1  # same weights: the cached graph
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight * 1.5)  # new storage
    eager, graph = both(model, ids, max_new_tokens=5)
    assert torch.equal(eager, graph) and cap.captures == 2


def test_new_ids_with_the_whole_mask_continue_a_filled_cache():
    """transformers' other continuation form: only the new ids, with the attention mask of the whole sequence."""
    model, cap = graph_model()
    ids = rand_ids(1, 10)
    c = KimiHybridCache(model.config)
    first = gen(model, ids, max_new_tokens=5, **{GENERATION_CACHE_NAME: c})
    full = torch.cat([first, rand_ids(1, 2, seed=6)], dim=1)
    new = full[:, c.get_seq_length():]  # what the cache does not hold: the last generated token and two more
    out = gen(model, new, attention_mask=torch.ones_like(full), max_new_tokens=4, **{GENERATION_CACHE_NAME: c})
    ref = gen(model, full, max_new_tokens=4, cuda_graphs=False)
    assert torch.equal(out[:, -4:], ref[:, -4:])


@pytest.mark.parametrize("graphs", [False, True])
def test_filled_cache_not_extended_is_refused(graphs):
    model, _ = graph_model()
    ids = rand_ids(1, 10)
    c = KimiHybridCache(model.config)
    gen(model, ids, max_new_tokens=5, cuda_graphs=graphs, **{GENERATION_CACHE_NAME: c})
    held = c.get_seq_length()
    with pytest.raises(ValueError, match="already holds 14 tokens but the input has 10"):
        gen(model, ids, max_new_tokens=5, cuda_graphs=graphs, **{GENERATION_CACHE_NAME: c})
    assert c.get_seq_length() == held  # untouched


def test_static_cache_implementation_uses_graphs():
    model, cap = graph_model()
    ids = rand_ids(2, 7)
    eager, graph = both(model, ids, max_new_tokens=12, cache_implementation="static", return_dict_in_generate=True)
    assert torch.equal(eager.sequences, graph.sequences) and cap.replays == 11
    cache = output_cache(graph)
    assert cache.static and not model.decode_graphs().workspace(cache)
    # one graph, of the static cache's own capacity (the request's length rounded up to the bucket)
    assert [s["capacity"] for s in model.cuda_graphs_memory()["slots"]] == [cache.max_cache_len] == [32]
    assert cache.get_seq_length() == output_cache(eager).get_seq_length() == 7 + 11
    assert torch.equal(graph.sequences, gen(model, ids, max_new_tokens=12, cuda_graphs=False))


def test_generate_from_prefix_fast_path():
    model, cap = graph_model()
    prefix = rand_ids(1, 9)
    pc = model.prefill_prefix(prefix)
    suffixes = [rand_ids(3, seed=2), rand_ids(5, seed=3)]
    with torch.no_grad():
        a = model.generate_from_prefix(pc, prefix, suffixes, max_new_tokens=8, do_sample=False, cuda_graphs=False)
        b = model.generate_from_prefix(pc, prefix, suffixes, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and cap.replays == 7 and pc.get_seq_length() == 9


@pytest.mark.parametrize("kind", ["DynamicCache", "StaticCache"])
def test_transformers_cache_is_honoured_on_the_eager_path(kind):
    """A transformers cache is used as it is (never replaced by a workspace): its steps run eagerly."""
    model, cap = graph_model()
    ids = rand_ids(1, 6)
    c = DynamicCache(config=model.config) if kind == "DynamicCache" else StaticCache(
        config=model.config, max_cache_len=32)
    out = gen(model, ids, max_new_tokens=6, **{GENERATION_CACHE_NAME: c})
    assert torch.equal(out, gen(model, ids, max_new_tokens=6, cuda_graphs=False))
    assert type(c).__name__ == kind and c.get_seq_length() == 11 and cap.replays == 0


def test_opt_out_flag_and_generation_config_field_and_unknown_keyword():
    model, cap = graph_model()
    ids = rand_ids(1, 5)
    gen(model, ids, max_new_tokens=5, cuda_graphs=False)
    gen(model, ids, generation_config=GenerationConfig(max_new_tokens=5, do_sample=False, cuda_graphs=False))
    model.generation_config.cuda_graphs = False
    gen(model, ids, max_new_tokens=5)
    assert cap.replays == 0
    model.generation_config.cuda_graphs = True
    gen(model, ids, max_new_tokens=5)
    assert cap.replays == 4
    with pytest.raises(ValueError, match="not_a_generate_argument"):
        gen(model, ids, max_new_tokens=5, not_a_generate_argument=1)


def test_cpu_default_is_eager():
    model = tiny_random_model()
    out = gen(model, rand_ids(1, 5), max_new_tokens=5)
    assert out.shape[1] == 10 and model.cuda_graphs_memory()["graphs"] == 0


class Shift(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores - 0.5 * (torch.arange(scores.shape[-1]) % 3 == 0)


GENERATE_ARGUMENTS = {
    "assistant_model": lambda: dict(assistant_model=tiny_random_model("tiny-mla-first", seed=5)),
    "prompt_lookup_num_tokens": lambda: dict(prompt_lookup_num_tokens=2),
    "streamer": lambda: dict(streamer=Collect()),
    "stopping_criteria": lambda: dict(stopping_criteria=StoppingCriteriaList()),
    "logits_processor": lambda: dict(logits_processor=LogitsProcessorList([Shift()])),
    "negative_prompt_ids": lambda: dict(negative_prompt_ids=rand_ids(1, 3, seed=9), guidance_scale=1.5),
    "synced_gpus": lambda: dict(synced_gpus=False),
    "tokenizer+stop_strings": lambda: dict(tokenizer=char_tokenizer(), stop_strings=[CHARS[77]]),
    "prefix_allowed_tokens_fn": lambda: dict(prefix_allowed_tokens_fn=lambda b, s: list(range(3, 60))),
    "generation_config": lambda: dict(generation_config=GenerationConfig(max_new_tokens=6, do_sample=False)),
}


@pytest.mark.parametrize("name", sorted(GENERATE_ARGUMENTS))
def test_every_documented_generate_argument(name):
    """generate's own keywords are consumed by generate: never passed to the forward (which refuses unknown ones)."""
    model, cap = graph_model()
    ids = rand_ids(1, 6)
    kw = GENERATE_ARGUMENTS[name]()
    kw.setdefault("max_new_tokens", 6) if "generation_config" not in kw else None
    eager = gen(model, ids, cuda_graphs=False, **kw)
    kw = GENERATE_ARGUMENTS[name]()
    kw.setdefault("max_new_tokens", 6) if "generation_config" not in kw else None
    graph = gen(model, ids, **kw)
    assert torch.equal(eager, graph) and eager.shape[1] > 6


def test_user_static_cache_keeps_its_capacity():
    model, cap = graph_model()
    ids = rand_ids(1, 7)
    c = KimiHybridCache(model.config, max_cache_len=21)
    out = gen(model, ids, max_new_tokens=10, **{GENERATION_CACHE_NAME: c})
    assert torch.equal(out, gen(model, ids, max_new_tokens=10, cuda_graphs=False)) and cap.replays == 9
    assert [s["capacity"] for s in model.cuda_graphs_memory()["slots"]] == [21] and c.get_seq_length() == 16
    with pytest.raises(ValueError, match="static cache"):  # full: the eager step's overflow error
        gen(model, out, max_new_tokens=10, **{GENERATION_CACHE_NAME: c})


def test_compiled_static_generate_does_not_recompile_inside_the_bucket():
    """transformers' compile path (compile_config, graphs off): a longer request inside the static cache's capacity
    bucket compiles nothing new."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    torch._dynamo.reset()
    model, _ = graph_model()
    ids = rand_ids(1, 5)
    config = CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # compile on CPU as well
    kw = dict(do_sample=False, cache_implementation="static", compile_config=config, return_dict_in_generate=True)
    first = model.generate(ids, max_new_tokens=3, **kw)
    graphs = counters["stats"]["unique_graphs"]
    second = model.generate(ids, max_new_tokens=9, **kw)  # 14 positions: the same 16-token bucket
    assert counters["stats"]["unique_graphs"] == graphs, "a longer request inside the bucket recompiled"
    assert output_cache(first).get_max_length() == output_cache(second).get_max_length() == 16
    assert torch.equal(second.sequences, gen(model, ids, max_new_tokens=9, cuda_graphs=False))
    torch._dynamo.reset()


def test_eager_decode_step_reads_nothing_back_to_the_host(monkeypatch):
    """Issue 21 item 4: an eager decode step (graphs off) reads no tensor value back to the host (id range, mask
    and cache checks run on the prompt / once per generate). Counted: ``bool`` / ``int`` / ``float`` / ``item`` /
    ``tolist`` / ``__index__`` on tensors inside one-token forwards. The one exception is the MoE experts' CPU loop
    (``moe_kimi_hybrid.py``, per-expert row counts: on CUDA the grouped GEMM keeps its offsets on the device)."""
    import traceback

    from kimi_hybrid.modeling_kimi_hybrid import KimiHybridModel

    model = tiny_random_model("tiny-mla-first")
    reads, decoding = [], [False]
    forward = KimiHybridModel.forward

    def counted_forward(self, *args, **kwargs):
        ids = kwargs.get("input_ids")
        decoding[0] = ids is not None and ids.shape[1] == 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            decoding[0] = False

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            if decoding[0]:
                where = [f for f in traceback.extract_stack()[:-1] if "kimi_hybrid" in f.filename]
                if not where[-1].filename.endswith("moe_kimi_hybrid.py"):
                    reads.append((name, where[-1].filename.rsplit("/", 1)[-1], where[-1].lineno))
            return original(self, *args, **kwargs)

        return read

    monkeypatch.setattr(KimiHybridModel, "forward", counted_forward)
    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    ids = rand_ids(2, 8)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    out = gen(model, ids, attention_mask=mask, max_new_tokens=6, cuda_graphs=False)
    assert out.shape[1] == 14 and reads == []
