"""Helpers shared by the tests (tiny vocab 128; ids 0..2 are specials)."""

import pytest
import torch

PAD = 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two OpenMP threads competing
    with another process run 10-100x slower; one thread keeps the suite's time predictable."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand_ids(*shape, seed=1):
    """Random non-special token ids ``[*shape]`` from a fixed seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, shape, generator=g)


@torch.no_grad()
def logits_nocache(model, ids, mask=None):
    """The reference: logits of a full forward without any cache."""
    return model(ids, attention_mask=mask, use_cache=False).logits


def gen(model, ids, **kw):
    """``model.generate`` greedy by default, with our pad id."""
    kw.setdefault("do_sample", False)
    kw.setdefault("pad_token_id", PAD)
    with torch.no_grad():
        return model.generate(ids, **kw)


def tiny_random_model(name="tiny-kda-first", seed=0, bias=True, **over):
    """A tiny random ``KimiHybridForCausalLM`` of preset ``name`` (eval mode, fp32). ``bias``: give the routers a
    non-zero correction bias (it only chooses experts, never weights them: a zero bias would hide that)."""
    from kimi_hybrid import KimiHybridForCausalLM
    from presets import preset_config

    torch.manual_seed(seed)
    model = KimiHybridForCausalLM(preset_config(name, **over)).eval()
    if bias:
        with torch.no_grad():
            for mod in model.modules():
                if hasattr(mod, "e_score_correction_bias"):
                    mod.e_score_correction_bias.normal_(0, 0.2)
    return model


def max_abs_diff(a, b) -> float:
    """Largest absolute difference of two tensors, compared in fp32."""
    return (a.float() - b.float()).abs().max().item()


def no_weight_reads(monkeypatch):
    """Make every safetensors read that transformers' loading can do fail loudly (a refusal must come before any
    weight is read)."""
    import safetensors
    import safetensors.torch
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("a weight file was opened")

    monkeypatch.setattr(transformers.modeling_utils, "safe_open", refuse)
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr(safetensors.torch, "load_file", refuse)


class CountingCapture:
    """Wraps a graph object of ``engine_kimi_hybrid`` (``EagerCapture``, ``CudaGraphCapture``) and counts its
    captures and replays (tests of ``generate``'s graph decode steps)."""

    def __init__(self, inner):
        self.inner = inner
        self.captures = 0
        self.replays = 0

    def supports(self, device) -> bool:
        return self.inner.supports(device)

    def __call__(self, fn, device):
        replay, out, nbytes = self.inner(fn, device)
        self.captures += 1

        def counted():
            self.replays += 1
            replay()

        return counted, out, nbytes
