# coding=utf-8
"""KimiHybrid: Kimi-Linear-48B-A3B and the Kimi K3 text backbone for ``transformers``.

A hybrid decoder: Kimi Delta Attention (KDA, a gated delta rule with per-channel decay and a fixed-size fp32 state)
interleaved with NoPE Multi-head Latent Attention (MLA, DeepSeek-V2 style, caching only the 576-value latent per
token), and DeepSeek-V3-style MoE MLPs (fp32 sigmoid router with a selection-only correction bias, grouped top-k,
renormalised, scaled, shared experts; fused expert weights). Kimi K3 switches: lower-bounded KDA gate, full-rank
output gates, low-rank MLA query with a sigmoid output gate, latent MoE, SiTU-GLU, and block attention residuals
(AttnRes).

Papers / checkpoints: Kimi Linear (arXiv 2510.26692, moonshotai/Kimi-Linear-48B-A3B-{Base,Instruct}); Kimi K3
(arXiv 2607.24653, moonshotai/Kimi-K3); exact math in docs/kda.md, docs/mla.md, docs/moe.md and docs/k3.md.
"""

import math
from typing import Any, List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

try:
    from transformers.modeling_layers import GradientCheckpointingLayer
except ImportError:  # pragma: no cover
    GradientCheckpointingLayer = nn.Module

try:
    from transformers.integrations.accelerate import force_accelerate_hooks
except ImportError:  # pragma: no cover
    def force_accelerate_hooks(names):  # noqa: D103 - no accelerate hooks to fire
        return lambda fn: fn

try:
    from transformers import initialization as init
except ImportError:  # pragma: no cover
    init = nn.init

from .cache_kimi_hybrid import KimiHybridCache
from .cache_view_kimi_hybrid import resolve_cache
from .engine_kimi_hybrid import DecodeGraphs, generate_from_prefix, generate_with_graphs, prefill_prefix
from .compat_kimi_hybrid import GENERATION_CACHE_NAME, cache_field, output_cache, pop_cache_kwargs, resolve_cache_arg
from .compat_kimi_hybrid import compiling as _compiling, graph_capturing as _graph_capturing
from .configuration_kimi_hybrid import FULL, LINEAR, KimiHybridConfig
from .masks_kimi_hybrid import (check_attention_mask, check_input_ids, check_labels, check_position_ids,
                                cu_seqlens_from_segments, build_mla_mask, packed_segments, packing_boundaries,
                                visible_from_4d_mask)
from .conversion_kimi_hybrid import refuse_unmapped_folder
from .kda_layer_kimi_hybrid import KimiDeltaAttention, direct_weight
# (the routed experts, KimiExperts, carry transformers' @use_experts_implementation switch: see moe_kimi_hybrid.py)
from .moe_kimi_hybrid import KimiMLP, KimiMoE, KimiRouter, KimiExperts
from .norms_kimi_hybrid import KimiGatedRMSNorm, KimiRMSNorm
from .mla_kimi_hybrid import attend_decompressed as _mla_attend_decompressed
from .mla_kimi_hybrid import attend_interface as _mla_attend_interface
from .mla_kimi_hybrid import attend_latent as _mla_attend_latent
from .mla_kimi_hybrid import mla_eager_attention_forward

__all__ = [
    "KimiHybridPreTrainedModel",
    "KimiHybridModel",
    "KimiHybridForCausalLM",
    "KimiRMSNorm",
    "KimiDeltaAttention",
    "KimiMLAttention",
    "KimiMoE",
    "KimiMLP",
]


# ----------------------------------------------------------------------------------------------------------------
# MLA
# ----------------------------------------------------------------------------------------------------------------

class KimiMLAttention(nn.Module):
    """NoPE Multi-head Latent Attention (DeepSeek-V2 MLA without rotary; K3 adds a low-rank query and a sigmoid output
    gate). The cache holds only ``latent = [RMSNorm(c_kv) | k_pe]`` (``kv_lora_rank + qk_rope_head_dim`` per token).

    Prefill / training: per-head K/V are decompressed with ``kv_b_proj`` and attention runs through SDPA.
    Decode (no grad, at most ``mla_absorb_max_q_len`` new tokens, a cache): attention runs in latent space: the
    query absorbs ``W_UK`` and the output ``W_UV`` (both slices of ``kv_b_proj.weight``), so a step reads only the
    ``T x (kv_lora_rank + rope)`` latents. When ``kv_b_proj`` is not a plain ``nn.Linear`` (a PEFT LoRA wrapper, a
    quantised layer) the absorbed path is skipped and the module is called, so an adapter is always honoured.

    ``config._attn_implementation`` (transformers' attention interface) picks the attention over decompressed keys:

    * ``"sdpa"`` or None: the paths above (one-shot / blockwise SDPA, absorbed latent decode).
    * ``"eager"``: ``ALL_ATTENTION_FUNCTIONS.get_interface("eager", mla_eager_attention_forward)``, explicit fp32
      probabilities over all decompressed keys. The absorbed latent decode stays in use under ``"eager"``: it is
      the same math (the same scores, fp32 softmax, the same weighted sum of values), associated differently in
      latent space and written in plain PyTorch, whereas decompressing the whole prefix at every decoded token
      would cost ``S x H x (qk + v)`` per step for nothing.
    * any other registered name (``transformers.AttentionInterface.register(name, fn)``): that function, called
      on every MLA attention (decode included, over decompressed keys) with transformers' convention and an
      additive float mask (``mla_kimi_hybrid.attend_interface``); values are padded to the key head dim for names
      containing ``"flash"``.

    ``output_attentions=True`` returns the probabilities of the eager function (under ``"sdpa"`` too); under a
    registered function, whatever that function returns as weights. Flash attention / flex attention are refused
    when set (:meth:`KimiHybridPreTrainedModel.get_correct_attn_implementation`).
    """

    def __init__(self, config: KimiHybridConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D, H = config.hidden_size, config.num_attention_heads
        self.num_heads = H
        self.nope, self.rope, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_dim = self.nope + self.rope
        self.r = config.kv_lora_rank
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, config.q_lora_rank, bias=False)
            self.q_a_layernorm = KimiRMSNorm(config.q_lora_rank, eps=1e-6)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(D, self.r + self.rope, bias=False)
        self.kv_a_layernorm = KimiRMSNorm(self.r, eps=1e-6)
        self.kv_b_proj = nn.Linear(self.r, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(D, H * self.v_dim, bias=False)
        self.scaling = self.qk_dim ** -0.5
        # read by transformers' attention functions: one key / value head per query head, causal decoder
        self.num_key_value_groups = 1
        self.is_causal = True

    # the absorbed decode reads kv_b_proj.weight directly: fire its accelerate hook (CPU / disk offload)
    @force_accelerate_hooks("kv_b_proj")
    def forward(self, x: torch.Tensor, cache: Optional[KimiHybridCache] = None,
                attn_mask: Optional[torch.Tensor] = None, output_attentions: bool = False):
        """``x [B, T, D]``; ``attn_mask`` bool ``[B, 1, T, T_keys]`` (True = attend) or None for plain causal.

        Returns ``out [B, T, D]``; with ``output_attentions`` the pair ``(out, probs)``: the attention probabilities
        ``[B, H, T, T_keys]`` (fp32 softmax, cast to the query dtype) of the explicit (eager) path, which
        transformers' output capturing records."""
        B, T, _ = x.shape
        H = self.num_heads
        if self.config.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, T, H, self.qk_dim)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv, k_pe = kv.split([self.r, self.rope], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), k_pe], dim=-1)  # [B, T, r + rope]
        if cache is not None:
            latent = cache.mla_update(self.layer_idx, latent)
        absorbed = (cache is not None and not torch.is_grad_enabled() and T <= self.config.mla_absorb_max_q_len
                    and type(self.kv_b_proj) is nn.Linear and latent.shape[1] > T)
        weights = None
        impl = getattr(self.config, "_attn_implementation", None)
        if output_attentions and impl in (None, "sdpa"):  # explicit probabilities: the eager function
            out, weights = self._attend_interface(mla_eager_attention_forward, q, latent, attn_mask)
        elif output_attentions or impl not in (None, "sdpa", "eager") or (impl == "eager" and not absorbed):
            attention_fn = ALL_ATTENTION_FUNCTIONS.get_interface(impl, mla_eager_attention_forward)
            out, weights = self._attend_interface(attention_fn, q, latent, attn_mask, pad_v="flash" in impl)
        elif absorbed:  # "sdpa", None and "eager": the same math in latent space (class docstring)
            out = self._attend_latent(q, latent, attn_mask)
        else:
            out = self._attend_decompressed(q, latent, attn_mask)
        out = out.reshape(B, T, H * self.v_dim)
        if self.config.mla_use_output_gate:
            out = out * torch.sigmoid(self.g_proj(x))
        out = self.o_proj(out)
        return (out, weights) if output_attentions else out

    def _attend_interface(self, attention_fn, q, latent, attn_mask, pad_v: bool = False):
        """``q [B, T, H, nope + rope]`` over the decompressed keys of ``latent [B, S, r + rope]`` through
        ``attention_fn``, a function with transformers' attention-interface signature
        (``mla_kimi_hybrid.attend_interface``; ``attn_mask`` as :meth:`forward`, handed over as an additive float
        mask). Returns ``(out [B, T, H, v], weights or None)``."""
        # no attention dropout: the model has none (the SDPA paths run with dropout 0 as well)
        return _mla_attend_interface(attention_fn, self, q, latent, self.kv_b_proj, attn_mask,
                                     num_heads=self.num_heads, kv_lora_rank=self.r, nope=self.nope, v_dim=self.v_dim,
                                     scaling=self.scaling, pad_v=pad_v, dropout=0.0)

    def _attend_decompressed(self, q, latent, attn_mask):
        """``q [B, T, H, nope + rope]`` over the decompressed keys of ``latent [B, S, r + rope]``; one SDPA call
        without a prefix, else key block by key block with a log-sum-exp merge (``mla_kimi_hybrid``). Returns
        ``[B, T, H, v]``."""
        return _mla_attend_decompressed(q, latent, self.kv_b_proj, attn_mask, num_heads=self.num_heads,
                                        kv_lora_rank=self.r, nope=self.nope, v_dim=self.v_dim, scaling=self.scaling)

    def _attend_latent(self, q, latent, attn_mask):
        """Attention in latent space (decode), ``mla_kimi_hybrid.attend_latent``: ``q [B, T, H, nope + rope]``,
        ``latent [B, S, r + rope]``, ``attn_mask`` bool ``[B, 1, T, S]`` / a ``CausalBias`` / None. Returns
        ``[B, T, H, v]``."""
        return _mla_attend_latent(q, latent, self.kv_b_proj.weight, attn_mask, num_heads=self.num_heads,
                                  kv_lora_rank=self.r, nope=self.nope, v_dim=self.v_dim, scaling=self.scaling)


# ----------------------------------------------------------------------------------------------------------------
# decoder layers
# ----------------------------------------------------------------------------------------------------------------

def attn_res_mix(prefix: torch.Tensor, bank: List[torch.Tensor], proj_w: torch.Tensor, norm_w: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """K3 block attention residual: softmax over depth of ``<RMSNorm(V_j), norm_w * proj_w>`` (fp32, no scale), mixing
    the raw candidates ``V = bank + [prefix]``. ``prefix`` ``[B, T, D]``; returns ``[B, T, D]`` in prefix.dtype."""
    V = torch.stack([*bank, prefix], dim=-2).float()  # [B, T, n, D]
    keys = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    s = norm_w.float() * proj_w.float().view(-1)
    alpha = (keys @ s).softmax(-1)  # [B, T, n]
    return (alpha.unsqueeze(-1) * V).sum(-2).to(prefix.dtype)


class KimiDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer: ``h += attn(norm(h)); h += mlp(norm(h))`` (KDA or MLA, dense MLP or MoE).

    ``forward(hidden_states [B, T, D], attention_mask=..., past_key_values=..., cu_seqlens=...)`` returns the
    1-tuple ``(hidden_states,)``: every layer returns its residual stream as a tuple (see
    :class:`KimiAttnResDecoderLayer`, whose stream also carries the block bank). ``attention_mask`` is the mask of
    this layer's type: the ``[B, T]`` token mask for KDA, the ``[B, 1, T, T_keys]`` bool mask / ``CausalBias`` /
    None for MLA; ``cu_seqlens`` (packed documents) is read by KDA only.
    """

    # the cache is passed on under gradient checkpointing too (the model drops it for training with checkpointing)
    _can_checkpoint_with_cache = True

    def __init__(self, config: KimiHybridConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        D = config.hidden_size
        self.self_attn = (KimiDeltaAttention(config, layer_idx) if self.layer_type == LINEAR
                          else KimiMLAttention(config, layer_idx))
        self.mlp = KimiMoE(config) if config.mlp_layer_types[layer_idx] == "sparse" else KimiMLP(config)
        self.input_layernorm = KimiRMSNorm(D, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiRMSNorm(D, eps=config.rms_norm_eps)

    def _attend(self, x: torch.Tensor, attention_mask, cache, cu_seqlens, output_attentions=False) -> torch.Tensor:
        if self.layer_type == LINEAR:
            return self.self_attn(x, cache, attention_mask, cu_seqlens)
        if output_attentions:  # (out, probs): transformers' output capturing records the probabilities
            return self.self_attn(x, cache, attention_mask, True)[0]
        return self.self_attn(x, cache, attention_mask)

    def forward(self, hidden_states: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[KimiHybridCache] = None, cu_seqlens: Optional[torch.Tensor] = None,
                output_attentions: bool = False) -> Tuple[torch.Tensor, ...]:
        h = hidden_states
        h = h + self._attend(self.input_layernorm(h), attention_mask, past_key_values, cu_seqlens, output_attentions)
        return (h + self.mlp(self.post_attention_layernorm(h)),)


_ATTN_RES_WHY = "AttnRes scores are one fused fp32 product with the projection's [1, D] weight"


class KimiAttnResDecoderLayer(KimiDecoderLayer):
    """K3 decoder layer with block attention residuals (AttnRes, Kimi K3 section 1.3) instead of a residual stream.

    The stream is ``(p, *bank)``: ``p [B, T, D]`` the partial sum of the current block's sub-layer outputs, ``bank``
    the snapshots that opened each block (the embeddings first). Each sub-layer reads ``attn_res_mix`` of the bank
    and ``p`` (a softmax over depth) instead of ``p``; a layer whose index is a multiple of ``attn_res_block_size``
    pushes ``p`` to the bank and starts a new block. The bank travels as positional tensors so that a reentrant
    gradient checkpoint sees them as inputs (a list argument would be replayed on the outer graph).
    ``forward(p, *bank, attention_mask=..., past_key_values=..., cu_seqlens=...)`` returns ``(p, *bank)``.
    """

    def __init__(self, config: KimiHybridConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        D = config.hidden_size
        self.self_attention_res_norm = KimiRMSNorm(D, eps=config.rms_norm_eps)
        self.self_attention_res_proj = nn.Linear(D, 1, bias=False)
        self.mlp_res_norm = KimiRMSNorm(D, eps=config.rms_norm_eps)
        self.mlp_res_proj = nn.Linear(D, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor, *bank: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[KimiHybridCache] = None, cu_seqlens: Optional[torch.Tensor] = None,
                output_attentions: bool = False) -> Tuple[torch.Tensor, ...]:
        eps = self.config.rms_norm_eps
        p = hidden_states
        bank = list(bank)
        x_attn = p
        if bank:
            w_attn = direct_weight(self.self_attention_res_proj, "self_attention_res_proj", _ATTN_RES_WHY)
            x_attn = attn_res_mix(p, bank, w_attn, self.self_attention_res_norm.weight, eps)
        if self.layer_idx % self.config.attn_res_block_size == 0:
            bank.append(p)
            p = None
        a = self._attend(self.input_layernorm(x_attn), attention_mask, past_key_values, cu_seqlens, output_attentions)
        p = a if p is None else p + a
        x_mlp = attn_res_mix(p, bank, direct_weight(self.mlp_res_proj, "mlp_res_proj", _ATTN_RES_WHY),
                             self.mlp_res_norm.weight, eps)
        return (p + self.mlp(self.post_attention_layernorm(x_mlp)), *bank)


# ----------------------------------------------------------------------------------------------------------------
# model classes
# ----------------------------------------------------------------------------------------------------------------

def _weights_come_from_rank0() -> bool:
    """True on the ranks > 0 of an FSDP run with cpu-RAM-efficient loading: they build the model without reading the
    checkpoint and receive the weights from rank 0 (which does the strict key check for everyone)."""
    try:
        from transformers.modeling_utils import is_fsdp_enabled, is_local_dist_rank_0
    except ImportError:  # pragma: no cover - older transformers
        return False
    return bool(is_fsdp_enabled() and not is_local_dist_rank_0())


class KimiHybridPreTrainedModel(PreTrainedModel):
    """Weights init, fp32-kept parameters and the flags transformers reads."""

    config_class = KimiHybridConfig
    config: KimiHybridConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_sdpa = True
    _is_stateful = False  # the cache can be cropped (assisted decoding), see KimiHybridCache.crop
    # a static-cache decode step compiles to one graph (CPU and CUDA, MoE layers included) and exports
    _can_compile_fullgraph = True
    # what transformers' output capturing records (output_hidden_states / output_attentions / output_router_logits)
    _can_record_outputs = {
        "hidden_states": OutputRecorder(KimiDecoderLayer, index=0),
        "attentions": OutputRecorder(KimiMLAttention, index=1),
        "router_logits": OutputRecorder(KimiRouter, index=0),
    }

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """True: the routed experts (``KimiExperts`` in moe_kimi_hybrid.py) carry transformers'
        ``use_experts_implementation`` switch (transformers' default test looks for the decorator in this module's
        source only)."""
        return True

    def get_correct_experts_implementation(self, requested_experts: Optional[str]) -> str:
        """transformers' choice of expert implementation, except that the default is ``"eager"``: this model's own
        device paths (grouped GEMM on CUDA, expert GEMVs at decode, the capture-safe paths), not transformers'
        ``grouped_mm``, which stays available on request."""
        return super().get_correct_experts_implementation("eager" if requested_experts is None else requested_experts)

    def get_correct_attn_implementation(self, requested_attention: Optional[str], is_init_check: bool = False) -> str:
        """transformers' check of ``attn_implementation`` (None -> ``"sdpa"``; an unknown name raises transformers'
        ValueError ``Specified `attn_implementation="..."` is not supported``), except that flash attention and flex
        attention are refused with a ValueError saying why: the MLA layers are not written for them (queries / keys
        ``qk_nope + qk_rope`` wide, values ``v_head_dim`` wide, the KDA layers have no such switch), and the model
        does not claim them (no ``_supports_flash_attn`` / ``_supports_flex_attn``). ``"sdpa"`` (the default, with
        the model's own fused CUDA paths), ``"eager"`` and functions registered with
        ``transformers.AttentionInterface`` are accepted (``KimiMLAttention`` documents each)."""
        name = requested_attention or ""
        if name.startswith("flash_attention") or "flex_attention" in name:
            raise ValueError(
                f'{type(self).__name__} does not support attn_implementation="{requested_attention}": its MLA layers '
                "run 'sdpa' (the default, with fused CUDA kernels of their own), 'eager', or a function registered "
                "with transformers.AttentionInterface; flash attention / flex attention are not implemented for "
                "them (query / key and value head dims differ).")
        return super().get_correct_attn_implementation(requested_attention, is_init_check)
    _keep_in_fp32_modules_strict = ["A_log", "dt_bias", "e_score_correction_bias"]

    @classmethod
    def from_pretrained(cls, *args, strict_loading: bool = True, **kwargs):
        """``PreTrainedModel.from_pretrained``, strict about the checkpoint's tensors: a checkpoint that lacks
        tensors of this model (transformers would initialise them randomly) or holds tensors the model does not have
        (they would be dropped) raises ValueError naming them, instead of loading a silently different model.

        Args:
            strict_loading: False restores transformers' lenient behaviour (missing tensors randomly initialised,
                unexpected ones ignored; both are still logged by transformers).
            *args, **kwargs: as ``PreTrainedModel.from_pretrained`` (``output_loading_info`` included).

        A released Kimi-Linear folder (``block_sparse_moe.``, per-expert ``w1/w2/w3``, ``A_log [1, 1, H, 1]``) loads
        directly through the checkpoint-conversion mapping registered in ``conversion_kimi_hybrid.py``, as does a
        folder in our layout; ``save_pretrained`` then writes the released names whichever layout the model was
        loaded from (``save_original_format=False``: ours).

        Raises:
            ValueError: before any weight is read, for a local folder the mapping does not read (Kimi K3, a quantized
                checkpoint, a transformers-native ``kimi_linear`` one; the message gives the ``kimi-hybrid-convert
                SRC OUT`` command); missing or unexpected checkpoint keys.
        """
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        refuse_unmapped_folder(source, kwargs.get("subfolder") or "", cls.__name__)
        want_info = bool(kwargs.pop("output_loading_info", False))
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        # transformers keeps only the transforms that matched the checkpoint for the next save; the A_log reshape
        # also matches our own layout, so a model loaded from it would save a mixture of both namings. Dropping the
        # record makes save_pretrained write the full mapping's (released) names whatever was loaded.
        model._weight_conversions = None
        if strict_loading and not _weights_come_from_rank0():
            missing = sorted(info.get("missing_keys") or [])
            # a causal-LM checkpoint loaded into the bare decoder (AutoModel) legitimately leaves its head behind
            unexpected = sorted(k for k in info.get("unexpected_keys") or []
                                if not (k.startswith("lm_head.") and not hasattr(model, "lm_head")))
            if missing or unexpected:
                def show(keys):
                    return ", ".join(keys[:8]) + (f", ... ({len(keys)} in all)" if len(keys) > 8 else "")
                parts = ([f"missing {len(missing)} tensor(s) this model needs: {show(missing)}"] if missing else []) + (
                    [f"{len(unexpected)} unexpected tensor(s): {show(unexpected)}"] if unexpected else [])
                raise ValueError(
                    f"checkpoint {args[0] if args else kwargs.get('pretrained_model_name_or_path')!r} does not match "
                    f"{cls.__name__}: " + "; ".join(parts) + ". A K3, quantized or transformers-native kimi_linear "
                    "checkpoint needs `kimi-hybrid-convert` first; pass strict_loading=False to load anyway (missing "
                    "tensors randomly initialised, unexpected ones dropped).")
        return (model, info) if want_info else model

    @torch.no_grad()
    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, nn.Conv1d):
            init.normal_(module.weight, mean=0.0, std=1.0 / math.sqrt(module.kernel_size[0]))
        elif isinstance(module, (KimiRMSNorm, KimiGatedRMSNorm)):
            init.ones_(module.weight)
        elif isinstance(module, KimiRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiDeltaAttention):
            # FLA's KDA initialisation: A = U(1, 16); dt = U(1e-3, 1e-1) stored as inverse softplus
            a = torch.empty_like(module.A_log, dtype=torch.float32).uniform_(1.0, 16.0).log()
            init.copy_(module.A_log, a)
            dt = torch.empty_like(module.dt_bias, dtype=torch.float32).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            dt = dt.clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))


class KimiHybridModel(KimiHybridPreTrainedModel):
    """The decoder stack: embeddings, layers, final norm (and K3's exit AttnRes). Returns the last hidden state
    ``[B, T, D]`` and the :class:`KimiHybridCache`."""

    def __init__(self, config: KimiHybridConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        layer_cls = KimiAttnResDecoderLayer if config.attn_res_block_size > 0 else KimiDecoderLayer
        self.layers = nn.ModuleList([layer_cls(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res_block_size > 0:
            self.output_attn_res_norm = KimiRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self._no_split_modules = list(self._no_split_modules) + ["KimiAttnResDecoderLayer"]
        if config.is_k3:
            # K3 keeps the KDA conv kernels and o_norm in fp32 on disk and at run time (also for AutoModel loads)
            self._keep_in_fp32_modules_strict = list(self._keep_in_fp32_modules_strict) + [
                "q_conv1d", "k_conv1d", "v_conv1d", "o_norm"]
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    @capture_outputs
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[KimiHybridCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        use_cache: Optional[bool] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[KimiHybridCache] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        output_router_logits: Optional[bool] = None,
        cu_seq_lens_q: Optional[torch.Tensor] = None,
        cu_seq_lens_k: Optional[torch.Tensor] = None,
        max_length_q: Optional[int] = None,
        max_length_k: Optional[int] = None,
        seq_idx: Optional[torch.Tensor] = None,
        is_causal: Optional[bool] = None,
        **kwargs: Any,
    ) -> MoeModelOutputWithPast:
        """Args: ``input_ids [B, T]`` (or ``inputs_embeds [B, T, D]``); ``attention_mask [B, past + T]`` or
        ``[B, T]`` 0/1 (2-D only; pads anywhere); ``position_ids [B, T]`` (only used to detect packed documents:
        a 0 after the first token starts a new one, when there is no mask and no cache); the cache as ``cache``
        or ``past_key_values`` (not both): a KimiHybridCache, or a transformers ``DynamicCache(config=...)`` /
        ``StaticCache`` used as it is (``cache_view_kimi_hybrid`` says what it cannot hold); with ``use_cache`` and
        none given, a new ``DynamicCache(config)``.

        Packed documents (batch 1, no cache): ``cu_seqlens [N + 1]``, or transformers' flash-attention keywords
        ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (equal: causal self-attention) with ``max_length_q`` / ``max_length_k``
        (checked against the boundaries), or ``seq_idx [1, T]`` (document index per token); every path (KDA, its
        short conv, MLA) keeps documents apart; empty documents are allowed.

        Output flags (argument, else the config's field): ``output_hidden_states``, ``output_attentions`` (MLA
        probabilities ``[B, H, T, T_keys]``), ``output_router_logits`` (``[B*T, E]`` fp32 per MoE layer). A padded
        position changes no state and no real output; its own output repeats the last real token's before it.

        Raises:
            TypeError: a keyword this model does not take (never silently ignored).
            ValueError: a 4-D mask, a cache of another model, batch mismatches, ``position_ids`` not ``[B | 1, T]``
                integers, packed inputs with a given cache, disagreeing packing keywords, ``is_causal=False``, or a
                static cache that would overflow.
        """
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward() got unexpected keyword argument(s) "
                            f"{', '.join(sorted(kwargs))}; see the docstring for the accepted ones")
        if is_causal is False:
            raise ValueError("is_causal=False: this is a causal language model (KDA is a causal recurrence); "
                             "bidirectional attention is not available")
        past_key_values = resolve_cache_arg(past_key_values, cache)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training:
            use_cache = False
        four_d = attention_mask is not None and attention_mask.dim() == 4
        if four_d and past_key_values is not None:
            raise ValueError("a 4-D attention_mask cannot be combined with a cache or packed documents: pass it "
                             "with use_cache=False and no cache (or give a 2-D padding mask instead)")
        cache = resolve_cache(past_key_values, self.config, use_cache and not four_d)
        inputs_embeds = self._embed(input_ids, inputs_embeds, cache)
        B, T = inputs_embeds.shape[:2]
        cu_seqlens = packing_boundaries(cu_seqlens, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k,
                                         seq_idx, B, T)
        if output_attentions is None:
            output_attentions = bool(getattr(self.config, "output_attentions", False))
        cache, kda_mask, kda_cu_seqlens, mla_mask = self._masks_for(
            attention_mask, position_ids, cu_seqlens, cache, past_key_values is not None, inputs_embeds)

        # (hidden states, attention maps and router logits are recorded by transformers' output capturing hooks on
        # the decoder layers, the MLA modules and the routers: see _can_record_outputs)
        stream = (inputs_embeds,)  # (hidden states,), or K3's (partial block sum, *block bank)
        for layer in self.layers:
            stream = layer(*stream, attention_mask=kda_mask if layer.layer_type == LINEAR else mla_mask,
                           past_key_values=cache, cu_seqlens=kda_cu_seqlens, output_attentions=output_attentions)
        h = self.norm(self._exit_mix(stream))
        if kda_mask is not None and kda_mask.dim() == 2:
            h = self._repeat_last_real(h, kda_mask, cache)
        if cache is not None:
            cache.end_forward(T, h[:, -1])
        returned = cache.user_cache() if cache is not None and use_cache else None
        return MoeModelOutputWithPast(last_hidden_state=h, **cache_field(returned))

    # -- forward steps, in call order -------------------------------------------------------------------------------
    def _embed(self, input_ids: Optional[torch.Tensor], inputs_embeds: Optional[torch.Tensor], cache) -> torch.Tensor:
        """Checked ``inputs_embeds [B, T, D]`` from exactly one of ``input_ids`` / ``inputs_embeds``. The id range
        (a host read) is checked unless this is a one-token step on a filled cache (a decode step, whose ids come
        from the model's own vocabulary in ``generate``; :meth:`check_input_ids` checks any ids on request)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if input_ids is not None:
            decode = input_ids.dim() == 2 and input_ids.shape[1] == 1 and cache is not None and \
                cache.host_length() != 0
            check_input_ids(input_ids, self.config.vocab_size, values=not decode)
            return self.embed_tokens(input_ids)
        D = self.config.hidden_size
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[1] == 0 or inputs_embeds.shape[-1] != D:
            raise ValueError(f"inputs_embeds must be [batch, seq, hidden={D}] with seq >= 1, "
                             f"got {tuple(inputs_embeds.shape)}")
        if not inputs_embeds.is_floating_point():
            raise ValueError(f"inputs_embeds must be floating point, got dtype {inputs_embeds.dtype}")
        return inputs_embeds

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        """Check ``input_ids [B, T]`` (integers in ``[0, vocab_size)``; one host read). ``generate`` calls it once
        on the prompt; decode steps skip it.

        Raises:
            ValueError: as the forward's input check.
        """
        check_input_ids(input_ids, self.config.vocab_size)

    def _masks_for(self, attention_mask, position_ids, cu_seqlens, cache, cache_given: bool,
                   inputs_embeds: torch.Tensor):
        """``(cache, kda_mask, kda_cu_seqlens, mla_mask)`` of this call (:meth:`_build_masks`), after the mask /
        position-id checks and the cache's :meth:`prepare`; a custom 4-D mask (tree attention: MLA applies it, KDA
        runs each query over the tokens it sees) runs without a cache."""
        B, T = inputs_embeds.shape[:2]
        if attention_mask is not None and attention_mask.dim() == 4:
            if cu_seqlens is not None:
                raise ValueError("a 4-D attention_mask cannot be combined with a cache or packed documents: pass it "
                                 "with use_cache=False and no cache (or give a 2-D padding mask instead)")
            kda_mask = visible_from_4d_mask(attention_mask, B, T)
            return None, kda_mask, None, kda_mask.unsqueeze(1)
        if attention_mask is not None and attention_mask.dim() == 2:  # the mask's own errors first
            check_attention_mask(attention_mask, B, T, 0, True)
        position_ids = check_position_ids(position_ids, B, T)
        if cache is not None:
            cache.prepare(B, T, inputs_embeds.dtype, inputs_embeds.device,
                          host_checks=not (_compiling() or _graph_capturing(inputs_embeds)))
        # one mask per layer type: KDA reads the [B, T] token mask (None = every token real) and the packed
        # boundaries, MLA a [B, 1, T, T_keys] bool mask or a bottom-right CausalBias (None = plain causal)
        return self._build_masks(attention_mask, position_ids, cu_seqlens, cache, cache_given, inputs_embeds)

    def _build_masks(self, attention_mask, position_ids, cu_seqlens, cache, cache_given: bool,
                     inputs_embeds: torch.Tensor):
        """The masks of both layer types, built once per call.

        Returns ``(cache, kda_mask, kda_cu_seqlens, mla_mask)``: ``kda_mask [B, T]`` bool (False = pad; None when
        every token is real, or for packed inputs), ``kda_cu_seqlens [N + 1]`` document boundaries over the
        flattened tokens (packed inputs, else None), ``mla_mask`` bool ``[B, 1, T, T_keys]`` / ``CausalBias`` / None
        (plain causal). Packed inputs run without a cache (``cache`` comes back None), and raise ValueError when
        the caller gave one. The cache's key mask is updated with this call's tokens.
        """
        B, T, device = inputs_embeds.shape[0], inputs_embeds.shape[1], inputs_embeds.device
        # a static cache's length lives in a device counter (never read here: a compiled decode step must not
        # specialise on it); its zero-initialised buffers act as "no state"
        length = cache.host_length() if cache is not None else 0
        static = length is None
        past = length or 0
        decode = T == 1 and past > 0
        token_mask = history = None
        if attention_mask is not None:
            known = cache.host_count() if cache is not None else 0  # a static cache's host count: no device read
            check_attention_mask(attention_mask, B, T, past if known is None else known, known is None)
            token_mask = attention_mask[:, -T:].bool()
            if attention_mask.shape[1] == past + T and past > 0:
                history = attention_mask[:, :past]  # the caller's view of earlier pads
        segs = packed_segments(cu_seqlens, position_ids, B, device) if (
            cu_seqlens is not None or (attention_mask is None and past == 0 and not static)) else None
        kda_cu = None
        if segs is not None:
            if cache is not None:
                if cache_given:
                    raise ValueError("packed sequences (cu_seqlens / position_ids restarting at 0) cannot be written "
                                     "to a cache: run them with use_cache=False, or one document per row with a cache")
                cache = None  # the cache created for use_cache would hold no consistent state of several documents
            kda_cu = cu_seqlens_from_segments(segs, T)
            token_mask = None
        full_mask = token_mask
        # static mode, decode steps and tracing (torch.compile / torch.export) keep the masks: pure tensor ops, no
        # host read
        traced = static or _compiling()
        if token_mask is not None and not traced and not decode and bool(token_mask.all()):
            token_mask = None
        if cache is not None:
            new = full_mask if full_mask is not None else torch.ones(B, T, dtype=torch.bool, device=device)
            keys_valid = cache.update_key_mask(new, history)
            if full_mask is not None and past > 0 and T > 1 and cache.last_hidden_state() is None \
                    and not cache.keeps_padding_history() and not bool(full_mask.any(1).all()):
                raise ValueError("a row of this call holds only padding, and a transformers cache keeps no hidden "
                                 "state of earlier tokens to predict from: pass past_key_values=KimiHybridCache("
                                 "model.config), or leave such rows out of the call")
        else:
            keys_valid = full_mask
        mla_mask = None
        need_mask = (static or segs is not None or past > 0
                     or (keys_valid is not None and (traced or not bool(keys_valid.all()))))
        if FULL in self.config.layer_types and need_mask:
            if (T > 1 and past > 0 and segs is None and token_mask is None and not static
                    and not traced and bool(keys_valid.all())):
                # chunked prefill through a cache without padding: bottom-right causal, never materialised (SDPA
                # runs it in its fused kernels; a dense [T, past + T] mask would not fit at long context)
                from torch.nn.attention.bias import causal_lower_right

                mla_mask = causal_lower_right(T, past + T)
            else:
                mla_mask = build_mla_mask(B, T, keys_valid, segs, cache, device)
        return cache, token_mask, kda_cu, mla_mask

    def _exit_mix(self, stream: Tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The hidden state before the final norm: the stream itself, or with K3's AttnRes the softmax-over-depth mix
        of the block bank and the last partial sum (``[B, T, D]``)."""
        if self.config.attn_res_block_size == 0:
            return stream[0]
        w = direct_weight(self.output_attn_res_proj, "output_attn_res_proj", _ATTN_RES_WHY)
        return attn_res_mix(stream[0], list(stream[1:]), w, self.output_attn_res_norm.weight, self.config.rms_norm_eps)

    @staticmethod
    def _repeat_last_real(h: torch.Tensor, token_mask: torch.Tensor, cache) -> torch.Tensor:
        """A pad's output repeats the output of its row's last real token before it (in this call, else the one the
        dynamic cache kept), so the last position of a right-padded row predicts that row's next token (generate
        reads logits[:, -1]), also when the last piece of a chunked prefill is all padding. ``h [B, T, D]``."""
        B, T = token_mask.shape
        pos = torch.arange(T, device=h.device).expand(B, T)
        last = torch.where(token_mask, pos, torch.full_like(pos, -1)).cummax(1).values
        src = torch.where(last >= 0, last, pos)
        h = h.gather(1, src.unsqueeze(-1).expand_as(h))
        kept = cache.last_hidden_state() if cache is not None else None
        if kept is not None:
            h = torch.where((last < 0).unsqueeze(-1), kept.unsqueeze(1).to(h.dtype), h)
        return h


# arguments of ``generate`` that transformers hands on to the decoding loop with the model's keywords (tokenizers for
# stop strings and assisted decoding, the assistant, the streamer, the distributed switch); the forward never takes them
_GENERATE_ONLY_KWARGS = ("tokenizer", "assistant_tokenizer", "target_tokenizer", "assistant_model", "streamer",
                         "synced_gpus", "inputs_tensor")


class KimiHybridForCausalLM(KimiHybridPreTrainedModel, GenerationMixin):
    """Causal LM head over :class:`KimiHybridModel`. Loss with ``labels`` (shifted inside, -100 ignored),
    ``logits_to_keep`` (int: last N positions, 0 = all; or a 1-D index tensor). Generation uses
    :class:`KimiHybridCache` for every strategy (greedy, sampling, beam search, assisted / prompt lookup, static)."""

    # tied only when config.tie_word_embeddings (False in the released checkpoints): transformers reads this map
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # tensor parallelism: the head splits the vocabulary and gathers the logits (a tied head shares the embedding's
    # vocabulary split, ``embedding_rowwise``); the decoder's plan is KimiHybridConfig.base_model_tp_plan
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: KimiHybridConfig):
        super().__init__(config)
        self.model = KimiHybridModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()  # gathers the child model's K3 fp32 list

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new):
        self.lm_head = new

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[KimiHybridCache] = None,
        inputs_embeds: Optional[torch.Tensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        output_attentions: Optional[bool] = None,
        output_hidden_states: Optional[bool] = None,
        output_router_logits: Optional[bool] = None,
        return_dict: Optional[bool] = None,
        logits_to_keep: Union[int, torch.Tensor] = 0,
        cu_seqlens: Optional[torch.Tensor] = None,
        cache: Optional[KimiHybridCache] = None,
        num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
        shift_labels: Optional[torch.LongTensor] = None,
        ignore_index: Optional[int] = None,
        **kwargs: Any,
    ) -> Union[MoeCausalLMOutputWithPast, Tuple]:
        """Returns ``logits [B, T_kept, V]`` (model dtype), ``loss`` (fp32 mean cross-entropy over labels != -100;
        ``num_items_in_batch`` / ``shift_labels`` / ``ignore_index`` as transformers' loss takes them), the cache
        (``past_key_values``; transformers >= 5.24 names it ``cache``, both names are accepted), and what the output
        flags ask for (see :meth:`KimiHybridModel.forward`, which also lists the packing keywords passed on in
        ``kwargs``).

        ``output_router_logits`` (argument, else ``config.output_router_logits``) also returns ``aux_loss``: the
        load-balancing loss over the MoE layers (:meth:`router_aux_loss`), added to ``loss`` times
        ``config.router_aux_loss_coef`` when ``labels`` are given.

        Raises:
            TypeError: a keyword this model does not take. ValueError: as :meth:`KimiHybridModel.forward`.
        """
        graphs = self.__dict__.get("_decode_graphs")
        if graphs is not None and graphs.active:
            step = graphs.step(input_ids, resolve_cache_arg(past_key_values, cache), self._graph_eligible(
                inputs_embeds, labels, shift_labels, cu_seqlens, attention_mask, logits_to_keep, return_dict,
                output_attentions, output_hidden_states, output_router_logits, kwargs))
            if step is not None:
                return MoeCausalLMOutputWithPast(logits=step[0], **cache_field(step[1]))
        model_kwargs = {k: v for k, v in (("output_attentions", output_attentions),
                                          ("output_hidden_states", output_hidden_states),
                                          ("output_router_logits", output_router_logits)) if v is not None}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         cache=resolve_cache_arg(past_key_values, cache), inputs_embeds=inputs_embeds,
                         use_cache=use_cache, return_dict=True, cu_seqlens=cu_seqlens, **model_kwargs, **kwargs)
        h = out.last_hidden_state
        if isinstance(logits_to_keep, int):
            h = h[:, -logits_to_keep:] if logits_to_keep > 0 else h
        else:
            h = h[:, logits_to_keep]
        logits = self.lm_head(h)
        loss = None
        for name, lab in (("labels", labels), ("shift_labels", shift_labels)):
            if lab is not None:
                check_labels(name, lab, h.shape[:2] if isinstance(logits_to_keep, int) and logits_to_keep == 0
                             else None, self.config.vocab_size, -100 if ignore_index is None else ignore_index)
        if labels is not None or shift_labels is not None:
            loss_kw = {k: v for k, v in (("num_items_in_batch", num_items_in_batch), ("shift_labels", shift_labels),
                                         ("ignore_index", ignore_index)) if v is not None}
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **loss_kw)
        aux_loss = None
        if out.router_logits:
            aux_loss = self.router_aux_loss(out.router_logits, attention_mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        res = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits, **cache_field(output_cache(out)),
                                        hidden_states=out.hidden_states, attentions=out.attentions,
                                        router_logits=out.router_logits)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return res if return_dict is not False else res.to_tuple()

    def _graph_eligible(self, inputs_embeds, labels, shift_labels, cu_seqlens, attention_mask, logits_to_keep,
                        return_dict, output_attentions, output_hidden_states, output_router_logits, kwargs) -> bool:
        """Whether a forward's arguments allow a captured decode step (logits of the new token only, no output
        flags, labels, embeddings, packing or 4-D masks); the engine checks the ids and the cache."""
        cfg = self.config
        flags = (output_attentions, output_hidden_states, output_router_logits)
        defaults = (cfg.output_attentions, cfg.output_hidden_states, getattr(cfg, "output_router_logits", False))
        if any(bool(d if f is None else f) for f, d in zip(flags, defaults)):
            return False
        return (inputs_embeds is None and labels is None and shift_labels is None and cu_seqlens is None and not kwargs
                and (attention_mask is None or attention_mask.dim() == 2)
                and isinstance(logits_to_keep, int) and logits_to_keep in (0, 1)
                and (return_dict if return_dict is not None else getattr(cfg, "return_dict", True)) is not False)

    def router_aux_loss(self, router_logits: Tuple[torch.Tensor, ...],
                        attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Load-balancing loss of the MoE layers in transformers' (Switch / Mixtral) form:
        ``E * sum_e f_e * P_e``, with ``f_e`` the fraction of (token, choice) slots routed to expert e (the experts
        this model actually chose: correction bias and expert groups included) and ``P_e`` the mean routing
        probability of e (softmax router: the softmax; sigmoid router: the sigmoid scores normalised per token),
        both over every MoE layer's tokens, padding excluded. For a softmax router without correction bias or groups
        it equals transformers' ``load_balancing_loss_func``. A perfectly uniform router scores ``top_k``.

        Args:
            router_logits: one ``[B*T, E]`` fp32 tensor per MoE layer (``output_router_logits``), in layer order.
            attention_mask: ``[B, past + T]`` or ``[B, T]`` 0/1; its last T columns mark the real tokens.

        Returns:
            A scalar fp32 tensor (differentiable with respect to the router weights).
        """
        routers = [layer.mlp.gate for layer in self.model.layers if isinstance(layer.mlp, KimiMoE)]
        if len(routers) != len(router_logits):
            raise ValueError(f"got {len(router_logits)} router logit tensors for {len(routers)} MoE layers")
        E = self.config.num_experts
        probs, chosen = [], []
        for logits, router in zip(router_logits, routers):
            logits = logits.float()
            if self.config.moe_router_activation_func == "sigmoid":
                scores = logits.sigmoid()
                probs.append(scores / (scores.sum(-1, keepdim=True) + 1e-20))
            else:
                probs.append(logits.softmax(-1))
            chosen.append(router.route(logits)[1].detach())
        probs = torch.cat(probs)  # [L*N, E]
        onehot = F.one_hot(torch.cat(chosen), E).float()  # [L*N, k, E]
        if attention_mask is None:
            slots, mean_prob = onehot.mean(0), probs.mean(0)
        else:
            N = router_logits[0].shape[0]
            B = attention_mask.shape[0]
            m = attention_mask[:, -(N // B):].reshape(-1).to(probs.device, torch.float32).repeat(len(routers))
            slots = (onehot * m[:, None, None]).sum(0) / m.sum()
            mean_prob = (probs * m[:, None]).sum(0) / m.sum()
        return (slots * mean_prob.unsqueeze(0)).sum() * E

    # -- generation -------------------------------------------------------------------------------------------------
    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, inputs_embeds=None,
                                      **kwargs):
        """transformers' default, but the 2-D padding mask is always passed through (our layers build their own
        KDA / MLA masks from it; with a static cache, only its columns of the new tokens: the cache holds the rest). The cache comes as ``past_key_values`` (transformers
        <= 5.23) or ``cache`` (5.24 on) and is handed on under the installed transformers' name."""
        cache = resolve_cache_arg(past_key_values, kwargs.pop("cache", None))
        for name in _GENERATE_ONLY_KWARGS:  # generate's own arguments, consumed by generate: never the forward's
            kwargs.pop(name, None)
        kwargs[GENERATION_CACHE_NAME] = cache
        if (kwargs.get("next_sequence_length") is None and inputs_embeds is None and isinstance(cache, KimiHybridCache)
                and all(cache.is_linear)):
            # transformers >= 5.24 does not slice the already-cached tokens off for a cache of linear layers only
            # (its own such caches cannot report a length); ours counts positions, so feed only the new tokens
            past = cache.get_seq_length()
            if 0 < past < input_ids.shape[1]:
                kwargs["next_sequence_length"] = input_ids.shape[1] - past
        inputs = super().prepare_inputs_for_generation(input_ids, attention_mask=attention_mask,
                                                       inputs_embeds=inputs_embeds, **kwargs)
        if attention_mask is not None:
            if isinstance(cache, KimiHybridCache) and cache.is_compileable:
                # a static cache keeps the key-padding history itself (``key_mask``): pass the new tokens' columns
                # only, whose shape does not grow with the step, so a compiled decode step never recompiles
                new = inputs.get("input_ids")
                new = new if new is not None else inputs.get("inputs_embeds")
                inputs["attention_mask"] = (attention_mask[:, -new.shape[1]:].contiguous() if new is not None
                                            else attention_mask)
            else:
                inputs["attention_mask"] = attention_mask
        return inputs

    # -- prefix reuse ---------------------------------------------------------------------------------------------
    def prefill_prefix(self, prefix_ids: torch.LongTensor,
                       attention_mask: Optional[torch.Tensor] = None) -> KimiHybridCache:
        """Run a prefix shared by many prompts (a system prompt, an agent's tool list, a document) once.

        ``prefix_ids [1, P]`` (or ``[B, P]``). Returns its :class:`KimiHybridCache`; keep it as the snapshot and give
        each continuation ``prefix_cache.fork()`` (or use :meth:`generate_from_prefix`), so the prefix is never
        recomputed. Only the last position's logits are computed."""
        return prefill_prefix(self, prefix_ids, attention_mask)

    def generate_from_prefix(self, prefix_cache: KimiHybridCache, prefix_ids: torch.LongTensor,
                             suffixes: List[torch.LongTensor], **generate_kwargs):
        """Generate for many prompts ``prefix + suffix_i`` in one batch, reusing ``prefix_cache`` (from
        :meth:`prefill_prefix` over ``prefix_ids [1, P]``) instead of recomputing the prefix.

        Rows are ``prefix | pads | suffix_i`` (interior padding, so every prompt ends in the last column; pads
        change nothing, see :meth:`KimiHybridModel.forward`) with the prefix cache forked to ``len(suffixes)`` rows;
        ``prefix_cache`` itself is left untouched. ``suffixes``: 1-D id tensors (at least one token each).
        Returns what ``generate`` returns (``sequences [n, P + max_suffix + new]``); decodes with graphs as
        :meth:`generate` does."""
        return generate_from_prefix(self, prefix_cache, prefix_ids, suffixes, **generate_kwargs)

    # -- graph decoding ---------------------------------------------------------------------------------------------
    def generate(self, *args, cuda_graphs: Optional[bool] = None, **kwargs):
        """transformers' ``generate`` (every argument it documents), whose decode steps replay captured CUDA graphs
        on CUDA (see ``engine_kimi_hybrid``): one graph per (batch, cache capacity bucket), cached on the model.

        ``cuda_graphs``: False decodes eagerly (as on CPU); None (default) reads the generation config's
        ``cuda_graphs`` field, else True. Steps that need the eager path take it (output flags, assisted /
        prompt-lookup verification and drafting, transformers caches other than :class:`KimiHybridCache`); a
        ``compile_config`` asks for transformers' own compiled path instead of graphs.

        Raises:
            ValueError: a filled cache whose sequence the input does not extend (the input must hold the cached
                tokens plus at least one new one), and what transformers' ``generate`` raises.
        """
        return generate_with_graphs(self, super().generate, args, kwargs, cuda_graphs)

    def decode_graphs(self) -> DecodeGraphs:
        """The model's cache of CUDA-graph decode steps (created at the first call)."""
        graphs = self.__dict__.get("_decode_graphs")
        if graphs is None:
            graphs = self.__dict__["_decode_graphs"] = DecodeGraphs(self)
        return graphs

    def cuda_graphs_memory(self) -> dict:
        """What the cached decode graphs hold: ``{"graphs", "total_bytes", "slots": [{"batch", "capacity", "dtype",
        "bytes"}]}`` (each slot: its static workspace cache, buffers and graph pool)."""
        return self.decode_graphs().memory()

    def release_cuda_graphs(self) -> int:
        """Free the cached decode graphs and their workspaces; returns the bytes freed. The next ``generate``
        captures again."""
        return self.decode_graphs().release()

    def get_compiled_call(self, compile_config):
        """transformers' compiled forward for decode steps; inside a graph-decoding ``generate`` the plain forward,
        whose decode steps replay the captured graphs."""
        if self.decode_graphs().active:
            return self.__call__
        return super().get_compiled_call(compile_config)

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """Called by ``prepare_inputs_for_generation`` for a compileable (static) cache: keep the 2-D padding mask,
        our model builds its KDA / MLA masks from it (and from the cache's ``key_mask``) itself."""
        return attention_mask

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Build a :class:`KimiHybridCache` (static when ``cache_implementation="static"``) instead of transformers'
        DynamicCache / StaticCache."""
        self.decode_graphs().expect_length(generation_config.max_length)  # sizes the graph steps' first bucket
        user = pop_cache_kwargs(model_kwargs)  # either name (transformers 5.24 renamed it to `cache`)
        if user is not None:
            model_kwargs[GENERATION_CACHE_NAME] = user
            resolve_cache(user, self.config, True)  # refused here, before generation starts, if it cannot serve
            user._is_user_defined = True  # transformers' own mark: generate returns a cache the user passed
            return
        if generation_config.use_cache is False:
            return
        impl = getattr(generation_config, "cache_implementation", None)
        if impl == "static":
            max_len = kwargs.get("max_cache_length")
            if max_len is None and len(args) >= 3:
                max_len = args[2]
            if max_len is None:
                max_len = generation_config.max_length
            if getattr(generation_config, "max_cache_len", None):
                max_len = max(max_len, generation_config.max_cache_len)
            # transformers' rule (GenerationMixin._prepare_static_cache): never shrink below an earlier request's
            # length, so a compiled decode step sees the same shapes and does not recompile for a shorter request
            # and rounded up to the capacity bucket of the graph decode steps: a longer request inside the bucket
            # reuses the captured graph (or the compiled step) of the same shapes
            max_len = self.decode_graphs().bucket(max(int(max_len), getattr(self, "_previous_max_cache_length", -1)))
            self._previous_max_cache_length = max_len
            model_kwargs[GENERATION_CACHE_NAME] = KimiHybridCache(self.config, max_cache_len=int(max_len))
        elif impl in (None, "dynamic"):
            model_kwargs[GENERATION_CACHE_NAME] = KimiHybridCache(self.config)
        else:
            raise ValueError(f"cache_implementation={impl!r} is not supported by KimiHybrid; use None/'dynamic' or "
                             "'static'")
        if getattr(generation_config, "is_assistant", False):
            # a draft model's cache is rolled back over several of its forwards (see KimiHybridCache.crop)
            model_kwargs[GENERATION_CACHE_NAME].activate_past_recording()
