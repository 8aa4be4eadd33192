"""The tensor- and expert-parallel plans the model declares (``KimiHybridConfig.base_model_tp_plan`` /
``base_model_ep_plan``, ``KimiHybridForCausalLM._tp_plan``) name real parameters and modules, shard every routed
expert weight, use the sharding each tensor's layout needs, and give the unsharded model's logits when transformers
applies them: 2 CPU processes (gloo) under ``torchrun``, fp32, max abs logit difference <= 1e-5 (measured ~4e-7).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from presets import TINY_PRESETS, preset_config

ROOT = Path(__file__).resolve().parents[1]
needs_dist = pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")


def _plan_style(name, plan, is_weight=True):
    """The style transformers gives ``name`` under ``plan`` (transformers' own matcher)."""
    try:
        from transformers.distributed.parallel_utils import _get_parameter_plan
    except ImportError:  # transformers 5.17: the same matcher under its TP name
        from transformers.distributed.tensor_parallel import _get_parameter_tp_plan as _get_parameter_plan

    return _get_parameter_plan(name, plan, is_weight=is_weight)


def _has_expert_dispatch() -> bool:
    """Whether the installed transformers applies expert-parallel plans (5.23 / 5.24 yes, 5.17 no: no plan is
    declared there)."""
    from kimi_hybrid.configuration_kimi_hybrid import _expert_parallel_plan

    return _expert_parallel_plan() is not None


needs_ep = pytest.mark.skipif(not _has_expert_dispatch(), reason="this transformers has no expert dispatch: the model "
                              "declares no expert-parallel plan here")


def _model(preset, **over):
    from kimi_hybrid import KimiHybridForCausalLM

    cfg = preset_config(preset)
    for k, v in over.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return KimiHybridForCausalLM(cfg)


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
@pytest.mark.parametrize("which", ["tp_plan", "ep_plan"])
def test_every_plan_entry_names_a_real_parameter_or_module(preset, which):
    if which == "ep_plan" and not _has_expert_dispatch():
        pytest.skip("this transformers has no expert dispatch: the model declares no expert-parallel plan here")
    model = _model(preset)
    plan = getattr(model, which)
    assert plan, f"{which} is empty"
    params = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    for pattern in plan:
        hit = any(_plan_style(p, {pattern: "x"}) for p in params) or any(
            _plan_style(m, {pattern: "x"}, is_weight=False) for m in modules)
        # K3 presets without shared experts / dense layers would leave entries unused; every tiny preset has both
        assert hit, f"{which} entry {pattern!r} matches nothing in {preset}"


@pytest.mark.parametrize("preset", sorted(TINY_PRESETS))
def test_plans_shard_every_routed_expert_weight_with_the_styles_their_layout_needs(preset):
    from kimi_hybrid.moe_kimi_hybrid import KimiExperts

    model = _model(preset)
    tp, ep = model.tp_plan, (model.ep_plan if _has_expert_dispatch() else None)
    experts = [(n, m) for n, m in model.named_modules() if isinstance(m, KimiExperts)]
    assert experts
    for name, mod in experts:
        E, F2, D = mod.gate_up_proj.shape
        assert mod.down_proj.shape == (E, D, F2 // 2)
        # gate_up [E, 2F, D] holds the gate rows then the up rows on dim 1: `packed_colwise` splits dim ndim-2 = 1 in
        # two strided halves (each rank: its gate slice | its up slice); down [E, D, F] splits F, its last dim
        # (`rowwise` shards dim -1); the experts module sums the ranks' partial outputs
        assert _plan_style(f"{name}.gate_up_proj", tp) == "packed_colwise"
        assert _plan_style(f"{name}.down_proj", tp) == "rowwise"
        assert _plan_style(name, tp, is_weight=False) == "moe_tp_experts"
        if ep is not None:  # EP: whole experts per rank (dim 0)
            assert _plan_style(f"{name}.gate_up_proj", ep) == "grouped_gemm"
            assert _plan_style(f"{name}.down_proj", ep) == "grouped_gemm"
    # plain linears: colwise splits out_features (gate / up), rowwise in_features (down)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            style = _plan_style(f"{name}.weight", tp)
            if name.endswith(("gate_proj", "up_proj")) and ".mlp." in name and "routed_expert" not in name:
                assert style == "colwise", name
            elif name.endswith(".mlp.down_proj") or name.endswith("shared_experts.down_proj"):
                assert style == "rowwise", name
            elif name == "lm_head":
                assert style == "colwise_gather_output"
            else:  # attention, routers, K3 latent projections and AttnRes stay replicated
                assert style is None, (name, style)


def test_tied_head_keeps_its_own_entry():
    model = _model("tiny-kda-first", tie_word_embeddings=True)
    assert model.tp_plan["lm_head"] == "colwise_gather_output"
    if _has_expert_dispatch():  # (the releases that add the embedding's entry themselves; 5.17 does not)
        assert model.tp_plan["model.embed_tokens"] == "embedding_rowwise"


def test_expert_width_comes_from_the_weights_not_the_config():
    """A tensor-parallel rank holds gate_up [E, 2F/tp, D] (its gate slice | its up slice) and down [E, D, F/tp]: the
    experts must split gate / up at half the width they hold. Here: the sum over two such halves of the expert
    outputs (what ``moe_tp_experts`` all-reduces) equals the unsharded output, on every expert implementation."""
    from kimi_hybrid.moe_kimi_hybrid import KimiExperts

    cfg = preset_config("tiny-kda-first")
    torch.manual_seed(0)
    full = KimiExperts(cfg, cfg.hidden_size)
    torch.nn.init.normal_(full.gate_up_proj, std=0.2)
    torch.nn.init.normal_(full.down_proj, std=0.2)
    F = cfg.moe_intermediate_size
    x = torch.randn(7, cfg.hidden_size)
    idx = torch.randint(0, cfg.num_experts, (7, 2))
    w = torch.rand(7, 2)
    for impl in ("eager", "batched_mm", "grouped_mm"):
        cfg._experts_implementation = impl
        want = full(x, idx, w)
        got = torch.zeros_like(want)
        for r in range(2):
            part = KimiExperts(cfg, cfg.hidden_size)
            rows = torch.cat([torch.arange(r * F // 2, (r + 1) * F // 2), F + torch.arange(r * F // 2, (r + 1) * F // 2)])
            part.gate_up_proj = torch.nn.Parameter(full.gate_up_proj.detach()[:, rows].clone())
            part.down_proj = torch.nn.Parameter(full.down_proj.detach()[:, :, r * F // 2:(r + 1) * F // 2].clone())
            got += part(x, idx, w)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=impl)
    cfg._experts_implementation = "eager"


def test_expert_parallel_sentinel_routes_are_dropped():
    """Under expert parallelism transformers hands each rank its local experts' ids and marks routes to another
    rank's experts with the id ``num_experts`` (local count) and weight 0: they must add nothing, not index out of
    range."""
    from kimi_hybrid.moe_kimi_hybrid import KimiExperts

    cfg = preset_config("tiny-kda-first")
    torch.manual_seed(0)
    ex = KimiExperts(cfg, cfg.hidden_size)
    torch.nn.init.normal_(ex.gate_up_proj, std=0.2)
    torch.nn.init.normal_(ex.down_proj, std=0.2)
    x = torch.randn(5, cfg.hidden_size)
    idx = torch.tensor([[1, 3], [0, 2], [5, 4], [7, 6], [2, 2]])
    w = torch.rand(5, 2)
    local = KimiExperts(cfg, cfg.hidden_size)  # experts 0..3 of 8, as MoEParamShard leaves rank 0
    local.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.detach()[:4].clone())
    local.down_proj = torch.nn.Parameter(ex.down_proj.detach()[:4].clone())
    local.num_experts, local._is_expert_parallel = 4, True
    off = idx >= 4
    got = local(x, torch.where(off, 4, idx), w.masked_fill(off, 0.0))
    want = ex(x, idx, w.masked_fill(off, 0.0))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_dist
@pytest.mark.parametrize("kind,preset,impl", [("tp", "tiny-k3", "eager"), ("tp", "tiny-kda-first", "batched_mm"),
                                              ("ep", "tiny-kda-first", "eager")])
def test_parallel_forward_equals_the_unsharded_model(tmp_path, kind, preset, impl):
    if kind == "ep" and not _has_expert_dispatch():
        pytest.skip("this transformers has no expert dispatch: the model declares no expert-parallel plan here")
    model = _model(preset, tie_word_embeddings=(kind == "tp" and impl == "eager"))
    model.save_pretrained(tmp_path / "m")
    out = tmp_path / "out.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for attempt in range(2):  # a second try on a fresh port: the free port picked here can be taken meanwhile
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(_port()),
               str(ROOT / "tests" / "parallel_plan_worker.py"), str(tmp_path / "m"), kind, impl, str(out)]
        res = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=300)
        if res.returncode == 0:
            break
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    rep = json.loads(out.read_text())
    assert rep["max_abs_diff"] <= 1e-5, rep
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in rep["sharded"]), rep["sharded"]
    assert any(n.endswith("mlp.experts.down_proj") for n in rep["sharded"]), rep["sharded"]
    if kind == "tp":
        assert "lm_head.weight" in rep["sharded"] or "model.embed_tokens.weight" in rep["sharded"]
