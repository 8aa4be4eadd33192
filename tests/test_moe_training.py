"""MoE prefill / training paths against plain references: the grouped expert path (routing weight folded before the
down projection, the k rows of a token summed by a gather), the router's weights, and PEFT LoRA on the routed
experts as split low-rank products (against PEFT's own ``ParamWrapper`` forward).

CPU tests run the expert loop (the reference the CUDA grouped GEMM is tested against); the GPU tests at the end
run the grouped GEMM and skip without CUDA. Tolerances are stated per test.
"""

from __future__ import annotations

import copy

import pytest
import torch

from kimi_hybrid import moe_kimi_hybrid as moe
from presets import preset_config

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def experts_cfg(**over):
    kw = dict(num_experts=16, num_experts_per_token=4, moe_intermediate_size=24, hidden_size=32)
    kw.update(over)
    return preset_config("tiny-kda-first", **kw)


def make_experts(cfg, device="cpu", dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    ex = moe.KimiExperts(cfg, cfg.hidden_size)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.2)
    torch.nn.init.normal_(ex.down_proj, std=0.2)
    return ex.to(device, dtype)


def random_block(cfg, seed):
    """A KimiMoE block with N(0, 0.2) weights and a zero balancing bias."""
    torch.manual_seed(seed)
    block = moe.KimiMoE(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    with torch.no_grad():
        block.gate.e_score_correction_bias.zero_()
    return block


def naive_experts(x, idx, w, gate_up, down, F_):
    """Per token, per choice: ``sum_j w[t, j] * down_e(silu(gate_e x) * up_e x)`` (no sorting, no gather)."""
    rows = []
    for t in range(x.shape[0]):
        acc = 0
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = gate_up[e] @ x[t]
            acc = acc + w[t, j] * (down[e] @ (torch.nn.functional.silu(h[:F_]) * h[F_:]))
        rows.append(acc)
    return torch.stack(rows)


def routes(N, E, k, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)]).to(device)
    w = torch.rand(N, k, generator=g).to(device)
    return idx, w


# ------------------------------------------------------------------------------------------------------------------
# the grouped expert path and its combine
# ------------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N", [1, 5, 37])
def test_grouped_experts_outputs_and_grads_match_naive(N):
    """fp32: output and the gradients of x, the routing weights and both expert weights match the per-token
    reference to relative L2 1e-5 (measured ~1e-7)."""
    cfg = experts_cfg()
    ex = make_experts(cfg)
    idx, w = routes(N, cfg.num_experts, cfg.num_experts_per_token)
    x = torch.randn(N, cfg.hidden_size, requires_grad=True)
    w.requires_grad_(True)
    g = torch.randn(N, cfg.hidden_size)
    y = moe.grouped_experts_forward(ex, x, idx, w)
    got = torch.autograd.grad(y, (x, w, ex.gate_up_proj, ex.down_proj), g)
    ref = naive_experts(x, idx, w, ex.gate_up_proj, ex.down_proj, cfg.moe_intermediate_size)
    want = torch.autograd.grad(ref, (x, w, ex.gate_up_proj, ex.down_proj), g)
    assert rel(y, ref) < 1e-5
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


def test_grouped_experts_bf16_within_bound():
    """bf16 weights and inputs (CPU loop): output within relative L2 2e-2 of the fp32 reference on the same
    (bf16-rounded) weights (measured ~3e-3)."""
    cfg = experts_cfg()
    ex = make_experts(cfg)
    idx, w = routes(23, cfg.num_experts, cfg.num_experts_per_token)
    x = torch.randn(23, cfg.hidden_size)
    exb = copy.deepcopy(ex).bfloat16()
    with torch.no_grad():
        y = moe.grouped_experts_forward(exb, x.bfloat16(), idx, w)
        ref = naive_experts(x.bfloat16().float(), idx, w, exb.gate_up_proj.float(), exb.down_proj.float(),
                            cfg.moe_intermediate_size)
    assert y.dtype == torch.bfloat16
    assert rel(y, ref) < 2e-2


def test_combine_pairs_is_the_per_token_sum():
    """combine_pairs(ys, order, k) sums the k rows of each token, exactly (fp32, integers-valued rows)."""
    N, k, D = 9, 3, 5
    idx = torch.randint(0, 4, (N, k))
    order = idx.reshape(-1).argsort(stable=True)
    pair_rows = torch.randint(-50, 50, (N * k, D)).float()  # row of pair p = n*k + j
    ys = pair_rows[order]  # in expert order
    assert torch.equal(moe.combine_pairs(ys, order, k), pair_rows.view(N, k, D).sum(1))


def test_route_weights_match_route_topk():
    """route_weights on route_topk's choice gives route_topk's weights exactly (sigmoid and softmax, grouped)."""
    torch.manual_seed(0)
    logits = torch.randn(11, 16)
    bias = torch.randn(16) * 0.1
    for sig in (True, False):
        w, idx = moe.route_topk(logits, bias, top_k=4, num_groups=4, topk_group=2, sigmoid=sig, renormalize=True,
                                scaling=2.5)
        w2 = moe.route_weights(logits, idx, sigmoid=sig, renormalize=True, scaling=2.5)
        assert torch.equal(w, w2)


def test_moe_block_router_grad_matches_reference():
    """KimiMoE (router + grouped experts + shared expert), fp32: the gradients of x and of the router weight
    match a reference built from route_topk + the per-token loop + the shared MLP (relative L2 1e-5)."""
    cfg = experts_cfg(num_shared_experts=1)
    block = random_block(cfg, seed=3)
    x = torch.randn(2, 7, cfg.hidden_size, requires_grad=True)
    g = torch.randn_like(x)
    params = (x, block.gate.weight, block.experts.gate_up_proj)
    got = torch.autograd.grad(block(x), params, g)
    flat = x.reshape(-1, cfg.hidden_size)
    logits = flat @ block.gate.weight.t()
    w, idx = moe.route_topk(logits, block.gate.e_score_correction_bias, top_k=cfg.num_experts_per_token,
                            num_groups=cfg.num_expert_group if cfg.use_grouped_topk else 1,
                            topk_group=cfg.topk_group, sigmoid=cfg.moe_router_activation_func == "sigmoid",
                            renormalize=cfg.moe_renormalize, scaling=cfg.routed_scaling_factor)
    ref = naive_experts(flat, idx, w, block.experts.gate_up_proj, block.experts.down_proj,
                        cfg.moe_intermediate_size) + block.shared_experts(flat)
    want = torch.autograd.grad(ref.view_as(x), params, g)
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


# ------------------------------------------------------------------------------------------------------------------
# split LoRA on the routed experts vs PEFT's ParamWrapper
# ------------------------------------------------------------------------------------------------------------------

peft = pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from kimi_hybrid.app.lora import EXPERT_PARAMETERS  # noqa: E402


class _Holder(torch.nn.Module):
    """A module tree with ``mlp`` = one KimiMoE, so PEFT's ``target_parameters`` suffixes match."""

    def __init__(self, block):
        super().__init__()
        self.mlp = block


def lora_block(cfg, r=8, seed=5, adapters=("default",)):
    block = random_block(cfg, seed=4)
    torch.manual_seed(seed)
    lc = LoraConfig(r=r, lora_alpha=2 * r, target_parameters=list(EXPERT_PARAMETERS), init_lora_weights=False)
    pm = get_peft_model(_Holder(block), lc, adapter_name=adapters[0])
    for name in adapters[1:]:
        pm.add_adapter(name, lc)
    return pm


def _grads(pm, x, g):
    params = [x] + [p for p in pm.parameters() if p.requires_grad]
    y = pm.base_model.model.mlp(x)
    return y, torch.autograd.grad(y, params, g)


def _peft_path(monkeypatch):
    monkeypatch.setattr(moe, "expert_adapters", lambda module, cls: None)


def _no_dense_delta(monkeypatch):
    """Fail if anything forms W + BA (PEFT's fold is a baddbmm; its multi-adapter path calls get_delta_weight)."""
    def refuse(*a, **k):
        raise AssertionError("the expert delta W + BA was materialised")

    monkeypatch.setattr(torch, "baddbmm", refuse)
    monkeypatch.setattr(peft.tuners.lora.layer.ParamWrapper, "get_delta_weight", refuse)


@pytest.mark.parametrize("adapters", [("default",), ("a", "b")])
def test_split_lora_matches_peft(monkeypatch, adapters):
    """fp32: the MoE block with PEFT LoRA on gate_up_proj / down_proj, run as split low-rank products, matches
    PEFT's own forward (W + s B A) in output and in the gradients of x, the router and every lora_A / lora_B to
    relative L2 1e-5 (measured ~1e-7), without forming W + BA. Two active adapters add their terms."""
    cfg = experts_cfg(num_shared_experts=1)
    pm = lora_block(cfg, adapters=adapters)
    pm.base_model.set_adapter(list(adapters))
    pm.base_model.model.mlp.gate.weight.requires_grad_(True)
    x = torch.randn(2, 9, cfg.hidden_size, requires_grad=True)
    g = torch.randn_like(x)
    with monkeypatch.context() as m:
        _no_dense_delta(m)
        y, got = _grads(pm, x, g)
    with monkeypatch.context() as m:
        _peft_path(m)
        y_ref, want = _grads(pm, x, g)
    assert rel(y, y_ref) < 1e-5
    assert len(got) == len(want) > 4 * len(adapters)
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


def _cpu_grouped_mm():
    """Whether this torch runs F.grouped_mm on CPU (fp32): then the grouped branch is testable here."""
    gm = getattr(torch.nn.functional, "grouped_mm", None)
    try:
        gm(torch.ones(2, 8), torch.ones(1, 8, 8), offs=torch.tensor([2], dtype=torch.int32))
        return True
    except Exception:  # noqa: BLE001  (absent, or CUDA-only in this torch)
        return False


@pytest.mark.skipif(not _cpu_grouped_mm(), reason="F.grouped_mm does not run on CPU in this torch")
def test_split_lora_grouped_branch_matches_peft(monkeypatch):
    """The grouped-GEMM branch itself (F.grouped_mm on CPU in fp32, the CUDA dtype rule lifted): the split terms
    through transposed factor views and grouped_mm's backward match PEFT's forward, output and gradients within
    relative L2 1e-5 (measured ~3e-7)."""
    cfg = experts_cfg(num_shared_experts=1)
    pm = lora_block(cfg)
    x = torch.randn(2, 9, cfg.hidden_size, requires_grad=True)
    g = torch.randn_like(x)
    calls = []
    split = moe._grouped_split
    with monkeypatch.context() as m:
        m.setattr(moe, "grouped_mm_applies", lambda *a: True)
        m.setattr(moe, "_grouped_split", lambda *a: calls.append(1) or split(*a))
        _no_dense_delta(m)
        y, got = _grads(pm, x, g)
    assert len(calls) == 2  # gate_up and down, each with its LoRA term
    with monkeypatch.context() as m:
        _peft_path(m)
        y_ref, want = _grads(pm, x, g)
    assert rel(y, y_ref) < 1e-5
    for a, b in zip(got, want):
        assert rel(a, b) < 1e-5


def test_split_lora_disabled_and_merged(monkeypatch):
    """With the adapter disabled the block equals the base block exactly; after merge_and_unload the plain block
    equals the adapted block (fp32, max abs 1e-5)."""
    cfg = experts_cfg()
    pm = lora_block(cfg)
    x = torch.randn(1, 6, cfg.hidden_size)
    with torch.no_grad():
        y = pm.base_model.model.mlp(x)
        with pm.disable_adapter():
            y_off = pm.base_model.model.mlp(x)
        base = copy.deepcopy(pm).unload().mlp(x)
        merged = copy.deepcopy(pm).merge_and_unload().mlp
        assert type(merged.experts) is moe.KimiExperts
        y_merged = merged(x)
    assert torch.equal(y_off, base)
    assert (y - y_off).abs().max() > 1e-3
    assert (y - y_merged).abs().max() <= 1e-5


def test_split_lora_model_training_step_matches_peft(monkeypatch):
    """A tiny model with the recommended LoRA (attention, shared expert, routed experts) and gradient
    checkpointing: loss and every LoRA gradient of the split path match PEFT's path (relative 1e-5), and the
    checkpoint recompute forms no W + BA either."""
    from kimi_hybrid import KimiHybridForCausalLM
    from kimi_hybrid.app.lora import enable_gradient_checkpointing, recommended_lora_config

    torch.manual_seed(0)
    base = KimiHybridForCausalLM(preset_config("tiny-kda-first", initializer_range=0.1))
    torch.manual_seed(1)
    pm = get_peft_model(base, recommended_lora_config(base.config, r=8, alpha=16, init_lora_weights=False))
    enable_gradient_checkpointing(pm)
    pm.train()
    ids = torch.randint(3, 128, (2, 12))

    def step():
        pm.zero_grad(set_to_none=True)
        loss = pm(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}

    with monkeypatch.context() as m:
        _no_dense_delta(m)
        loss, got = step()
    with monkeypatch.context() as m:
        _peft_path(m)
        loss_ref, want = step()
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    assert got.keys() == want.keys() and any("lora_A" in n and "experts" in n for n in got)
    for n in got:
        assert rel(got[n], want[n]) < 1e-5, n


def test_split_lora_bf16_within_bound(monkeypatch):
    """bf16 block (CPU loop): the split path's output and lora_B gradients are within relative L2 2e-2 of PEFT's
    path in fp32 on the same bf16-rounded weights (measured ~4e-3)."""
    cfg = experts_cfg()
    pm32 = lora_block(cfg)
    pm16 = copy.deepcopy(pm32).bfloat16()
    pm32.load_state_dict({k: v.float() for k, v in pm16.state_dict().items()})
    x = torch.randn(1, 11, cfg.hidden_size)
    g = torch.randn_like(x)
    y16, got = _grads(pm16, x.bfloat16().requires_grad_(True), g.bfloat16())
    with monkeypatch.context() as m:
        _peft_path(m)
        y32, want = _grads(pm32, x.clone().requires_grad_(True), g)
    assert rel(y16, y32) < 2e-2
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2


# ------------------------------------------------------------------------------------------------------------------
# GPU: the grouped GEMM with split LoRA, the router kernel under autograd
# ------------------------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.gpu
def test_gpu_grouped_split_lora_matches_peft_fp32(monkeypatch):
    """bf16 on CUDA, widths the grouped GEMM takes (D 128, F 64, r 16): output and gradients of the split grouped
    path within relative L2 2e-2 of PEFT's path in fp32 on CPU, and the grouped path never synchronises with the
    host."""
    cfg = experts_cfg(num_experts=32, num_experts_per_token=8, moe_intermediate_size=64, hidden_size=128)
    pm32 = lora_block(cfg, r=16)
    pm16 = copy.deepcopy(pm32).to("cuda", torch.bfloat16)
    pm32.load_state_dict({k: v.float().cpu() for k, v in pm16.state_dict().items()})
    block = pm16.base_model.model.mlp
    x = torch.randn(300, cfg.hidden_size)
    g = torch.randn_like(x)
    xs = x.cuda().bfloat16()
    idx, w = routes(300, cfg.num_experts, cfg.num_experts_per_token, device="cuda")
    offs = torch.arange(1, cfg.num_experts + 1, device="cuda", dtype=torch.int32)
    assert moe.grouped_mm_applies(xs, block.experts.get_base_layer().gate_up_proj,
                                  block.experts.get_base_layer().down_proj, offs)
    found = moe.expert_adapters(block.experts, moe.KimiExperts)
    assert found is not None and all(len(t) == 1 for t in found[1])
    torch.cuda.set_sync_debug_mode("error")
    try:
        xs.requires_grad_(True)
        y = moe.grouped_experts_forward(found[0], xs, idx, w, adapters=found[1])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    lora_params = [p for p in pm16.parameters() if p.requires_grad]
    got = torch.autograd.grad(y, [xs] + lora_params, g.cuda().bfloat16())
    b32 = pm32.base_model.model.mlp
    x32 = x.clone().requires_grad_(True)
    with monkeypatch.context() as m:
        _peft_path(m)
        y_ref = b32.experts(x32, idx.cpu(), w.cpu())
    want = torch.autograd.grad(y_ref, [x32] + [p for p in pm32.parameters() if p.requires_grad], g)
    assert rel(y.cpu(), y_ref) < 2e-2
    for a, b in zip(got, want):
        assert rel(a.cpu(), b) < 2e-2


@gpu
@pytest.mark.gpu
def test_gpu_router_kernel_under_autograd_matches_reference():
    """On CUDA with autograd the router takes the Triton choice and recomputes the weights: same choice and
    weights as route_topk (weights relative 1e-6), same gradient of the logits."""
    cfg = experts_cfg(num_experts=64, num_experts_per_token=8)
    router = moe.KimiRouter(cfg).cuda()
    torch.nn.init.normal_(router.weight, std=0.2)
    x = torch.randn(200, cfg.hidden_size, device="cuda")
    logits, w, idx = router(x)
    wr, ir = moe.route_topk(logits, router.e_score_correction_bias, top_k=8,
                            num_groups=cfg.num_expert_group if cfg.use_grouped_topk else 1, topk_group=cfg.topk_group,
                            sigmoid=cfg.moe_router_activation_func == "sigmoid", renormalize=cfg.moe_renormalize,
                            scaling=cfg.routed_scaling_factor)
    assert torch.equal(idx, ir)
    assert rel(w, wr) < 1e-6
    g = torch.randn_like(w)
    # (both weights hang off the same logits: keep the shared graph for the second gradient)
    grad = torch.autograd.grad(w, router.weight, g, retain_graph=True)[0]
    assert rel(grad, torch.autograd.grad(wr, router.weight, g)[0]) < 1e-5
