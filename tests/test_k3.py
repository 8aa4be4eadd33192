"""Kimi K3 text backbone: each K3 module and the whole tiny K3 forward against an explicit restatement of
docs/k3.md written here (independent of the model code), the K3 dtype rules, the K3 preset, cache /
generation equivalences on tiny K3 configs, the full-preset cache memory at 128,000 tokens, and a K3 chat round trip.

The reference functions below (``ref_*``) read only tensors of the model's ``state_dict`` and the config's numbers;
they never call the model's modules or helpers. CPU, fp32, no network.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kimi_hybrid.modeling_kimi_hybrid as mk
import kimi_hybrid.moe_kimi_hybrid as mkm
from conversion_fixtures import released_config_dict
from transformers.cache_utils import DynamicCache

from kimi_hybrid import KimiHybridCache, KimiHybridConfig, KimiHybridForCausalLM
from kimi_hybrid.cache_kimi_hybrid import kda_store, layer_tensors
from presets import preset_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models are all per-op overhead: one intra-op thread avoids spin-wait contention on a shared 2-core
    machine (about 20x faster here). Restored after this module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


TINY_K3 = ["tiny-k3", "tiny-k3-softplus", "tiny-k3-block4"]
LINEAR, FULL = "linear_attention", "full_attention"


# ================================================================================================================
# the spec, restated (docs/k3.md sections 2-5); plain fp32 torch, no model code
# ================================================================================================================

REF_DTYPE = torch.float32  # the reference computes in this dtype (float64 to measure the model's own rounding)


def ref_rmsnorm(x, w=None, eps=1e-5):
    """x / sqrt(mean(x^2) + eps) (fp32), times w when given."""
    x = x.to(REF_DTYPE)
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.to(REF_DTYPE)


def ref_situ(g, u, beta, lin_beta):
    """SiTU-GLU (spec 5): [beta tanh(g/beta) sigmoid(g)] * [lin_beta tanh(u/lin_beta)], fp32; beta None -> 1,
    lin_beta None -> plain u."""
    g, u = g.to(REF_DTYPE), u.to(REF_DTYPE)
    beta = 1.0 if beta is None else beta
    left = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    right = u if lin_beta is None else lin_beta * torch.tanh(u / lin_beta)
    return left * right


def ref_act(cfg, g, u):
    if cfg.hidden_act == "situ":
        return ref_situ(g, u, cfg.activation_situ_beta, cfg.activation_situ_linear_beta)
    return g.to(REF_DTYPE) * torch.sigmoid(g.to(REF_DTYPE)) * u.to(REF_DTYPE)


def ref_glu_mlp(cfg, sd, pre, x):
    """Dense / shared-expert MLP: down(act(gate x, up x))."""
    g = x @ sd[pre + "gate_proj.weight"].T
    u = x @ sd[pre + "up_proj.weight"].T
    return ref_act(cfg, g, u) @ sd[pre + "down_proj.weight"].T


def ref_route(cfg, x, W, bias):
    """K3 router (spec 4.1): fp32 sigmoid scores; bias only for the choice; plain top-k (1 group); weights =
    unbiased scores, renormalised (+1e-20), times routed_scaling_factor. x [N, D] -> (w [N, k], idx [N, k])."""
    assert cfg.num_expert_group == 1 and cfg.topk_group == 1
    s = torch.sigmoid(x.to(REF_DTYPE) @ W.to(REF_DTYPE).T)
    idx = torch.topk(s + bias.to(REF_DTYPE), cfg.num_experts_per_token, dim=-1).indices
    w = torch.gather(s, 1, idx)
    if cfg.num_experts_per_token > 1 and cfg.moe_renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx


def ref_latent_moe(cfg, sd, pre, x):
    """LatentMoE (spec 4): z = down(x); experts on z; fp32 weighted sum; routed_expert_norm (eps rms_norm_eps, when
    latent_moe_use_norm); up-proj; plus shared experts (width F * num_shared) on the full-width x."""
    shape = x.shape
    x = x.reshape(-1, shape[-1]).to(REF_DTYPE)
    w, idx = ref_route(cfg, x, sd[pre + "gate.weight"], sd[pre + "gate.e_score_correction_bias"])
    z = x @ sd[pre + "routed_expert_down_proj.weight"].T
    F_ = cfg.moe_intermediate_size
    gate_up = sd[pre + "experts.gate_up_proj"][idx]  # [N, k, 2F, L]
    down = sd[pre + "experts.down_proj"][idx]  # [N, k, L, F]
    h = torch.einsum("nl,nkfl->nkf", z, gate_up)
    a = ref_act(cfg, h[..., :F_], h[..., F_:])  # w1 = rows [:F] (gate), w3 = rows [F:] (up)
    y_e = torch.einsum("nkf,nklf->nkl", a, down)
    y = (w.unsqueeze(-1) * y_e).sum(1)
    if cfg.latent_moe_use_norm:
        y = ref_rmsnorm(y, sd[pre + "routed_expert_norm.weight"], cfg.rms_norm_eps)
    y = y @ sd[pre + "routed_expert_up_proj.weight"].T
    if cfg.num_shared_experts:
        assert sd[pre + "shared_experts.gate_proj.weight"].shape[0] == F_ * cfg.num_shared_experts
        y = y + ref_glu_mlp(cfg, sd, pre + "shared_experts.", x)
    return y.reshape(shape)


def ref_mla(cfg, sd, pre, x):
    """Gated NoPE MLA (spec 2), causal, no cache: q = q_b(RMSNorm_1e-6(q_a x)); c_kv normed with eps 1e-6; k_pe shared
    by the heads, never rotated; scale (nope+rope)^-1/2; out = o_proj(concat_heads * sigmoid(g_proj x))."""
    B, T, _ = x.shape
    H, n, r, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank is None:
        q = x @ sd[pre + "q_proj.weight"].T
    else:
        qa = ref_rmsnorm(x @ sd[pre + "q_a_proj.weight"].T, sd[pre + "q_a_layernorm.weight"], 1e-6)
        q = qa @ sd[pre + "q_b_proj.weight"].T
    q = q.view(B, T, H, n + r)
    kv = x @ sd[pre + "kv_a_proj_with_mqa.weight"].T
    c, k_pe = kv[..., :cfg.kv_lora_rank], kv[..., cfg.kv_lora_rank:]
    c = ref_rmsnorm(c, sd[pre + "kv_a_layernorm.weight"], 1e-6)
    kvb = (c @ sd[pre + "kv_b_proj.weight"].T).view(B, T, H, n + v)
    k = torch.cat([kvb[..., :n], k_pe.unsqueeze(2).expand(B, T, H, r)], -1)
    val = kvb[..., n:]
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(n + r)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    p = s.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("bhts,bshv->bthv", p, val).reshape(B, T, H * v)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(x @ sd[pre + "g_proj.weight"].T)
    return o @ sd[pre + "o_proj.weight"].T


def ref_decay(cfg, g_raw, A_log, dt_bias):
    """KDA decay (spec 3.2), fp32. g_raw [..., H, K]. Lower-bounded: lb * sigmoid(exp(A_log_h) (g + dt_bias));
    without gate_lower_bound: -exp(A_log_h) softplus(g + dt_bias)."""
    H, K = g_raw.shape[-2:]
    g = g_raw.to(REF_DTYPE) + dt_bias.to(REF_DTYPE).view(H, K)
    a = torch.exp(A_log.to(REF_DTYPE)).view(H, 1)
    lb = cfg.linear_attn_config.get("gate_lower_bound")
    if lb is None:
        return -a * F.softplus(g)
    return lb * torch.sigmoid(a * g)


def ref_kda(cfg, sd, pre, x):
    """K3 KDA (spec 3), token loop from a zero state: causal depthwise conv (kernel W, no bias) + SiLU on q, k, v;
    decay gate; beta = sigmoid(b_proj x); q, k L2-normalised (eps 1e-6 inside the sqrt); scale K^-1/2;
    S_t = (I - beta k k^T) Diag(e^g) S_{t-1} + beta k v^T; o_t = S_t^T (scale q_t); then
    RMSNorm_K(o) * o_norm * sigmoid(gate) with eps rms_norm_eps, gate = g_proj x (full rank) or g_b(g_a x); o_proj."""
    B, T, _ = x.shape
    H, K = cfg.linear_attn_config["num_heads"], cfg.linear_attn_config["head_dim"]
    W = cfg.linear_attn_config["short_conv_kernel_size"]

    def conv(name, y):  # y [B, T, C]; out_t = sum_i w[:, i] * y_{t - W + 1 + i}
        w = sd[pre + name + ".weight"].to(REF_DTYPE)[:, 0, :]  # [C, W]
        ypad = torch.cat([y.new_zeros(B, W - 1, y.shape[-1]), y], 1)
        out = sum(w[:, i] * ypad[:, i:i + T] for i in range(W))
        return out * torch.sigmoid(out)

    q = conv("q_conv1d", x @ sd[pre + "q_proj.weight"].T).view(B, T, H, K)
    k = conv("k_conv1d", x @ sd[pre + "k_proj.weight"].T).view(B, T, H, K)
    v = conv("v_conv1d", x @ sd[pre + "v_proj.weight"].T).view(B, T, H, K)
    g_raw = (x @ sd[pre + "f_a_proj.weight"].T) @ sd[pre + "f_b_proj.weight"].T
    g = ref_decay(cfg, g_raw.view(B, T, H, K), sd[pre + "A_log"], sd[pre + "dt_bias"])
    beta = torch.sigmoid(x @ sd[pre + "b_proj.weight"].T)  # [B, T, H]
    q = q / torch.sqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
    S = torch.zeros(B, H, K, K, dtype=REF_DTYPE)
    eye = torch.eye(K, dtype=REF_DTYPE)
    outs = []
    for t in range(T):
        kt, vt, bt = k[:, t], v[:, t], beta[:, t, :, None, None]
        decayed = torch.exp(g[:, t]).unsqueeze(-1) * S  # Diag(e^g) S
        S = (eye - bt * kt.unsqueeze(-1) * kt.unsqueeze(-2)) @ decayed + bt * kt.unsqueeze(-1) * vt.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t] * K ** -0.5))
    o = torch.stack(outs, 1)  # [B, T, H, V]
    if cfg.linear_attn_config.get("use_full_rank_gate"):
        gate = x @ sd[pre + "g_proj.weight"].T
    else:
        gate = (x @ sd[pre + "g_a_proj.weight"].T) @ sd[pre + "g_b_proj.weight"].T
    o = ref_rmsnorm(o, sd[pre + "o_norm.weight"], cfg.rms_norm_eps) * torch.sigmoid(gate.view(B, T, H, K))
    return o.reshape(B, T, H * K) @ sd[pre + "o_proj.weight"].T


def ref_attn_res(prefix, bank, proj_w, norm_w, eps):
    """AttnRes mix (spec 1.2): candidates = bank + [prefix]; keys RMS-normalised without weight (fp32, eps);
    score vector s = norm_w * proj_w; z_j = <k_j, s> (no temperature); softmax over depth; mix the raw values."""
    V = torch.stack([b.to(REF_DTYPE) for b in bank] + [prefix.to(REF_DTYPE)], 0)  # [n, ..., D]
    z = (ref_rmsnorm(V, None, eps) * (norm_w.to(REF_DTYPE) * proj_w.to(REF_DTYPE).reshape(-1))).sum(-1)
    a = torch.softmax(z, dim=0)
    return (a.unsqueeze(-1) * V).sum(0)


def ref_forward(cfg, sd, input_ids, trace=None, states=None):
    """The whole K3 forward (spec 1.3 + exit), from a state_dict. Returns logits [B, T, V] (fp32). ``trace`` gets
    (site, layer, candidate count) per mix; ``states`` gets the prefix sum entering each layer, then the final
    normed hidden state."""
    sd = {k: v.to(REF_DTYPE) for k, v in sd.items()}
    eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
    p = sd["model.embed_tokens.weight"][input_ids]
    bank = []
    for l in range(cfg.num_hidden_layers):
        pre = f"model.layers.{l}."
        if states is not None:
            states.append(p)
        if bank:
            x_attn = ref_attn_res(p, bank, sd[pre + "self_attention_res_proj.weight"],
                                  sd[pre + "self_attention_res_norm.weight"], eps)
        else:
            x_attn = p
        if trace is not None:
            trace.append(("attn", l, len(bank) + 1 if bank else 1))
        if l % bs == 0:  # snapshot after the pre-attention mix
            bank.append(p)
            p = None
        xa = ref_rmsnorm(x_attn, sd[pre + "input_layernorm.weight"], eps)
        if cfg.layer_types[l] == LINEAR:
            a = ref_kda(cfg, sd, pre + "self_attn.", xa)
        else:
            a = ref_mla(cfg, sd, pre + "self_attn.", xa)
        p = a if p is None else p + a
        x_mlp = ref_attn_res(p, bank, sd[pre + "mlp_res_proj.weight"], sd[pre + "mlp_res_norm.weight"], eps)
        if trace is not None:
            trace.append(("mlp", l, len(bank) + 1))
        xm = ref_rmsnorm(x_mlp, sd[pre + "post_attention_layernorm.weight"], eps)
        if cfg.mlp_layer_types[l] == "dense":
            m = ref_glu_mlp(cfg, sd, pre + "mlp.", xm)
        else:
            m = ref_latent_moe(cfg, sd, pre + "mlp.", xm)
        p = p + m
    h = ref_attn_res(p, bank, sd["model.output_attn_res_proj.weight"], sd["model.output_attn_res_norm.weight"], eps)
    if trace is not None:
        trace.append(("exit", cfg.num_hidden_layers, len(bank) + 1))
    h = ref_rmsnorm(h, sd["model.norm.weight"], eps)
    if states is not None:
        states.append(h)
    return h @ sd["lm_head.weight"].T


# ================================================================================================================
# helpers
# ================================================================================================================

@torch.no_grad()
def randomize(module, seed=0):
    """Give every parameter a non-trivial value so that each term of the spec matters: norm weights around 1,
    correction bias large enough to change the expert choice, A_log / dt_bias spread, res projections large enough
    for a non-uniform depth softmax, matrices ~ 0.5/sqrt(fan_in). (Larger scales make the 6-layer stack amplify fp32
    rounding past 1e-5: the fp32 reference itself then differs from a float64 one by more than that.)"""
    gen = torch.Generator().manual_seed(seed)

    def rnd(p, std, mean=0.0):
        p.copy_((torch.randn(p.shape, generator=gen) * std + mean).to(p.dtype))

    for name, p in module.named_parameters():
        if name.endswith("A_log"):
            rnd(p, 0.5)
        elif name.endswith("dt_bias"):
            rnd(p, 1.0)
        elif name.endswith("e_score_correction_bias"):
            rnd(p, 0.2)
        elif "norm" in name:
            rnd(p, 0.3, 1.0)
        elif name.endswith("res_proj.weight"):
            rnd(p, 0.2)
        elif "conv1d" in name:
            rnd(p, 0.5)
        elif "embed_tokens" in name:
            rnd(p, 1.0)
        elif p.dim() >= 2:
            rnd(p, 0.5 * p.shape[-1] ** -0.5)
        else:
            rnd(p, 0.5)
    return module


_MODELS = {}


def tiny_model(name, **over):
    key = (name, tuple(sorted(over.items())))
    if key not in _MODELS:
        cfg = preset_config(name, **over)
        torch.manual_seed(0)
        _MODELS[key] = randomize(KimiHybridForCausalLM(cfg).eval(), seed=1)
    return _MODELS[key]


def ids_for(cfg, B, T, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, cfg.vocab_size, (B, T), generator=gen)


def assert_close(a, b, atol=1e-5, what=""):
    diff = (a.float() - b.float()).abs().max().item()
    assert diff <= atol, f"{what}: max abs diff {diff:.3e} > {atol:.0e}"


def assert_rel(got, want, rtol=1e-5, what=""):
    """max |got - want| <= rtol * max |want| (for module outputs at several input scales)."""
    scale = want.float().abs().max().item()
    assert scale > 0, what
    assert_close(got, want, rtol * scale, what)


# ================================================================================================================
# 1. gated MLA
# ================================================================================================================

@pytest.mark.parametrize("scale", [1.0, 1e-3])
@pytest.mark.parametrize("q_lora", [True, False])
def test_gated_mla_matches_spec(scale, q_lora):
    over = {} if q_lora else {"q_lora_rank": None}
    cfg = preset_config("tiny-k3", **over)
    layer = cfg.layer_types.index(FULL)
    attn = randomize(mk.KimiMLAttention(cfg, layer).eval(), seed=3)
    sd = {k: v.detach() for k, v in attn.state_dict().items()}
    assert ("q_a_proj.weight" in sd) == q_lora and ("q_proj.weight" in sd) != q_lora
    assert sd["g_proj.weight"].shape == (cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size)
    # tiny inputs make the 1e-6 (not rms_norm_eps) of q_a / kv_a layernorm visible
    x = torch.randn(2, 7, cfg.hidden_size, generator=torch.Generator().manual_seed(5)) * scale
    with torch.no_grad():
        got = attn(x)
    assert_rel(got, ref_mla(cfg, sd, "", x), 1e-5, "MLA")


def test_mla_gate_is_per_channel_before_o_proj():
    """A gate that is ~0 on exactly one channel (head, v-dim) and 0.5 elsewhere must equal removing that column of
    o_proj with the other channels halved: one gate per channel, applied before o_proj."""
    cfg = preset_config("tiny-k3")
    attn = randomize(mk.KimiMLAttention(cfg, cfg.layer_types.index(FULL)).eval(), seed=4)
    x = torch.randn(1, 5, cfg.hidden_size)
    x[..., 0] = 1.0
    ch = 5
    with torch.no_grad():
        attn.g_proj.weight.zero_()
        half = attn(x)  # gate 0.5 on every channel
        attn.g_proj.weight[ch, 0] = -100.0  # gate sigmoid(-100) on channel ch only
        gated = attn(x)
        attn.g_proj.weight.zero_()
        attn.o_proj.weight[:, ch] = 0
        expect = attn(x)
    assert not torch.allclose(half, gated)
    assert_close(gated, expect, 1e-6, "per-channel gate")


# ================================================================================================================
# 2. KDA: decay gate (lower bound / softplus), full-rank output gate
# ================================================================================================================

def test_kda_gate_forms():
    gen = torch.Generator().manual_seed(0)
    H, K = 4, 16
    g_raw = torch.randn(3, 5, H, K, generator=gen) * 3
    A_log, dt = torch.randn(H, generator=gen), torch.randn(H * K, generator=gen)
    from kimi_hybrid.kda_kimi_hybrid import kda_gate
    lb_cfg = preset_config("tiny-k3")
    sp_cfg = preset_config("tiny-k3-softplus")
    assert lb_cfg.gate_lower_bound == -5.0 and sp_cfg.gate_lower_bound is None
    lb = kda_gate(g_raw, A_log, dt, -5.0)
    # the spec's formula, element by element, written out once more for one entry
    b, t, h, c = 1, 2, 3, 7
    one = -5.0 / (1 + math.exp(-math.exp(A_log[h].item()) * (g_raw[b, t, h, c].item() + dt[h * K + c].item())))
    assert abs(lb[b, t, h, c].item() - one) < 1e-5
    assert_close(lb, ref_decay(lb_cfg, g_raw, A_log, dt), 1e-6, "lower-bounded gate")
    assert lb.dtype == torch.float32 and bool((lb < 0).all()) and bool((lb >= -5).all())  # (-5, 0) up to fp32 rounding
    sp = kda_gate(g_raw, A_log, dt, None)
    assert_close(sp, ref_decay(sp_cfg, g_raw, A_log, dt), 1e-6, "softplus gate")
    # bf16 inputs: the gate is still computed in fp32
    assert_close(kda_gate(g_raw.bfloat16(), A_log, dt, -5.0), ref_decay(lb_cfg, g_raw.bfloat16(), A_log, dt),
                 1e-6, "bf16 input")


@pytest.mark.parametrize("T", [11, 70])  # 70 > the chunk size 64 of the chunked kernel
@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-k3-softplus"])
def test_kda_layer_matches_spec(preset, T):
    cfg = preset_config(preset)
    layer = cfg.layer_types.index(LINEAR)
    attn = randomize(mk.KimiDeltaAttention(cfg, layer).eval(), seed=6)
    sd = {k: v.detach() for k, v in attn.state_dict().items()}
    # full-rank output gate replaces the low-rank one
    assert "g_proj.weight" in sd and "g_a_proj.weight" not in sd and "g_b_proj.weight" not in sd
    assert sd["g_proj.weight"].shape == (cfg.linear_num_heads * cfg.linear_head_dim, cfg.hidden_size)
    x = torch.randn(2, T, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = attn(x)
    assert_close(got, ref_kda(cfg, sd, "", x), 1e-5, f"KDA {preset}")


def test_kda_low_rank_gate_still_matches_spec():
    """use_full_rank_gate False (Kimi-Linear's g_a/g_b) with the K3 lower-bounded decay."""
    cfg = preset_config("tiny-k3", linear_attn_config={
        "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0})
    attn = randomize(mk.KimiDeltaAttention(cfg, 0).eval(), seed=8)
    sd = {k: v.detach() for k, v in attn.state_dict().items()}
    assert "g_a_proj.weight" in sd and "g_proj.weight" not in sd
    x = torch.randn(1, 6, cfg.hidden_size)
    with torch.no_grad():
        assert_close(attn(x), ref_kda(cfg, sd, "", x), 1e-5, "KDA low-rank gate")


# ================================================================================================================
# 3. latent MoE
# ================================================================================================================

@pytest.mark.parametrize("scale", [1.0, 0.02])
@pytest.mark.parametrize("use_norm", [True, False])
def test_latent_moe_matches_spec(use_norm, scale):
    cfg = preset_config("tiny-k3", latent_moe_use_norm=use_norm)
    moe = randomize(mkm.KimiMoE(cfg).eval(), seed=9)
    sd = {k: v.detach() for k, v in moe.state_dict().items()}
    L, D = cfg.routed_expert_hidden_size, cfg.hidden_size
    assert sd["routed_expert_down_proj.weight"].shape == (L, D)
    assert sd["routed_expert_up_proj.weight"].shape == (D, L)
    assert ("routed_expert_norm.weight" in sd) == use_norm
    assert sd["experts.gate_up_proj"].shape == (cfg.num_experts, 2 * cfg.moe_intermediate_size, L)
    assert sd["experts.down_proj"].shape == (cfg.num_experts, L, cfg.moe_intermediate_size)
    assert sd["shared_experts.up_proj.weight"].shape == (cfg.moe_intermediate_size * cfg.num_shared_experts, D)
    if use_norm:
        assert moe.routed_expert_norm.variance_epsilon == cfg.rms_norm_eps
    # small inputs make the latent norm's eps (rms_norm_eps) matter
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(10)) * scale
    with torch.no_grad():
        assert_rel(moe(x), ref_latent_moe(cfg, sd, "", x), 1e-5, "latent MoE")


def test_router_bias_chooses_but_does_not_weigh():
    cfg = preset_config("tiny-k3")
    router = randomize(mkm.KimiRouter(cfg), seed=11)
    x = torch.randn(16, cfg.hidden_size)
    with torch.no_grad():
        router.e_score_correction_bias.zero_()
        router.e_score_correction_bias[3] = 10.0  # expert 3 always chosen
        _, w, idx = router(x)
    assert bool((idx == 3).any(-1).all())
    rw, ridx = ref_route(cfg, x, router.weight.detach(), router.e_score_correction_bias)
    assert torch.equal(idx.sort(-1).values, ridx.sort(-1).values)
    s = torch.sigmoid(x @ router.weight.detach().T)
    raw = s.gather(1, idx)
    assert_close(w, raw / raw.sum(-1, keepdim=True) * cfg.routed_scaling_factor, 1e-6, "unbiased weights")
    assert w.dtype == torch.float32


# ================================================================================================================
# 4. SiTU
# ================================================================================================================

def test_situ_matches_spec():
    cfg = preset_config("tiny-k3")
    assert (cfg.hidden_act, cfg.activation_situ_beta, cfg.activation_situ_linear_beta) == ("situ", 4.0, 25.0)
    g = torch.linspace(-60, 60, 241).view(-1, 1).expand(241, 9)
    u = torch.linspace(-200, 200, 9).view(1, -1).expand(241, 9)
    got = mkm.glu_act(cfg, g, u)
    assert_close(got, ref_situ(g, u, 4.0, 25.0), 1e-4, "SiTU")  # values up to ~100
    assert got.abs().max() < 100
    # one value by hand: g = 2, u = 3
    hand = 4 * math.tanh(0.5) / (1 + math.exp(-2)) * 25 * math.tanh(3 / 25)
    assert abs(mkm.glu_act(cfg, torch.tensor([2.0]), torch.tensor([3.0])).item() - hand) < 1e-5
    # bf16 in: computed in fp32, rounded once at the end
    gb, ub = (torch.randn(64, 32) * 5).bfloat16(), (torch.randn(64, 32) * 30).bfloat16()
    out = mkm.glu_act(cfg, gb, ub)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ref_situ(gb, ub, 4.0, 25.0).bfloat16())
    # null betas: beta 1, un-capped up half
    cfg_none = preset_config("tiny-k3", activation_situ_beta=None, activation_situ_linear_beta=None)
    assert_close(mkm.glu_act(cfg_none, g, u), ref_situ(g, u, None, None), 1e-3, "SiTU null betas")


def test_situ_used_in_every_mlp_kind():
    """Dense layer-0 MLP and the shared experts use SiTU (the routed experts are covered by the latent MoE test)."""
    cfg = preset_config("tiny-k3")
    mlp = randomize(mkm.KimiMLP(cfg), seed=12)
    sd = {k: v.detach() for k, v in mlp.state_dict().items()}
    x = torch.randn(4, cfg.hidden_size) * 3
    with torch.no_grad():
        assert_close(mlp(x), ref_glu_mlp(cfg, sd, "", x), 1e-5, "dense SiTU MLP")


# ================================================================================================================
# 5. AttnRes
# ================================================================================================================

def test_attn_res_mix_matches_spec():
    gen = torch.Generator().manual_seed(13)
    D = 64
    bank = [torch.randn(2, 3, D, generator=gen) * s for s in (1.0, 5.0, 0.2)]
    prefix = torch.randn(2, 3, D, generator=gen) * 2
    proj, norm = torch.randn(1, D, generator=gen) * 0.4, 1 + 0.3 * torch.randn(D, generator=gen)
    got = mk.attn_res_mix(prefix, bank, proj, norm, 1e-5)
    assert_close(got, ref_attn_res(prefix, bank, proj, norm, 1e-5), 1e-5, "AttnRes mix")
    # one token by hand: weights = softmax over depth of <V_j / rms(V_j), norm * proj>
    Vs = [b[1, 2] for b in bank] + [prefix[1, 2]]
    z = torch.tensor([float((v / torch.sqrt(v.pow(2).mean() + 1e-5) * norm * proj[0]).sum()) for v in Vs])
    a = torch.softmax(z, 0)
    assert_close(got[1, 2], sum(ai * v for ai, v in zip(a, Vs)), 1e-5, "one token")
    # a single candidate is the prefix itself; bf16 prefix -> bf16 output
    assert_close(mk.attn_res_mix(prefix, [], proj, norm, 1e-5), prefix, 1e-6, "single candidate")
    assert mk.attn_res_mix(prefix.bfloat16(), [b.bfloat16() for b in bank], proj, norm, 1e-5).dtype == torch.bfloat16


def _candidate_counts(model, ids, monkeypatch):
    seen = []
    real = mk.attn_res_mix

    def spy(prefix, bank, *a, **k):
        seen.append(len(bank) + 1)
        return real(prefix, bank, *a, **k)

    monkeypatch.setattr(mk, "attn_res_mix", spy)
    with torch.no_grad():
        model(ids)
    monkeypatch.setattr(mk, "attn_res_mix", real)
    return seen


@pytest.mark.parametrize("preset", TINY_K3)
def test_attn_res_snapshot_rule(preset, monkeypatch):
    """Candidate counts: pre-attention ceil(l/bs) + 1 (mix skipped at l = 0), pre-MLP floor(l/bs) + 2, exit
    ceil(L/bs) + 1, as the reference's trace says."""
    model = tiny_model(preset)
    cfg = model.config
    seen = _candidate_counts(model, ids_for(cfg, 1, 3), monkeypatch)
    trace = []
    ref_forward(cfg, model.state_dict(), ids_for(cfg, 1, 3), trace)
    expect = [n for kind, l, n in trace if not (kind == "attn" and l == 0)]
    assert seen == expect
    bs, L = cfg.attn_res_block_size, cfg.num_hidden_layers
    assert expect == [c for l in range(L) for c in ([-(-l // bs) + 1] if l else []) + [l // bs + 2]] + [
        -(-L // bs) + 1]


def test_attn_res_k3_plan_has_nine_exit_candidates(monkeypatch):
    """The full K3 layer plan (93 layers, bs 12) at toy width: 8 snapshots (layers 0, 12, ..., 84) and 9 candidates
    at the exit."""
    full = KimiHybridConfig.from_preset("kimi-k3")
    cfg = preset_config(
        "tiny-k3", num_hidden_layers=93, layer_types=full.layer_types, attn_res_block_size=12,
        mlp_layer_types=full.mlp_layer_types, hidden_size=16, intermediate_size=16, num_attention_heads=2,
        num_key_value_heads=2, num_experts=4, moe_intermediate_size=8, routed_expert_hidden_size=8, q_lora_rank=8,
        kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        linear_attn_config={"head_dim": 4, "num_heads": 2, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                            "use_full_rank_gate": True})
    model = KimiHybridForCausalLM(cfg).eval()
    seen = _candidate_counts(model, torch.tensor([[5, 6]]), monkeypatch)
    assert seen[-1] == 9 and len(seen) == 2 * 93 - 1 + 1
    assert [l for l in range(93) if l % 12 == 0] == [0, 12, 24, 36, 48, 60, 72, 84]


# ================================================================================================================
# whole model
# ================================================================================================================

@pytest.mark.parametrize("preset", TINY_K3)
def test_whole_model_matches_reference(preset):
    model = tiny_model(preset)
    cfg = model.config
    ids = ids_for(cfg, 2, 13, seed=2)
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
    want = ref_forward(cfg, {k: v.detach() for k, v in model.state_dict().items()}, ids)
    assert got.abs().max() > 0.1  # not a degenerate comparison
    assert_close(got, want, 1e-5, f"logits {preset}")


def test_output_hidden_states_are_prefix_sums():
    """Each recorded state is the partial block sum entering the layer (docs/k3.md section 2), the last one the normed exit."""
    model = tiny_model("tiny-k3")
    ids = ids_for(model.config, 1, 4)
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, use_cache=False)
    hs = out.hidden_states
    assert len(hs) == model.config.num_hidden_layers + 1
    assert torch.equal(hs[0], model.model.embed_tokens(ids))
    states = []
    ref_forward(model.config, model.state_dict(), ids, states=states)
    for i, (a, b) in enumerate(zip(hs, states)):
        assert_close(a, b, 1e-5, f"hidden state {i}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_keeps_attn_res_gradients(reentrant):
    """Training with gradient checkpointing (either checkpoint flavour) gives the same loss and gradients: the
    AttnRes bank reaches every later layer, so it must be a checkpoint input."""
    import copy
    model = copy.deepcopy(tiny_model("tiny-k3-block4")).train()
    ids = ids_for(model.config, 2, 8)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    want = {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}
    # no gradient: the correction bias (a buffer-like parameter) and layer 0's attention-side AttnRes pair (the mix
    # is skipped there, docs/k3.md section 2)
    assert sorted(n for n, g in want.items() if g is None) == sorted(
        [n for n in want if n.endswith("e_score_correction_bias")]
        + ["model.layers.0.self_attention_res_norm.weight", "model.layers.0.self_attention_res_proj.weight"])
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    loss2 = model(ids, labels=ids, use_cache=False).loss
    loss2.backward()
    assert loss2.item() == loss.item()
    for n, p in model.named_parameters():
        assert (p.grad is None) == (want[n] is None), n
        if p.grad is not None:
            assert_close(p.grad, want[n], 1e-5, n)


# ================================================================================================================
# dtype rules
# ================================================================================================================

FP32_KEYS = ("A_log", "dt_bias", "e_score_correction_bias", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
             "o_norm.weight")


def _check_k3_dtypes(model):
    seen = set()
    for name, p in model.state_dict().items():
        keep = name.endswith(FP32_KEYS)
        if keep:
            seen.add(next(k for k in FP32_KEYS if name.endswith(k)))
        assert p.dtype == (torch.float32 if keep else torch.bfloat16), f"{name}: {p.dtype}"
    assert seen == set(FP32_KEYS)


@pytest.mark.parametrize("saved_dtype", [torch.float32, torch.bfloat16])
def test_bf16_round_trip_keeps_fp32_tensors(tmp_path, saved_dtype):
    model = tiny_model("tiny-k3")
    src = model if saved_dtype == torch.float32 else _to_bf16_keeping(model)
    src.save_pretrained(tmp_path)
    loaded = KimiHybridForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    _check_k3_dtypes(loaded)
    ref_sd = src.state_dict()
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, ref_sd[k].to(v.dtype)), k
    # fp32-kept tensors survive bit-exactly from an fp32 save
    if saved_dtype == torch.float32:
        for k, v in loaded.state_dict().items():
            if k.endswith(FP32_KEYS):
                assert torch.equal(v, model.state_dict()[k])
    ids = ids_for(model.config, 2, 9)
    with torch.no_grad():
        lb = loaded(ids).logits
        l32 = model(ids).logits
    assert lb.dtype == torch.bfloat16 and torch.isfinite(lb.float()).all()
    _mostly_close(lb, l32)


def _mostly_close(a, b, frac=0.8):
    """bf16 vs fp32 logits: most positions agree within 10% of the logit scale; a few may differ more where bf16
    rounding flips an expert choice (a discrete top-k), which is expected."""
    per_pos = (a.float() - b.float()).abs().amax(-1)
    ok = per_pos < 0.1 * b.float().abs().max()
    assert ok.float().mean() >= frac, per_pos


def test_base_model_bf16_load_keeps_fp32_tensors(tmp_path):
    """AutoModel (the decoder without lm_head) follows the same K3 rule."""
    from transformers import AutoModel
    tiny_model("tiny-k3").save_pretrained(tmp_path)
    base = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert type(base).__name__ == "KimiHybridModel"
    for name, p in base.state_dict().items():
        assert p.dtype == (torch.float32 if name.endswith(FP32_KEYS) else torch.bfloat16), name


def _to_bf16_keeping(model):
    """A bf16 copy of the tiny model that keeps the K3 fp32 set in fp32 (what the released shards hold)."""
    new = KimiHybridForCausalLM(model.config).eval()
    new.load_state_dict(model.state_dict())
    new.to(torch.bfloat16)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name.endswith(FP32_KEYS):
                p.data = model.state_dict()[name].clone()
    return new


def test_bf16_decode_matches_bf16_forward():
    """bf16 with fp32 conv / o_norm / gate params: prefill + decode agrees with one forward (kernel numerics)."""
    model = _to_bf16_keeping(tiny_model("tiny-k3"))
    ids = ids_for(model.config, 1, 10)
    with torch.no_grad():
        full = model(ids).logits.float()
        out = model(ids[:, :6], use_cache=True)
        steps = [out.logits.float()]
        cache = out.past_key_values
        for t in range(6, 10):
            o = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
            cache = o.past_key_values
            steps.append(o.logits.float())
    _mostly_close(torch.cat(steps, 1), full)


# ================================================================================================================
# 6. presets
# ================================================================================================================

def test_k3_preset_values():
    c = KimiHybridConfig.from_preset("kimi-k3")
    expect = {
        "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840, "intermediate_size": 33792,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "gate_lower_bound": -5.0, "use_full_rank_gate": True, "linear_head_dim": 128, "linear_num_heads": 96,
        "linear_conv_kernel_size": 4, "num_mla_layers": 24, "num_kda_layers": 69,
    }
    for k, v in expect.items():
        assert getattr(c, k) == v, f"{k}: {getattr(c, k)!r} != {v!r}"
    assert c.dtype == torch.bfloat16
    mla0 = [i for i, t in enumerate(c.layer_types) if t == FULL]
    assert mla0 == list(range(3, 92, 4)) + [92]
    assert c.linear_attn_config["full_attn_layers"] == list(range(4, 93, 4)) + [93]
    assert c.layer_types[0] == LINEAR and c.layer_types[91] == c.layer_types[92] == FULL
    assert c.mlp_layer_types == ["dense"] + ["sparse"] * 92
    # the released text_config reads back to the same plan
    again = KimiHybridConfig.from_released_dict({"model_type": "kimi_k3", "text_config": released_config_dict(c)})
    assert again.layer_types == c.layer_types and again.attn_res_block_size == 12


def test_k3_preset_shapes_and_parameter_count():
    """Built on the meta device (nothing allocated): the docs/k3.md section 7 shapes, and the logical parameter total
    2,779,484,478,208 minus the 32 zero-padding A_log entries the checkpoint stores per KDA layer (69 x 32)."""
    cfg = KimiHybridConfig.from_preset("kimi-k3")
    with torch.device("meta"):
        model = KimiHybridForCausalLM(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert sum(p.numel() for p in model.parameters()) == 2_779_484_478_208 - 69 * 32
    kda, mla = "model.layers.0.self_attn.", "model.layers.3.self_attn."
    expect = {
        "model.embed_tokens.weight": (163840, 7168), "lm_head.weight": (163840, 7168), "model.norm.weight": (7168,),
        "model.output_attn_res_norm.weight": (7168,), "model.output_attn_res_proj.weight": (1, 7168),
        "model.layers.0.self_attention_res_norm.weight": (7168,),
        "model.layers.0.self_attention_res_proj.weight": (1, 7168),
        "model.layers.92.mlp_res_norm.weight": (7168,), "model.layers.92.mlp_res_proj.weight": (1, 7168),
        kda + "q_proj.weight": (12288, 7168), kda + "k_proj.weight": (12288, 7168), kda + "v_proj.weight": (12288, 7168),
        kda + "q_conv1d.weight": (12288, 1, 4), kda + "k_conv1d.weight": (12288, 1, 4),
        kda + "v_conv1d.weight": (12288, 1, 4), kda + "f_a_proj.weight": (128, 7168),
        kda + "f_b_proj.weight": (12288, 128), kda + "A_log": (96,), kda + "dt_bias": (12288,),
        kda + "b_proj.weight": (96, 7168), kda + "g_proj.weight": (12288, 7168), kda + "o_norm.weight": (128,),
        kda + "o_proj.weight": (7168, 12288),
        mla + "q_a_proj.weight": (1536, 7168), mla + "q_a_layernorm.weight": (1536,),
        mla + "q_b_proj.weight": (18432, 1536), mla + "kv_a_proj_with_mqa.weight": (576, 7168),
        mla + "kv_a_layernorm.weight": (512,), mla + "kv_b_proj.weight": (24576, 512),
        mla + "o_proj.weight": (7168, 12288), mla + "g_proj.weight": (12288, 7168),
        "model.layers.0.mlp.gate_proj.weight": (33792, 7168), "model.layers.0.mlp.down_proj.weight": (7168, 33792),
        "model.layers.1.mlp.gate.weight": (896, 7168), "model.layers.1.mlp.gate.e_score_correction_bias": (896,),
        "model.layers.1.mlp.routed_expert_down_proj.weight": (3584, 7168),
        "model.layers.1.mlp.routed_expert_norm.weight": (3584,),
        "model.layers.1.mlp.routed_expert_up_proj.weight": (7168, 3584),
        "model.layers.1.mlp.shared_experts.gate_proj.weight": (6144, 7168),
        "model.layers.1.mlp.shared_experts.down_proj.weight": (7168, 6144),
        "model.layers.1.mlp.experts.gate_up_proj": (896, 6144, 3584),  # w1 | w3 of [3072, 3584] each
        "model.layers.1.mlp.experts.down_proj": (896, 3584, 3072),
    }
    for k, v in expect.items():
        assert shapes.get(k) == v, f"{k}: {shapes.get(k)} != {v}"
    assert not any(k.startswith(kda + "g_a_proj") or k.startswith(mla + "q_proj") for k in shapes)


def _released_k3_config():
    """A K3 top-level config.json as described by docs/k3.md section 1 (text_config values of the table)."""
    full = list(range(4, 93, 4)) + [93]
    text = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig"},
        "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840, "intermediate_size": 33792,
        "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "mla_use_output_gate": True, "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
        "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
        "routed_scaling_factor": 1.0, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc", "use_grouped_topk": True, "num_expert_group": 1, "topk_group": 1,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "situ", "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0, "attn_res_block_size": 12, "max_position_embeddings": 1048576,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_nextn_predict_layers": 0, "dtype": "bfloat16",
        "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
        "linear_attn_config": {"head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True, "full_attn_layers": full,
                               "kda_layers": [i for i in range(1, 94) if i not in full]},
    }
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text,
            "vision_config": {"depth": 27}, "bos_token_id": 163584, "eos_token_id": 163586, "pad_token_id": 163839,
            "media_placeholder_token_id": 163605,
            "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}}


def test_released_k3_config_reads_as_the_preset(tmp_path):
    import json
    preset = KimiHybridConfig.from_preset("kimi-k3").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(_released_k3_config()))
    for got in (KimiHybridConfig.from_released_dict(_released_k3_config()),
                KimiHybridConfig.from_pretrained(tmp_path)):
        d = got.to_dict()
        diff = {k: (d.get(k), v) for k, v in preset.items()
                if k not in ("architectures", "transformers_version", "_name_or_path") and d.get(k) != v}
        assert not diff, diff
        assert str(got.dtype).replace("torch.", "") == "bfloat16"  # a str here; transformers reads either form


def test_tiny_k3_presets():
    a, b, c = (preset_config(n) for n in TINY_K3)
    assert a.gate_lower_bound == -5.0 and b.gate_lower_bound is None
    assert b.layer_types[0] == FULL and a.layer_types[0] == LINEAR
    assert c.num_hidden_layers % c.attn_res_block_size != 0 and c.latent_moe_use_norm is False
    for cfg in (a, b, c):
        assert cfg.use_full_rank_gate and cfg.mla_use_output_gate and cfg.hidden_act == "situ"
        assert cfg.routed_expert_hidden_size and cfg.q_lora_rank and cfg.attn_res_block_size > 0


# ================================================================================================================
# cache / generation on tiny K3 configs
# ================================================================================================================

@pytest.mark.parametrize("preset", TINY_K3)
def test_prefill_plus_decode_equals_forward(preset):
    model = tiny_model(preset)
    ids = ids_for(model.config, 2, 12, seed=4)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for split, kind in ((1, KimiHybridCache), (5, KimiHybridCache), (9, KimiHybridCache), (5, None)):
            # a KimiHybridCache, and (kind None) the default cache: transformers' own DynamicCache, used as it is
            out = model(ids[:, :split], past_key_values=kind(model.config) if kind else None, use_cache=True)
            cache, steps = out.past_key_values, [out.logits]
            assert isinstance(cache, KimiHybridCache) if kind else type(cache) is DynamicCache
            for t in range(split, 12):
                o = model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                cache = o.past_key_values
                steps.append(o.logits)
            assert_close(torch.cat(steps, 1), full, 2e-5, f"{preset} split {split}")
        # chunked continuation (several tokens per call)
        out = model(ids[:, :4], use_cache=True)
        o = model(ids[:, 4:10], past_key_values=out.past_key_values, use_cache=True)
        o2 = model(ids[:, 10:], past_key_values=o.past_key_values, use_cache=True)
        assert_close(torch.cat([out.logits, o.logits, o2.logits], 1), full, 2e-5, f"{preset} chunks")


def test_decode_runs_mla_in_latent_space(monkeypatch):
    """One-token decode steps of the gated, low-rank-q MLA take the absorbed (latent-space) path."""
    model = tiny_model("tiny-k3")
    calls = []
    real = mk.KimiMLAttention._attend_latent

    def spy(self, *a):
        calls.append(self.layer_idx)
        return real(self, *a)

    monkeypatch.setattr(mk.KimiMLAttention, "_attend_latent", spy)
    ids = ids_for(model.config, 1, 6)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        assert calls == []
        step = model(ids[:, 5:], past_key_values=out.past_key_values, use_cache=True)
    assert calls == [i for i, t in enumerate(model.config.layer_types) if t == FULL]
    assert_close(step.logits[:, 0], full[:, 5], 2e-5, "latent decode")


@pytest.mark.parametrize("preset", ["tiny-k3", "tiny-k3-block4"])
def test_packed_documents_equal_each_alone(preset):
    """Packing (position_ids restarting at 0, and cu_seqlens) keeps documents apart; AttnRes mixes over depth only."""
    model = tiny_model(preset)
    docs = [ids_for(model.config, 1, n, seed=20 + n)[0] for n in (5, 7, 3)]
    packed = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    cu = torch.tensor([0, 5, 12, 15])
    with torch.no_grad():
        alone = torch.cat([model(d[None], use_cache=False).logits for d in docs], 1)
        by_pos = model(packed, position_ids=pos, use_cache=False).logits
        by_cu = model(packed, cu_seqlens=cu, use_cache=False).logits
    assert_close(by_pos, alone, 2e-5, "position_ids packing")
    assert_close(by_cu, alone, 2e-5, "cu_seqlens packing")


def test_static_cache_generate_equals_dynamic():
    model = tiny_model("tiny-k3")
    ids = ids_for(model.config, 2, 5, seed=6)
    kw = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        dyn = model.generate(ids, **kw)
        sta = model.generate(ids, cache_implementation="static", **kw)
    assert torch.equal(dyn, sta)


def test_prompt_lookup_generate_equals_greedy():
    model = tiny_model("tiny-k3")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    kw = dict(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=model.config.pad_token_id)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=3, **kw), model.generate(ids, **kw))


@pytest.mark.parametrize("preset", TINY_K3)
def test_left_padded_batch_equals_rows_alone(preset):
    model = tiny_model(preset)
    cfg = model.config
    rows = [ids_for(cfg, 1, n, seed=10 + n)[0] for n in (9, 5, 7)]
    T = max(len(r) for r in rows)
    ids = torch.full((3, T), cfg.pad_token_id)
    mask = torch.zeros(3, T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        mask[i, T - len(r):] = 1
    with torch.no_grad():
        batch = model(ids, attention_mask=mask, use_cache=False).logits
        gen_b = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                               pad_token_id=cfg.pad_token_id, eos_token_id=None)
        for i, r in enumerate(rows):
            alone = model(r[None], use_cache=False).logits
            assert_close(batch[i, T - len(r):], alone[0], 2e-5, f"{preset} row {i}")
            gen_a = model.generate(r[None], max_new_tokens=4, do_sample=False, pad_token_id=cfg.pad_token_id,
                                   eos_token_id=None)
            assert torch.equal(gen_b[i, T:], gen_a[0, len(r):]), f"{preset} row {i} generation"


@pytest.mark.parametrize("preset", TINY_K3)
def test_greedy_generate_equals_recompute(preset):
    model = tiny_model(preset)
    ids = ids_for(model.config, 2, 6, seed=5)
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None,
                             pad_token_id=model.config.pad_token_id)
        seq = ids
        for _ in range(8):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
        # and the reference implementation agrees on every greedy step
        ref_next = ref_forward(model.config, model.state_dict(), gen[:, :-1])[:, ids.shape[1] - 1:].argmax(-1)
    assert torch.equal(gen, seq)
    assert torch.equal(ref_next, gen[:, ids.shape[1]:])


@pytest.mark.parametrize("preset", TINY_K3)
def test_save_load_round_trip(tmp_path, preset):
    model = tiny_model(preset)
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded).__name__ == "KimiHybridForCausalLM"
    skip = {"transformers_version": None, "_name_or_path": None}
    assert loaded.config.to_dict() | skip == model.config.to_dict() | skip
    sd = model.state_dict()
    assert set(loaded.state_dict()) == set(sd)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, sd[k]), k
    ids = ids_for(model.config, 1, 7)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_cache_save_load_continues_decode(tmp_path):
    model = tiny_model("tiny-k3")
    ids = ids_for(model.config, 2, 10, seed=8)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :7], past_key_values=KimiHybridCache(model.config), use_cache=True)
        out.past_key_values.save(str(tmp_path / "c.safetensors"))
        cache = KimiHybridCache.load(str(tmp_path / "c.safetensors"), model.config)
        o = model(ids[:, 7:], past_key_values=cache, use_cache=True)
    assert_close(o.logits, full[:, 7:], 2e-5, "cache save/load")


# ================================================================================================================
# memory of the full K3 preset at 128,000 tokens (meta tensors: nothing is allocated)
# ================================================================================================================

def _meta_cache(cfg, T, state_dtype, conv_dtype=torch.bfloat16, latent_dtype=torch.bfloat16):
    """A KimiHybridCache of ``cfg`` filled, on the meta device, with tensors of the shapes the model writes."""
    cache = KimiHybridCache(cfg)
    H, K, W = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_size
    for layer, t in zip(cache.layers, cfg.layer_types):
        if t == LINEAR:
            kda_store(layer, torch.empty(1, 3 * H * K, W, dtype=conv_dtype, device="meta"),
                      torch.empty(1, H, K, K, dtype=state_dtype, device="meta"))
        else:
            layer.latent = torch.empty(1, T, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=latent_dtype,
                                       device="meta")
    cache.key_mask = torch.empty(1, T, dtype=torch.bool, device="meta")
    cache.seen_tokens = T
    return cache


def test_k3_cache_memory_at_128k():
    cfg = KimiHybridConfig.from_preset("kimi-k3")
    T = 128_000
    # the shapes the model writes: check them on a tiny K3 model's real cache
    tiny = tiny_model("tiny-k3")
    with torch.no_grad():
        real = tiny(ids_for(tiny.config, 1, 5), past_key_values=KimiHybridCache(tiny.config), use_cache=True).past_key_values
    ref = _meta_cache(tiny.config, 5, torch.float32, torch.float32, torch.float32)
    for a, b in zip(real.layers, ref.layers):
        assert {k: (tuple(v.shape), v.dtype) for k, v in layer_tensors(a).items()} == {
            k: (tuple(v.shape), v.dtype) for k, v in layer_tensors(b).items()}

    fp32 = _meta_cache(cfg, T, torch.float32).memory_report()
    bf16 = _meta_cache(cfg, T, torch.bfloat16).memory_report()
    mla = 24 * 128000 * 576 * 2
    assert fp32["mla_bytes"] == bf16["mla_bytes"] == mla == 3_538_944_000
    assert fp32["kda_state_bytes"] == 69 * 96 * 128 * 128 * 4 == 434_110_464
    assert bf16["kda_state_bytes"] == 69 * 96 * 128 * 128 * 2 == 217_055_232
    conv = 69 * 3 * 12288 * 4 * 2
    assert fp32["kda_conv_bytes"] == bf16["kda_conv_bytes"] == conv == 20_348_928
    assert fp32["kda_bytes"] == fp32["kda_state_bytes"] + conv
    assert fp32["mask_bytes"] == T and fp32["rollback_bytes"] == 0
    assert fp32["total_bytes"] == mla + 434_110_464 + conv + T == 3_993_531_392
    assert round((mla + bf16["kda_state_bytes"]) / 1e9, 2) == 3.76
    assert round((mla + fp32["kda_state_bytes"]) / 1e9, 2) == 3.97
    all_mla = KimiHybridConfig.from_preset("kimi-k3", layer_types=[FULL] * 93)
    rep = _meta_cache(all_mla, T, torch.float32).memory_report()
    assert rep["mla_bytes"] == 93 * 128000 * 576 * 2 == 13_713_408_000 and rep["kda_bytes"] == 0
    assert round(rep["mla_bytes"] / 1e9, 2) == 13.71
    # the note in docs states these numbers
    note = (ROOT / "docs" / "k3-memory.md").read_text()
    for s in ("3,538,944,000", "434,110,464", "217,055,232", "20,348,928", "13,713,408,000", "3,755,999,232",
              "3,973,054,464", "3,993,531,392"):
        assert s in note, s


# ================================================================================================================
# K3 chat format through generate
# ================================================================================================================

def test_k3_chat_round_trip_through_generate():
    from kimi_hybrid.tokenization_kimi_hybrid import KimiHybridTokenizer
    tok = KimiHybridTokenizer(str(ROOT / "models" / "kimi-hybrid-stdlib" / "tiktoken.model"), chat_format="kimi-k3")
    eom = tok.convert_tokens_to_ids("<|end_of_msg|>")
    model = tiny_model("tiny-k3", vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=eom,
                       pad_token_id=tok.pad_token_id)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def add(a, b):"}]
    text = tok.apply_chat_template(chat, thinking=False)
    assert text.endswith('<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    enc = tok(text, return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"]
    assert tok.decode(ids[0]) == text
    for marker in ("<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"):
        assert tok.convert_tokens_to_ids(marker) in ids[0].tolist()
    with torch.no_grad():
        gen = model.generate(**enc, max_new_tokens=6, do_sample=False)
        seq = ids
        for _ in range(gen.shape[1] - ids.shape[1]):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen, seq)
    reply = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)
    assert tok.decode(gen[0]).startswith(text)
    # the reply goes back into the chat and renders / tokenizes again
    chat2 = chat + [{"role": "assistant", "content": reply}]
    text2 = tok.apply_chat_template(chat2, add_generation_prompt=False, thinking=False)
    assert text2.startswith(text) or text2.startswith(text[: text.rindex('<|open|>message role="assistant"')])
    assert text2.endswith("<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>")
    assert tok.decode(tok(text2, add_special_tokens=False)["input_ids"]) == text2
