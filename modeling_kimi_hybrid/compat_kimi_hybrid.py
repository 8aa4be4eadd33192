# coding=utf-8
"""The transformers versions this model is tested with, the API differences inside that window, and the
tracing predicates (``compiling``, ``graph_capturing``) the bundle shares.

Window: transformers 5.17 (the first release with the linear-attention cache layers and the output-capturing
utilities this model builds on) through 5.24. Importing the model (the installed package or the Hub files loaded
with ``trust_remote_code=True``) under an older transformers raises ImportError; under a newer one it warns once with
:class:`KimiHybridVersionWarning`, since a later release may change an API this model relies on.

The cache keyword: transformers 5.24 passes the cache to ``forward`` / ``prepare_inputs_for_generation`` as
``cache`` and stores it in every ``ModelOutput`` as ``cache``; 5.17-5.23 use ``past_key_values``. This model accepts
both names everywhere (giving both is an error; ``past_key_values`` warns as deprecated where transformers does) and
talks to the installed transformers in its own name. The linear-attention state getters
(``Cache.get_conv_state`` / ``get_recurrent_state``) exist from 5.21: :func:`linear_attention_states`.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Optional

import torch
import transformers
from packaging.version import Version
from transformers import GenerationMixin
from transformers.modeling_outputs import CausalLMOutputWithPast

TRANSFORMERS_MIN = "5.17"  # lowest minor release tested (CI runs the test suite on it)
TRANSFORMERS_MAX = "5.24"  # newest minor release tested (any patch release of it)


class KimiHybridVersionWarning(UserWarning):
    """The installed transformers is newer than the newest release this model was tested with."""


def _minor(version: str) -> tuple:
    v = Version(version)
    return (v.major, v.minor)


def check_transformers_version(version: Optional[str] = None) -> None:
    """Check ``version`` (default: the installed transformers) against the tested window.

    Raises:
        ImportError: older than :data:`TRANSFORMERS_MIN` (the cache layers / output capturing used here are missing).
    Warns:
        KimiHybridVersionWarning: newer than the :data:`TRANSFORMERS_MAX` minor release (untested: outputs may differ
            if transformers changed an API again; the message says which versions are tested).
    """
    version = version or transformers.__version__
    have = _minor(version)
    if have < _minor(TRANSFORMERS_MIN):
        raise ImportError(
            f"kimi-hybrid needs transformers >= {TRANSFORMERS_MIN} (found {version}): older releases lack the "
            f"linear-attention cache layers it builds on. Upgrade: pip install 'transformers>={TRANSFORMERS_MIN},<6'")
    if have > _minor(TRANSFORMERS_MAX):
        warnings.warn(
            f"kimi-hybrid is tested with transformers {TRANSFORMERS_MIN} to {TRANSFORMERS_MAX}.x; found {version}. "
            "A newer release may have changed an API this model relies on, so check outputs (e.g. generate() with "
            f"and without use_cache) or install transformers=={TRANSFORMERS_MAX}.*",
            KimiHybridVersionWarning, stacklevel=3)


def compiling() -> bool:
    """True while torch.compile (dynamo) traces the caller (host reads, warnings and Python-side checks are skipped
    there)."""
    comp = getattr(torch, "compiler", None)
    return bool(comp is not None and hasattr(comp, "is_compiling") and comp.is_compiling())


def graph_capturing(t: torch.Tensor) -> bool:
    """True while a CUDA graph is being captured on the current stream of ``t``'s device (host reads of device
    values are illegal there)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def _generation_cache_name() -> str:
    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    return "cache" if "cache" in params else "past_key_values"


# the keyword under which this transformers' generate() hands the cache to prepare_inputs_for_generation / forward
GENERATION_CACHE_NAME = _generation_cache_name()
# the field name of the cache in transformers' ModelOutput classes
OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def resolve_cache_arg(past_key_values: Any = None, cache: Any = None) -> Any:
    """The cache passed to a forward under either name (``past_key_values``: transformers <= 5.23; ``cache``:
    5.24 on). Returns it, or None.

    Raises:
        ValueError: both names given (one call cannot take two caches).
    """
    if past_key_values is not None and cache is not None:
        raise ValueError("got both `cache` and `past_key_values`: they are two names for the same argument "
                         "(transformers >= 5.24 calls it `cache`); pass the cache once")
    if past_key_values is not None and GENERATION_CACHE_NAME == "cache" and not compiling():
        # transformers >= 5.24's own deprecation of the old name (its models warn the same way)
        warnings.warn("`past_key_values` is deprecated and will be removed in transformers 6; use `cache` instead",
                      FutureWarning, stacklevel=3)
    return cache if cache is not None else past_key_values


def pop_cache_kwargs(kwargs: dict) -> Any:
    """Remove both cache names from ``kwargs`` and return the cache (None if absent). Raises like
    :func:`resolve_cache_arg`."""
    return resolve_cache_arg(kwargs.pop("past_key_values", None), kwargs.pop("cache", None))


def linear_attention_states(cache: Any, layer_idx: int):
    """``(conv_state, recurrent_state)`` of linear-attention layer ``layer_idx`` of a transformers cache, or ``(None,
    None)`` before its first state: ``Cache.get_conv_state`` / ``get_recurrent_state`` where they exist (5.21 on),
    else the layer's ``conv_states`` / ``recurrent_states`` (5.17-5.20, as their own models read them)."""
    if not cache.has_previous_state(layer_idx):
        return None, None
    if hasattr(cache, "get_conv_state"):
        return cache.get_conv_state(layer_idx), cache.get_recurrent_state(layer_idx)
    layer = cache.layers[layer_idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def output_cache(output: Any) -> Any:
    """The cache held by a ``ModelOutput`` of either transformers generation (no deprecation warning)."""
    return output.get(OUTPUT_CACHE_FIELD) if hasattr(output, "get") else getattr(output, OUTPUT_CACHE_FIELD, None)


def cache_field(cache: Any) -> dict:
    """``{field: cache}`` to build a ``ModelOutput`` with this transformers' cache field name."""
    return {OUTPUT_CACHE_FIELD: cache}


check_transformers_version()
