# coding=utf-8
"""The KimiHybrid KDA layer (:class:`KimiDeltaAttention`): projections, the fused causal short conv, the decay gate,
the delta-rule kernels of ``kda_kimi_hybrid`` and the gated output norm; its states are read and written through the
cache interface (``cache_view_kimi_hybrid``). Also :func:`direct_weight`, the adapter guard of fused weight reads.
"""

from typing import Optional

import torch
import torch.nn as nn

try:
    from transformers.integrations.accelerate import force_accelerate_hooks
except ImportError:  # pragma: no cover
    def force_accelerate_hooks(names):  # noqa: D103 - no accelerate hooks to fire
        return lambda fn: fn

from .cache_kimi_hybrid import KimiHybridCache
from .compat_kimi_hybrid import compiling as _compiling
from .configuration_kimi_hybrid import KimiHybridConfig
from .kda_kimi_hybrid import kda_chunk, kda_gate, kda_recurrent, short_conv, short_conv_update
from .norms_kimi_hybrid import KimiGatedRMSNorm


# ----------------------------------------------------------------------------------------------------------------
# the adapter guard of fused weight reads
# ----------------------------------------------------------------------------------------------------------------

def direct_weight(module: nn.Module, name: str, why: str) -> torch.Tensor:
    """``module.weight`` for code that reads a weight directly instead of calling the module (fused kernels).
    Raises ValueError when the module is wrapped by a PEFT tuner layer (LoRA, ...): its extra path would be silently
    skipped. A ``modules_to_save`` wrapper is fine (its ``weight`` is the trained copy)."""
    if type(module).__module__.startswith("peft.tuners"):
        raise ValueError(
            f"{name} is wrapped by a PEFT adapter ({type(module).__name__}), but the model reads its weight directly "
            f"({why}), so the adapter would be silently ignored. Leave {name} out of target_modules "
            "(list the modules to adapt by name; with target_modules='all-linear' add "
            f"exclude_modules=[...'{name}']); to train it, list it in modules_to_save instead.")
    return module.weight


# ----------------------------------------------------------------------------------------------------------------
# KDA
# ----------------------------------------------------------------------------------------------------------------

def _compact(mask: torch.Tensor):
    """Stable permutation that moves the real tokens of each row to the front. ``mask [B, T]`` bool.
    Returns ``(perm [B, T], lengths [B])``."""
    perm = (~mask).to(torch.int8).argsort(dim=1, stable=True)
    return perm, mask.sum(1)


class KimiDeltaAttention(nn.Module):
    """Kimi Delta Attention layer (checkpoint keys: see docs/LAYOUT.md).

    ``q/k/v_proj`` (D -> P = H*K), causal depthwise short conv + SiLU on each (kernel W), decay gate from the rank-K
    bottleneck ``f_b_proj(f_a_proj(x))`` (Kimi-Linear softplus form, or K3 ``gate_lower_bound`` form), beta =
    sigmoid(b_proj(x)) in fp32, L2-normalised q/k in the kernel, fp32 state ``[B, H, K, V]``, gated RMSNorm with
    gate ``g_b_proj(g_a_proj(x))`` (or K3 full-rank ``g_proj(x)``), ``o_proj`` (P -> D).

    Padding (``token_mask [B, T]``, False = pad): each row's real tokens are moved to the front, the pads at the tail
    get k = 0, beta = 0, g = 0 (no state change) and never enter the conv window, and outputs are scattered back
    (pads output 0). Left, right and interior padding therefore leave every state as without the pads.
    Packing (``cu_seqlens`` over the flattened tokens): conv windows and states restart at every boundary.
    """

    def __init__(self, config: KimiHybridConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        D = config.hidden_size
        H, K = config.linear_num_heads, config.linear_head_dim
        self.num_heads, self.head_dim, self.proj_dim = H, K, H * K
        W = config.linear_conv_kernel_size
        self.conv_kernel_size = W
        P = self.proj_dim
        self.q_proj = nn.Linear(D, P, bias=False)
        self.k_proj = nn.Linear(D, P, bias=False)
        self.v_proj = nn.Linear(D, P, bias=False)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, padding=W - 1, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, padding=W - 1, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, padding=W - 1, bias=False)
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, P, bias=False)
        self.A_log = nn.Parameter(torch.empty(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(P, dtype=torch.float32))
        self.b_proj = nn.Linear(D, H, bias=False)
        if config.use_full_rank_gate:
            self.g_proj = nn.Linear(D, P, bias=False)
        else:
            self.g_a_proj = nn.Linear(D, K, bias=False)
            self.g_b_proj = nn.Linear(K, P, bias=False)
        self.o_norm = KimiGatedRMSNorm(K, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(P, D, bias=False)

    def conv_weight(self) -> torch.Tensor:
        """The three depthwise kernels fused: ``[3P, W]`` (q | k | v channels). Without autograd the fused copy is
        kept and rebuilt only when a kernel changes (another tensor, device or dtype, or an in-place write: the
        key holds each weight's storage address and version counter); with autograd (training) and under
        torch.compile it is concatenated on every call. A PEFT-wrapped conv is refused (:func:`direct_weight`)."""
        why = "the causal short conv runs as one fused kernel over q | k | v"
        ws = [direct_weight(m, n, why) for m, n in ((self.q_conv1d, "q_conv1d"), (self.k_conv1d, "k_conv1d"),
                                                     (self.v_conv1d, "v_conv1d"))]
        if _compiling() or (torch.is_grad_enabled() and any(w.requires_grad for w in ws)):
            return torch.cat(ws, 0).squeeze(1)
        key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in ws)
        kept = self.__dict__.get("_fused_conv")
        if kept is None or kept[0] != key:
            kept = (key, torch.cat(ws, 0).squeeze(1))
            self.__dict__["_fused_conv"] = kept
        return kept[1]

    # the conv kernels are read directly (conv_weight), never through the conv modules: fire their accelerate hooks
    # so CPU / disk offload (device_map) materialises them
    @force_accelerate_hooks(["q_conv1d", "k_conv1d", "v_conv1d"])
    def forward(self, x: torch.Tensor, cache: Optional[KimiHybridCache] = None,
                token_mask: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``x [B, T, D]`` (after input_layernorm) -> ``[B, T, D]``. ``token_mask``: ``[B, T]`` bool (False =
        pad), or ``[B, T, T]`` bool (query t sees key s) from a 4-D attention mask (tree attention)."""
        B, T, _ = x.shape
        if token_mask is not None and token_mask.dim() == 3:
            return self._forward_visible(x, token_mask)
        if cu_seqlens is not None:  # (the model runs packed documents without a cache)
            y = self._forward_core(x.reshape(1, B * T, -1), cu_seqlens=cu_seqlens)
            return y.reshape(B, T, -1)
        if token_mask is None:
            return self._forward_core(x, cache)
        if T == 1:  # one token (decode): nothing to move, the mask is the validity
            y = self._forward_core(x, cache, token_mask, token_mask.sum(1), token_mask=token_mask)
            return y * token_mask.unsqueeze(-1).to(y.dtype)
        perm, lengths = _compact(token_mask)
        xc = x.gather(1, perm.unsqueeze(-1).expand_as(x))
        valid = torch.arange(T, device=x.device).unsqueeze(0) < lengths.unsqueeze(1)
        yc = self._forward_core(xc, cache, valid, lengths, perm=perm, token_mask=token_mask)
        y = torch.zeros_like(yc).scatter(1, perm.unsqueeze(-1).expand_as(yc), yc)
        return y * token_mask.unsqueeze(-1).to(y.dtype)

    def _forward_visible(self, x: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Tree attention (a 4-D mask, e.g. shared-prefix or speculative-tree verification): a recurrence has no
        per-query key set, so each query's output is the layer run over exactly the tokens it sees, in order, from a
        zero state (``visible [B, T, T]`` bool, each row ending at its own query). Exact; costs O(T^2) tokens of
        work, meant for short trees. ``x [B, T, D]`` -> ``[B, T, D]``."""
        B, T, _ = x.shape
        rows = []
        for b in range(B):
            outs = []
            for t in range(T):
                idx = visible[b, t].nonzero().flatten()
                outs.append(self._forward_core(x[b:b + 1, idx])[:, -1])
            rows.append(torch.cat(outs, 0))
        return torch.stack(rows, 0)

    def _forward_core(self, x, cache=None, valid=None, lengths=None, perm=None, token_mask=None, cu_seqlens=None):
        """One KDA pass over ``x [B, T, D]`` (compacted: real tokens first, ``valid [B, T]`` / ``lengths [B]``),
        reading and writing its states through the cache interface. Returns ``[B, T, D]``."""
        B, T, _ = x.shape
        H, K, P = self.num_heads, self.head_dim, self.proj_dim
        conv_state, init_state = cache.kda_states(self.layer_idx) if cache is not None else (None, None)
        x_raw = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, 3P]
        weight = self.conv_weight()
        if conv_state is not None and T == 1:
            y, new_window = short_conv_update(x_raw[:, 0], weight, conv_state)
            y = y.unsqueeze(1)
            if valid is not None:
                new_window = torch.where(valid[:, :1, None], new_window, conv_state)
        else:
            y, new_window = short_conv(x_raw, weight, conv_state, "silu", cu_seqlens)
            if valid is not None and cache is not None:
                new_window = self._window_at(conv_state, x_raw, lengths)
        q, k, v = y.split(P, dim=-1)
        q, k, v = (t.reshape(B, T, H, K) for t in (q, k, v))
        g = kda_gate(self.f_b_proj(self.f_a_proj(x)).view(B, T, H, K), self.A_log, self.dt_bias,
                     self.config.gate_lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if valid is not None:
            vm = valid[..., None, None]
            k = k * vm.to(k.dtype)
            g = g * vm.to(g.dtype)
            beta = beta * valid[..., None].to(beta.dtype)
        beta = beta.to(q.dtype) if q.is_cuda else beta
        recorded = cache is not None and cu_seqlens is None and cache.is_recording_past(self.layer_idx)
        if recorded:
            tokens = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "x": x_raw}
            o, final = cache.kda_run_recorded(self.layer_idx, self._run_with_state, tokens, init_state, conv_state,
                                              perm, token_mask)
        else:
            o, final = self._run_kda(q, k, v, g, beta, init_state, cache is not None, cu_seqlens)
        if cache is not None:
            cache.kda_update(self.layer_idx, new_window, final, recorded=recorded)
        gate = self.g_proj(x) if self.config.use_full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.reshape(B, T, H, K), gate.view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, P))

    def _window_at(self, conv_state, x_raw, lengths):
        """Last W real pre-conv inputs of each row (real tokens are at the front), oldest first: ``[B, C, W]``."""
        B, T, C = x_raw.shape
        W = self.conv_kernel_size
        prev = conv_state if conv_state is not None else x_raw.new_zeros(B, C, W)
        full = torch.cat([prev.to(x_raw.dtype), x_raw.transpose(1, 2)], dim=-1)  # [B, C, W + T]
        idx = lengths.view(B, 1, 1) + torch.arange(W, device=x_raw.device).view(1, 1, W)
        return full.gather(2, idx.expand(B, C, W))

    @staticmethod
    def _run_kda(q, k, v, g, beta, init_state, want_state, cu_seqlens=None):
        """Recurrent kernel for short decode steps from a state (no grad), chunked otherwise."""
        if init_state is not None and q.shape[1] <= 64 and not torch.is_grad_enabled():
            return kda_recurrent(q, k, v, g, beta, initial_state=init_state, output_final_state=want_state)
        return kda_chunk(q, k, v, g, beta, initial_state=init_state, output_final_state=want_state,
                         cu_seqlens=cu_seqlens)

    @classmethod
    def _run_with_state(cls, q, k, v, g, beta, init_state):
        """:meth:`_run_kda` returning the final state (the recorded step's kernel call)."""
        return cls._run_kda(q, k, v, g, beta, init_state, True)
