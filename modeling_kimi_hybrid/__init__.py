"""kimi-hybrid: Kimi-Linear-48B-A3B and the Kimi K3 text backbone for Hugging Face transformers.

Importing the package registers ``KimiHybridConfig`` / ``KimiHybridForCausalLM`` (``model_type = "kimi_hybrid"``)
with ``AutoConfig``, ``AutoModel`` and ``AutoModelForCausalLM`` (and the tokenizer with ``AutoTokenizer`` when it
is present), so ``from_pretrained`` works without ``trust_remote_code`` once the package is installed.
"""

import os as _os
import sys as _sys


def _quiet_interrupt_while_starting() -> None:
    """For the ``kimi-hybrid`` / ``kimi-hybrid-convert`` commands only: Ctrl-C while the heavy imports below run
    (torch, transformers: seconds) ends with one line and status 130 instead of an import traceback. The command's
    ``main`` puts Python's own handler back first thing."""
    import signal

    def stop(signum, frame):
        _sys.stderr.write(f"\n{_os.path.basename(_sys.argv[0])}: interrupted\n")
        _os._exit(130)

    signal.signal(signal.SIGINT, stop)


if _os.path.basename(_sys.argv[0] if _sys.argv else "") in ("kimi-hybrid", "kimi-hybrid-convert"):
    _quiet_interrupt_while_starting()

from .cache_kimi_hybrid import KimiHybridCache  # noqa: E402
from .configuration_kimi_hybrid import KimiHybridConfig  # noqa: E402
from .modeling_kimi_hybrid import KimiHybridForCausalLM, KimiHybridModel, KimiHybridPreTrainedModel  # noqa: E402

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
