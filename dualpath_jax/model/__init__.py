"""The model: Qwen2, Qwen3, Qwen3-MoE, DeepSeek-V2 and V3 transformers in flax.nnx, checkpoints,
generation.

    from dualpath_jax import model as dm

    net = dm.init_model(dm.get_preset("tiny-qwen2"), seed=0)   # or dm.from_pretrained(hf_dir)
    tokens = dm.generate(net, [1, 2, 3], max_new_tokens=8)      # a flat prompt -> a flat list
    dm.save_params(net, "/tmp/ckpt")

Names resolve lazily, so importing the namespace costs nothing until one is used.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: a submodule of dualpath_jax.model, or a full module path (the presets).
_EXPORTS = {
    "Transformer": "transformer",
    "init_model": "transformer",
    "get_preset": "dualpath_jax.presets.models",
    "PRESETS": "dualpath_jax.presets.models",
    "from_pretrained": "checkpoint",
    "save_params": "checkpoint",
    "restore_params": "checkpoint",
    "load_params": "checkpoint",
    "save_params_tree": "checkpoint",
    "CheckpointError": "checkpoint",
    "generate": "generation",
    "reference_generate": "generation",
    "reference_rounds": "generation",
    "SamplingParams": "sampling",
    "SamplingError": "sampling",
    "Decoder": "decode",
    "ModelRunner": "runner",
    "PrefillBatch": "runner",
    "resolve_attention_impl": "layers",
    "ATTENTION_IMPLS": "layers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dualpath_jax.model' has no attribute {name!r}")
    path = module if "." in module else f"dualpath_jax.model.{module}"
    value = getattr(importlib.import_module(path), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
