"""Synthetic checkpoints for the conversion tests, written by hand from the published layouts
(docs/checkpoint-format.md section 2, docs/k3.md sections 6-7) -- deliberately NOT through the converter's
own plan code, so that a naming mistake in the converter cannot hide behind the same mistake in the fixture.
Files are written with the `safetensors` library (an implementation independent of ours).
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_released_config(**over) -> dict:
    """A 4-layer released-format config.json: KDA, KDA, MLA, KDA (1-based lists), layer 0 dense, 4 experts."""
    cfg = {
        "architectures": ["KimiLinearForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_kimi.KimiLinearConfig",
                     "AutoModel": "modeling_kimi.KimiLinearModel",
                     "AutoModelForCausalLM": "modeling_kimi.KimiLinearForCausalLM"},
        "bos_token_id": 1, "dtype": "bfloat16", "eos_token_id": 2, "first_k_dense_replace": 1, "head_dim": 16,
        "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 48,
        "kv_lora_rank": 8,
        "linear_attn_config": {"full_attn_layers": [3], "head_dim": 8, "kda_layers": [1, 2, 4], "num_heads": 2,
                               "short_conv_kernel_size": 4},
        "mla_use_nope": True, "model_max_length": 4096, "model_type": "kimi_linear", "moe_intermediate_size": 8,
        "moe_layer_freq": 1, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
        "num_attention_heads": 2, "num_expert_group": 1, "num_experts": 4, "num_experts_per_token": 2,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "num_nextn_predict_layers": 0, "num_shared_experts": 1,
        "pad_token_id": 0, "q_lora_rank": None, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "rms_norm_eps": 1e-5,
        "rope_scaling": None, "rope_theta": 10000.0, "routed_scaling_factor": 2.446, "tie_word_embeddings": False,
        "topk_group": 1, "transformers_version": "4.57.0", "use_cache": True, "use_grouped_topk": True,
        "v_head_dim": 8, "vocab_size": 64,
    }
    cfg.update(over)
    return cfg


def released_tensors(cfg: dict, seed: int = 0, bias_dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of a released Kimi-Linear checkpoint for `cfg`, in the released names / shapes / dtypes."""
    g = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16

    def r(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype)

    D, V = cfg["hidden_size"], cfg["vocab_size"]
    lac = cfg["linear_attn_config"]
    H, d, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = H * d
    Hm, nope, rope, v, rkv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                              cfg["v_head_dim"], cfg["kv_lora_rank"])
    E, F, S = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_shared_experts"]
    t = {"model.embed_tokens.weight": r(V, D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = r(D)
        t[p + "post_attention_layernorm.weight"] = r(D)
        if (i + 1) in lac["kda_layers"]:
            a = p + "self_attn."
            for n in "qkv":
                t[a + f"{n}_proj.weight"] = r(P, D)
                t[a + f"{n}_conv1d.weight"] = r(P, 1, K)
            t[a + "A_log"] = r(1, 1, H, 1, dtype=torch.float32)
            t[a + "dt_bias"] = r(P, dtype=torch.float32)
            t[a + "f_a_proj.weight"] = r(d, D)
            t[a + "f_b_proj.weight"] = r(P, d)
            t[a + "b_proj.weight"] = r(H, D)
            t[a + "g_a_proj.weight"] = r(d, D)
            t[a + "g_b_proj.weight"] = r(P, d)
            t[a + "o_norm.weight"] = r(d)
            t[a + "o_proj.weight"] = r(D, P)
        else:
            a = p + "self_attn."
            t[a + "q_proj.weight"] = r(Hm * (nope + rope), D)
            t[a + "kv_a_proj_with_mqa.weight"] = r(rkv + rope, D)
            t[a + "kv_a_layernorm.weight"] = r(rkv)
            t[a + "kv_b_proj.weight"] = r(Hm * (nope + v), rkv)
            t[a + "o_proj.weight"] = r(D, Hm * v)
        if i < cfg["first_k_dense_replace"]:
            Fd = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = r(Fd, D)
            t[p + "mlp.up_proj.weight"] = r(Fd, D)
            t[p + "mlp.down_proj.weight"] = r(D, Fd)
        else:
            m = p + "block_sparse_moe."
            t[m + "gate.weight"] = r(E, D)
            t[m + "gate.e_score_correction_bias"] = r(E, dtype=bias_dtype)
            for e in range(E):
                t[m + f"experts.{e}.w1.weight"] = r(F, D)
                t[m + f"experts.{e}.w2.weight"] = r(D, F)
                t[m + f"experts.{e}.w3.weight"] = r(F, D)
            t[m + "shared_experts.gate_proj.weight"] = r(F * S, D)
            t[m + "shared_experts.up_proj.weight"] = r(F * S, D)
            t[m + "shared_experts.down_proj.weight"] = r(D, F * S)
    t["model.norm.weight"] = r(D)
    t["lm_head.weight"] = r(V, D)
    return t


def write_checkpoint(folder: str, config: dict, tensors: dict[str, torch.Tensor], shards: list[list[str]] | int = 1,
                     side_files: bool = True) -> list[str]:
    """Write config.json, the shards (a list of key lists, or a count: split in key order by bytes) and the index.

    Returns the shard file names."""
    os.makedirs(folder, exist_ok=True)
    keys = list(tensors)
    if isinstance(shards, int):
        n = shards
        total = sum(x.numel() * x.element_size() for x in tensors.values())
        groups, acc = [[] for _ in range(n)], 0
        for k in keys:
            j = min(n - 1, acc * n // max(total, 1))
            groups[j].append(k)
            acc += tensors[k].numel() * tensors[k].element_size()
        shards = [gr for gr in groups if gr]
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for name, ks in zip(names, shards):
        save_file({k: tensors[k].contiguous() for k in ks}, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in ks})
    total = sum(x.numel() * x.element_size() for x in tensors.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if side_files:
        with open(os.path.join(folder, "tiktoken.model"), "wb") as f:
            f.write(b"IQ== 0\nIg== 1\n")
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "[BOS]", "eos_token": "<|im_end|>"}, f)
        with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
            f.write("{% for m in messages %}<|im_{{m.role}}|>{{m.content}}<|im_end|>{% endfor %}")
        with open(os.path.join(folder, "generation_config.json"), "w") as f:
            json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return names


def split_experts_across_shards(cfg: dict, tensors: dict[str, torch.Tensor]) -> list[list[str]]:
    """Two shards whose boundary falls inside layer 1's experts (experts 0..E/2-1 w1/w2 in shard 1, the rest --
    including expert 0's w3 -- in shard 2), like the released index does for big layers."""
    keys = list(tensors)
    cut = keys.index("model.layers.1.block_sparse_moe.experts.0.w3.weight")
    first = keys[:cut] + [f"model.layers.1.block_sparse_moe.experts.{e}.w{w}.weight"
                          for e in range(1, cfg["num_experts"] // 2) for w in (1, 2)]
    second = [k for k in keys if k not in set(first)]
    return [first, second]


def read_all(folder: str) -> dict[str, torch.Tensor]:
    """Read every tensor of a checkpoint folder with the safetensors library."""
    from safetensors import safe_open

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        wm = json.load(f)["weight_map"]
    out = {}
    for shard in sorted(set(wm.values())):
        with safe_open(os.path.join(folder, shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    assert set(out) == set(wm), "index and shards disagree"
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bytes(a.contiguous().reshape(-1).view(torch.uint8).numpy()) == bytes(
        b.contiguous().reshape(-1).view(torch.uint8).numpy())


# ----------------------------------------------------------------------------------------------------------------
# Kimi K3
# ----------------------------------------------------------------------------------------------------------------

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def tiny_k3_config() -> dict:
    text = tiny_released_config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=4, moe_intermediate_size=32, num_experts=4,
        num_shared_experts=2, q_lora_rank=16, hidden_act="situ", routed_scaling_factor=1.0,
        linear_attn_config={"full_attn_layers": [3, 4], "head_dim": 16, "kda_layers": [1, 2], "num_heads": 2,
                            "short_conv_kernel_size": 4, "gate_lower_bound": -5.0, "use_full_rank_gate": True},
        max_position_embeddings=4096,
    )
    for k in ("auto_map", "model_max_length", "transformers_version"):
        text.pop(k)
    text.update({"mla_use_output_gate": True, "routed_expert_hidden_size": 32, "latent_moe_use_norm": True,
                 "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0, "attn_res_block_size": 2,
                 "topk_method": "noaux_tc"})
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "media_placeholder_token_id": 5,
        "text_config": text,
        "vision_config": {"hidden_size": 16, "num_hidden_layers": 1},
        "quantization_config": {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"},
    }


def mxfp4_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes uint8 [out, in] in 0..15 -> packed [out, in/2], low nibble = even column."""
    out = torch.empty(codes.shape[0], codes.shape[1] // 2, dtype=torch.uint8)
    out[:] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return out


def mxfp4_reference_element(packed: torch.Tensor, scale: torch.Tensor, o: int, c: int) -> float:
    """One element, restated from the spec: nibble of byte c//2 (low = even c), sign bit 3, E2M1 magnitude,
    times 2**(scale[o, c//32] - 127)."""
    byte = int(packed[o, c // 2])
    nib = (byte >> 4) if (c % 2) else (byte & 0x0F)
    sign = -1.0 if nib & 0x8 else 1.0
    return sign * E2M1[nib & 0x7] * 2.0 ** (int(scale[o, c // 32]) - 127)


def k3_tensors(k3: dict, seed: int = 0, a_log_tail_zero: bool = True, mxfp4: bool = True) -> dict[str, torch.Tensor]:
    """Tensors of a K3 checkpoint (text backbone with `language_model.` prefix, MXFP4 experts, vision keys)."""
    cfg = k3["text_config"]
    g = torch.Generator().manual_seed(seed)
    bf, f32 = torch.bfloat16, torch.float32

    def r(*shape, dtype=bf):
        return torch.randn(*shape, generator=g).to(dtype)

    D, V = cfg["hidden_size"], cfg["vocab_size"]
    lac = cfg["linear_attn_config"]
    H, d, K = lac["num_heads"], lac["head_dim"], lac["short_conv_kernel_size"]
    P = H * d
    Hm, nope, rope, v, rkv, rq = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                                  cfg["v_head_dim"], cfg["kv_lora_rank"], cfg["q_lora_rank"])
    E, F, S, L = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["num_shared_experts"], cfg["routed_expert_hidden_size"]
    pre = "language_model.model."
    t = {pre + "embed_tokens.weight": r(V, D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{pre}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm", "self_attention_res_norm", "mlp_res_norm"):
            t[p + n + ".weight"] = r(D)
        t[p + "self_attention_res_proj.weight"] = r(1, D)
        t[p + "mlp_res_proj.weight"] = r(1, D)
        a = p + "self_attn."
        if (i + 1) in lac["kda_layers"]:
            for n in "qkv":
                t[a + f"{n}_proj.weight"] = r(P, D)
                t[a + f"{n}_conv1d.weight"] = r(P, 1, K, dtype=f32)
            t[a + "f_a_proj.weight"] = r(d, D)
            t[a + "f_b_proj.weight"] = r(P, d)
            alog = torch.zeros(128, dtype=f32)
            alog[:H] = r(H, dtype=f32)
            if not a_log_tail_zero:
                alog[H + 3] = 1e-3
            t[a + "A_log"] = alog
            t[a + "dt_bias"] = r(P, dtype=f32)
            t[a + "b_proj.weight"] = r(H, D)
            t[a + "g_proj.weight"] = r(P, D)
            t[a + "o_norm.weight"] = r(d, dtype=f32)
            t[a + "o_proj.weight"] = r(D, P)
        else:
            t[a + "q_a_proj.weight"] = r(rq, D)
            t[a + "q_a_layernorm.weight"] = r(rq)
            t[a + "q_b_proj.weight"] = r(Hm * (nope + rope), rq)
            t[a + "kv_a_proj_with_mqa.weight"] = r(rkv + rope, D)
            t[a + "kv_a_layernorm.weight"] = r(rkv)
            t[a + "kv_b_proj.weight"] = r(Hm * (nope + v), rkv)
            t[a + "o_proj.weight"] = r(D, Hm * v)
            t[a + "g_proj.weight"] = r(Hm * v, D)
        if i == 0:
            Fd = cfg["intermediate_size"]
            t[p + "mlp.gate_proj.weight"] = r(Fd, D)
            t[p + "mlp.up_proj.weight"] = r(Fd, D)
            t[p + "mlp.down_proj.weight"] = r(D, Fd)
        else:
            m = p + "block_sparse_moe."
            t[m + "gate.weight"] = r(E, D)
            t[m + "gate.e_score_correction_bias"] = r(E, dtype=f32)
            t[m + "routed_expert_down_proj.weight"] = r(L, D)
            t[m + "routed_expert_norm.weight"] = r(L)
            t[m + "routed_expert_up_proj.weight"] = r(D, L)
            for e in range(E):
                for w, (o, n_in) in (("w1", (F, L)), ("w2", (L, F)), ("w3", (F, L))):
                    if mxfp4:
                        codes = torch.randint(0, 16, (o, n_in), generator=g, dtype=torch.uint8)
                        t[m + f"experts.{e}.{w}.weight_packed"] = mxfp4_pack(codes)
                        t[m + f"experts.{e}.{w}.weight_scale"] = torch.randint(112, 123, (o, n_in // 32), generator=g,
                                                                               dtype=torch.uint8)
                    else:
                        t[m + f"experts.{e}.{w}.weight"] = r(o, n_in)
            t[m + "shared_experts.gate_proj.weight"] = r(F * S, D)
            t[m + "shared_experts.up_proj.weight"] = r(F * S, D)
            t[m + "shared_experts.down_proj.weight"] = r(D, F * S)
    t[pre + "norm.weight"] = r(D)
    t[pre + "output_attn_res_norm.weight"] = r(D)
    t[pre + "output_attn_res_proj.weight"] = r(1, D)
    t["language_model.lm_head.weight"] = r(V, D)
    t["vision_tower.patch_embed.proj.weight"] = r(16, 3, 2, 2)
    t["vision_tower.blocks.0.attn.qkv.weight"] = r(48, 16)
    t["vision_tower.blocks.0.mlp.fc1.weight"] = r(32, 16)
    t["mm_projector.proj.0.weight"] = r(D, 16)
    t["mm_projector.proj.2.weight"] = r(D, D)
    return t


def released_config_dict(cfg) -> dict:
    """A ``KimiHybridConfig`` written back in the released Kimi-Linear ``config.json`` form (model_type
    "kimi_linear", 1-based layer lists, ``model_max_length``, ``dtype``), as the round-trip tests need it."""
    d = cfg.to_dict()
    for k in ("layer_types", "mlp_layer_types", "mla_absorb_max_q_len", "kda_record_max_tokens",
              "auto_map", "architectures", "transformers_version", "torch_dtype", "dtype"):
        d.pop(k, None)
    d["model_type"] = "kimi_linear"
    d["rope_theta"] = d.pop("released_rope_theta", 10000.0)
    d["rope_scaling"] = d.pop("released_rope_scaling", None)
    d["architectures"] = ["KimiLinearForCausalLM"]
    d["model_max_length"] = d.pop("max_position_embeddings")
    d["dtype"] = str(getattr(cfg, "dtype", None) or "bfloat16").replace("torch.", "")
    return d
