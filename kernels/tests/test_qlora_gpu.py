"""QLoRA on CUDA: the FP8 base (``kimi_hybrid.quantization_kimi_hybrid``) in bf16 on the GPU against its dequantized
reference, and a LoRA step (``kimi_hybrid.app.qlora``) with gradient checkpointing. Skips without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
peft = pytest.importorskip("peft")

from peft import get_peft_model  # noqa: E402

from kimi_hybrid import KimiHybridForCausalLM  # noqa: E402
from kimi_hybrid.app.lora import enable_gradient_checkpointing  # noqa: E402
from kimi_hybrid.app.qlora import qlora_config  # noqa: E402
from kimi_hybrid.quantization_kimi_hybrid import FP8_DTYPE, dequantize_model_, quantize_model_fp8_  # noqa: E402
from presets import preset_config  # noqa: E402


def _model(preset="tiny-kda-first"):
    torch.manual_seed(0)
    return KimiHybridForCausalLM(preset_config(preset)).to("cuda", torch.bfloat16).eval()


@pytest.mark.parametrize("preset", ["tiny-kda-first", "tiny-k3"])
def test_fp8_model_matches_dequantized_reference_cuda(preset):
    """bf16 on CUDA: the FP8 model vs the same model with the dequantized weights (both bf16; 2e-2 relative:
    bf16 rounding of the one-matrix-at-a-time products) and vs the CPU fp32 run of the FP8 model (3e-2)."""
    q = quantize_model_fp8_(_model(preset), block_size=(16, 16))
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(3)).cuda()
    with torch.no_grad():
        out = q(ids).logits.float()
        deq = dequantize_model_(copy.deepcopy(q))(ids).logits.float()
        cpu = copy.deepcopy(q).to("cpu", torch.float32)(ids.cpu()).logits
    assert ((out - deq).norm() / deq.norm()).item() < 2e-2
    assert ((out.cpu() - cpu).norm() / cpu.norm()).item() < 3e-2


def test_qlora_step_cuda():
    """One AdamW step with checkpointing on the GPU: adapter gradients finite and non-zero, FP8 base frozen."""
    q = quantize_model_fp8_(_model(), block_size=(16, 16))
    p = get_peft_model(q, qlora_config(q.config, r=4, alpha=8, init_lora_weights=False))
    enable_gradient_checkpointing(p)
    p.train()
    ids = torch.randint(3, 128, (2, 64), generator=torch.Generator().manual_seed(4)).cuda()
    loss = p(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    grads = [t.grad for t in p.parameters() if t.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0
    assert not any(t.requires_grad for t in p.parameters() if t.dtype == FP8_DTYPE)
