"""Checkpoint converters for kimi-hybrid (installed as `kimi_hybrid.conversion`).

released Kimi-Linear / transformers-native kimi_linear / Kimi K3 text backbone -> our layout (docs/LAYOUT.md),
and our layout -> released Kimi-Linear (export). Streaming, atomic, verified; see convert.py for the design.
"""

from .binding import CheckpointError
from .config_io import (
    ConfigError,
    k3_config_to_ours,
    native_config_to_ours,
    ours_config_to_released,
    released_config_to_ours,
)
from .convert import ConversionError, convert_checkpoint, open_checkpoint
from .inventory import inventory
from .layouts import PlanError, plan_for
from .mxfp4 import dequantize_mxfp4
from .state_dict import (
    convert_state_dict,
    k3_state_dict_to_ours,
    native_state_dict_to_ours,
    ours_state_dict_to_released,
    released_state_dict_to_ours,
)

__all__ = [
    "CheckpointError", "ConfigError", "ConversionError", "PlanError", "convert_checkpoint", "convert_state_dict",
    "dequantize_mxfp4", "inventory", "k3_config_to_ours", "k3_state_dict_to_ours", "native_config_to_ours",
    "native_state_dict_to_ours", "open_checkpoint", "ours_config_to_released", "ours_state_dict_to_released",
    "plan_for", "released_config_to_ours", "released_state_dict_to_ours",
]
