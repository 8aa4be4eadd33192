"""kimi-hybrid: Kimi-Linear-48B-A3B and the Kimi K3 text backbone for Hugging Face transformers.

Importing the package registers ``KimiHybridConfig`` / ``KimiHybridForCausalLM`` (``model_type = "kimi_hybrid"``)
with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` (and the tokenizer with ``AutoTokenizer`` when it
is present), so ``from_pretrained`` works without ``trust_remote_code`` once the package is installed.
"""

from .cache_kimi_hybrid import KimiHybridCache
from .configuration_kimi_hybrid import KimiHybridConfig
from .modeling_kimi_hybrid import KimiHybridForCausalLM, KimiHybridModel, KimiHybridPreTrainedModel

__version__ = "0.1.0"


def register() -> None:
    """Register our classes with the transformers Auto classes (idempotent)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    AutoConfig.register("kimi_hybrid", KimiHybridConfig, exist_ok=True)
    AutoModel.register(KimiHybridConfig, KimiHybridModel, exist_ok=True)
    AutoModelForCausalLM.register(KimiHybridConfig, KimiHybridForCausalLM, exist_ok=True)
    KimiHybridConfig.register_for_auto_class()
    KimiHybridForCausalLM.register_for_auto_class("AutoModelForCausalLM")
    KimiHybridModel.register_for_auto_class("AutoModel")
    try:
        from .tokenization_kimi_hybrid import register_tokenizer
    except ImportError:
        return
    register_tokenizer()


register()

__all__ = ["KimiHybridCache", "KimiHybridConfig", "KimiHybridForCausalLM", "KimiHybridModel",
           "KimiHybridPreTrainedModel", "register"]
