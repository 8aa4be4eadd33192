# coding=utf-8
"""A frozen FP8 base for QLoRA: block-scaled float8 (e4m3fn) linear layers and routed experts.

The storage is transformers' fine-grained FP8 format (``FineGrainedFP8Config``): each quantized weight ``W [.., N, K]``
is held as ``weight`` (``float8_e4m3fn``) and ``weight_scale_inv [.., ceil(N/bn), ceil(K/bk)]`` (fp32), with
``W ~= weight * scale_inv`` per ``block_size = (bn, bk)`` block; the routed experts keep this model's fused layout
(``gate_up_proj [E, 2F, D]``, ``down_proj [E, D, F]``, each with its ``*_scale_inv``). What is never quantized: the
embeddings, ``lm_head`` and the directly read linears (:data:`DEFAULT_NOT_CONVERTED`), the norms, the router (``KimiRouter``: weight and ``e_score_correction_bias``)
and the KDA fp32 parameters (``A_log``, ``dt_bias``) and conv kernels: only ``nn.Linear`` layers and ``KimiExperts``
are converted.

The matmuls dequantize one weight (one linear layer, one expert) at a time into the activation dtype and drop it
after use; the backward pass dequantizes again instead of saving the bf16 copy, so the memory held across a step is
the FP8 weights (+ one transient weight). This runs on any device (CPU included: the reference path) with torch
alone.

LoRA: PEFT's own ``Linear`` LoRA wraps :class:`KimiFP8Linear` (an ``nn.Linear`` whose ``compute_dtype`` tells PEFT
the adapter dtype); the routed experts take per-expert split low-rank products ``x A_e^T B_e^T`` beside the FP8
product (:meth:`KimiFP8Experts.forward` with ``adapters``), never forming ``W + BA``. Merging needs a bf16 copy of
the weights: :func:`dequantize_model_` first, then PEFT's ``merge_and_unload``.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe_kimi_hybrid import KimiExperts, glu_act

__all__ = ["FP8_DTYPE", "DEFAULT_BLOCK_SIZE", "quantize_fp8_blockwise", "dequantize_fp8_blockwise",
           "fp8_matmul", "KimiFP8Linear", "KimiFP8Experts", "quantize_model_fp8_", "dequantize_model_",
           "fp8_quantization_config", "DEFAULT_NOT_CONVERTED"]

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(FP8_DTYPE).max
DEFAULT_BLOCK_SIZE: Tuple[int, int] = (128, 128)  # DeepSeek-V3 / transformers' default weight_block_size
#: linears kept in their dtype: lm_head (accuracy), and the ones whose weight the model reads directly instead of
#: calling them (MLA latent decode absorbs kv_b_proj.weight; K3's AttnRes mixes with the res_proj weights)
DEFAULT_NOT_CONVERTED: Tuple[str, ...] = ("lm_head", "kv_b_proj", "self_attention_res_proj", "mlp_res_proj",
                                          "output_attn_res_proj")


def _check_block(block_size) -> Tuple[int, int]:
    if len(block_size) != 2 or any(int(b) <= 0 for b in block_size):
        raise ValueError(f"block_size must be two positive ints (rows, cols), got {block_size!r}")
    return int(block_size[0]), int(block_size[1])


def quantize_fp8_blockwise(w: torch.Tensor, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE):
    """``w [..., N, K]`` (any float) -> ``(q [..., N, K] float8_e4m3fn, scale_inv [..., ceil(N/bn), ceil(K/bk)]
    fp32)``: each block scaled so its largest magnitude maps to e4m3's 448, so ``w ~= q * scale_inv`` (relative
    error per element <= 2^-4 of the block's max). All-zero blocks get scale 1."""
    bn, bk = _check_block(block_size)
    N, K = w.shape[-2:]
    pn, pk = (-N) % bn, (-K) % bk
    wf = F.pad(w.float(), (0, pk, 0, pn))
    lead = wf.shape[:-2]
    blocks = wf.reshape(*lead, (N + pn) // bn, bn, (K + pk) // bk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = torch.where(amax > 0, amax / _FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[..., :, None, :, None]).clamp_(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)
    return q.reshape(*lead, N + pn, K + pk)[..., :N, :K].contiguous(), scale


def dequantize_fp8_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, block_size: Sequence[int],
                             dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of :func:`quantize_fp8_blockwise`: ``q [..., N, K]`` with ``scale_inv [..., ceil(N/bn),
    ceil(K/bk)]`` -> ``[..., N, K]`` in ``dtype``."""
    bn, bk = _check_block(block_size)
    N, K = q.shape[-2:]
    s = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return (q.float() * s).to(dtype)


class _FP8Matmul(torch.autograd.Function):
    """``x @ dequant(q, s).T`` with a gradient for ``x`` only; the weight is dequantized again in backward rather
    than saved."""

    @staticmethod
    def forward(ctx, x, q, scale_inv, block_size):
        ctx.save_for_backward(q, scale_inv)
        ctx.block_size = block_size
        return x @ dequantize_fp8_blockwise(q, scale_inv, block_size, x.dtype).t()

    @staticmethod
    def backward(ctx, grad):
        q, scale_inv = ctx.saved_tensors
        return grad @ dequantize_fp8_blockwise(q, scale_inv, ctx.block_size, grad.dtype), None, None, None


def fp8_matmul(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block_size: Sequence[int]) -> torch.Tensor:
    """``x [..., K] @ W.T`` for the FP8 weight ``W = (q [N, K], scale_inv)``: ``[..., N]`` in x.dtype. Differentiable
    in ``x``; the weight is frozen."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _FP8Matmul.apply(x, q, scale_inv, tuple(block_size))
    return x @ dequantize_fp8_blockwise(q, scale_inv, block_size, x.dtype).t()


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


class KimiFP8Linear(nn.Linear):
    """A frozen ``nn.Linear`` with an FP8 block-scaled weight (transformers' ``weight`` / ``weight_scale_inv``
    names). ``[..., in] -> [..., out]`` in the input dtype; ``compute_dtype`` is the dtype of the layer it replaced
    (PEFT creates its adapters in it)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 block_size: Sequence[int] = DEFAULT_BLOCK_SIZE, compute_dtype: torch.dtype = torch.bfloat16,
                 device=None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.block_size = _check_block(block_size)
        self.compute_dtype = compute_dtype
        bn, bk = self.block_size
        self.weight = _frozen(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device))
        self.weight_scale_inv = _frozen(torch.empty(-(-out_features // bn), -(-in_features // bk),
                                                    dtype=torch.float32, device=device))
        self.bias = _frozen(torch.empty(out_features, dtype=compute_dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE) -> "KimiFP8Linear":
        """Quantize ``linear``'s weight (on its device); the bias stays in its dtype."""
        w = linear.weight.detach()
        out = cls(linear.in_features, linear.out_features, linear.bias is not None, block_size, w.dtype, "meta")
        q, s = quantize_fp8_blockwise(w, out.block_size)
        out.weight, out.weight_scale_inv = _frozen(q), _frozen(s)
        if linear.bias is not None:
            out.bias = _frozen(linear.bias.detach().clone())
        return out

    def dequantized_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """``[out, in]`` in ``dtype`` (default ``compute_dtype``)."""
        return dequantize_fp8_blockwise(self.weight, self.weight_scale_inv, self.block_size,
                                        dtype or self.compute_dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` in ``compute_dtype`` holding the dequantized weight."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        lin.weight = nn.Parameter(self.dequantized_weight())
        if self.bias is not None:
            lin.bias = nn.Parameter(self.bias.detach().to(self.compute_dtype).clone())
        return lin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_matmul(x, self.weight, self.weight_scale_inv, self.block_size)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block_size={self.block_size}"


class KimiFP8Experts(nn.Module):
    """Routed experts with FP8 block-scaled weights: ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``
    (float8_e4m3fn) and their ``*_scale_inv`` (fp32), frozen. Same call contract as ``KimiExperts``: ``x [N, D]``,
    ``topk_idx`` / ``topk_w [N, k]`` -> ``[N, D]`` in x.dtype; this model's GLU (SiLU or SiTU)."""

    def __init__(self, config, in_dim: int, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
                 compute_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.config = config
        E, F_ = config.num_experts, config.moe_intermediate_size
        self.num_experts, self.intermediate = E, F_
        self.block_size = _check_block(block_size)
        self.compute_dtype = compute_dtype
        bn, bk = self.block_size
        for name, (n, k) in {"gate_up_proj": (2 * F_, in_dim), "down_proj": (in_dim, F_)}.items():
            setattr(self, name, _frozen(torch.empty(E, n, k, dtype=FP8_DTYPE, device=device)))
            setattr(self, name + "_scale_inv",
                    _frozen(torch.empty(E, -(-n // bn), -(-k // bk), dtype=torch.float32, device=device)))

    @classmethod
    def from_experts(cls, experts: KimiExperts, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE) -> "KimiFP8Experts":
        """Quantize a ``KimiExperts`` stack (on its device), one expert at a time (a transient fp32 copy of one
        expert, not of the stack)."""
        gu, dn = experts.gate_up_proj.detach(), experts.down_proj.detach()
        out = cls(experts.config, gu.shape[-1], block_size, gu.dtype, "meta")
        for name, w in (("gate_up_proj", gu), ("down_proj", dn)):
            pairs = [quantize_fp8_blockwise(w[e], out.block_size) for e in range(w.shape[0])]
            setattr(out, name, _frozen(torch.stack([p[0] for p in pairs])))
            setattr(out, name + "_scale_inv", _frozen(torch.stack([p[1] for p in pairs])))
        return out

    def expert_weights(self, dtype: Optional[torch.dtype] = None):
        """``(gate_up [E, 2F, D], down [E, D, F])`` dequantized to ``dtype`` (default ``compute_dtype``)."""
        dt = dtype or self.compute_dtype
        return (dequantize_fp8_blockwise(self.gate_up_proj, self.gate_up_proj_scale_inv, self.block_size, dt),
                dequantize_fp8_blockwise(self.down_proj, self.down_proj_scale_inv, self.block_size, dt))

    def to_experts(self) -> KimiExperts:
        """A plain ``KimiExperts`` in ``compute_dtype`` with the dequantized weights."""
        with torch.device("meta"):
            out = KimiExperts(self.config, self.gate_up_proj.shape[-1])
        gu, dn = self.expert_weights()
        out.gate_up_proj, out.down_proj = nn.Parameter(gu), nn.Parameter(dn)
        return out

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                adapters: Iterable = ()) -> torch.Tensor:
        """``adapters``: ``(A_gu [E, r, D], B_gu [E, 2F, r], A_down [E, r, F], B_down [E, D, r], scaling)``
        tuples, each adding ``scaling * B_e A_e`` to expert e's weights as split low-rank products."""
        N, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        order = flat.argsort(stable=True)
        token_of = order // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # one host read per call
        ys = self._expert_mlp(x[token_of], counts, tuple(adapters))
        ys = ys.float() * topk_w.reshape(-1)[order].unsqueeze(-1).float()
        out = torch.zeros(N, x.shape[-1], dtype=torch.float32, device=x.device)
        return out.index_add_(0, token_of, ys).to(x.dtype)

    def _expert_mlp(self, xs: torch.Tensor, counts, adapters) -> torch.Tensor:
        """``xs [M, D]`` sorted by expert (``counts[e]`` rows each) -> ``[M, D]``: per expert that received tokens,
        the FP8 products plus each adapter's ``(x A^T) B^T`` (fp32 adapters cast to x.dtype)."""
        F_ = self.down_proj.shape[-1]
        outs, start = [], 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = xs[start:start + n]
            start += n
            h = fp8_matmul(seg, self.gate_up_proj[e], self.gate_up_proj_scale_inv[e], self.block_size)
            for a_gu, b_gu, _, _, s in adapters:
                h = h + s * ((seg @ a_gu[e].t().to(seg.dtype)) @ b_gu[e].t().to(seg.dtype))
            a = glu_act(self.config, h[:, :F_], h[:, F_:])
            y = fp8_matmul(a, self.down_proj[e], self.down_proj_scale_inv[e], self.block_size)
            for _, _, a_d, b_d, s in adapters:
                y = y + s * ((a @ a_d[e].t().to(a.dtype)) @ b_d[e].t().to(a.dtype))
            outs.append(y)
        if not outs:
            return xs.new_zeros(0, self.down_proj.shape[1])
        return torch.cat(outs)

    def extra_repr(self) -> str:
        E, F2, D = self.gate_up_proj.shape
        return f"num_experts={E}, intermediate={F2 // 2}, in_dim={D}, block_size={self.block_size}"


def _skipped(name: str, modules_to_not_convert: Sequence[str]) -> bool:
    return any(name == m or name.endswith("." + m) or name.startswith(m + ".") for m in modules_to_not_convert)


def quantize_model_fp8_(model: nn.Module, block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
                        modules_to_not_convert: Sequence[str] = DEFAULT_NOT_CONVERTED) -> nn.Module:
    """Convert ``model`` in place: every ``nn.Linear`` (exact type) -> :class:`KimiFP8Linear`, every
    ``KimiExperts`` -> :class:`KimiFP8Experts`, each quantized on the device its weight is on, one module at a
    time. Modules named in (or under) ``modules_to_not_convert`` stay as they are. Records the format in
    ``model.config.quantization_config`` (transformers' ``fp8`` schema). Returns ``model``.

    Raises ValueError for a bad ``block_size`` or a model with already quantized modules."""
    block_size = _check_block(block_size)
    mods = list(model.named_modules())
    if any(isinstance(m, (KimiFP8Linear, KimiFP8Experts)) for _, m in mods):
        raise ValueError("model is already FP8-quantized; call dequantize_model_ first to re-quantize")
    for name, m in mods:
        if not name or _skipped(name, modules_to_not_convert):
            continue
        if type(m) is nn.Linear:
            model.set_submodule(name, KimiFP8Linear.from_linear(m, block_size))
        elif type(m) is KimiExperts:
            model.set_submodule(name, KimiFP8Experts.from_experts(m, block_size))
    if getattr(model, "config", None) is not None:
        model.config.quantization_config = fp8_quantization_config(block_size, modules_to_not_convert)
    return model


def dequantize_model_(model: nn.Module) -> nn.Module:
    """The inverse of :func:`quantize_model_fp8_` in place: FP8 modules back to ``nn.Linear`` / ``KimiExperts`` in
    their ``compute_dtype`` (the bf16 copy to merge LoRA adapters into). Works under PEFT wrappers (replaces their
    ``base_layer``). Removes ``config.quantization_config``. Returns ``model``."""
    for name, m in list(model.named_modules()):
        if isinstance(m, KimiFP8Linear):
            model.set_submodule(name, m.to_linear())
        elif isinstance(m, KimiFP8Experts):
            model.set_submodule(name, m.to_experts())
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config
    return model


def fp8_quantization_config(block_size: Sequence[int] = DEFAULT_BLOCK_SIZE,
                            modules_to_not_convert: Sequence[str] = DEFAULT_NOT_CONVERTED) -> dict:
    """The ``quantization_config`` dict of a model quantized by :func:`quantize_model_fp8_`, in transformers'
    ``FineGrainedFP8Config`` schema (``quant_method="fp8"``, dynamic activations, fp32 scales)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(_check_block(block_size)),
            "modules_to_not_convert": list(modules_to_not_convert)}

