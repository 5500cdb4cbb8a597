"""Reference checkpoints written by transformers, for the tests that compare against it.

Each is a tiny random model that transformers builds, re-initialised with weights large enough
that logits are well separated (transformers' std 0.02 init makes them nearly flat, which would
hide errors and make greedy ties likely), saved with `save_pretrained`. Imported by
test_hf.py, test_hf_families.py and mesh_cases.py, which skip without torch and transformers.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import torch
import transformers

from dualpath_jax.model.runner import ModelRunner, PrefillBatch

RTOL = 1e-4  # max |ours - hf| / max |hf| over all prompt positions
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26, 43]
NEW_TOKENS = 10
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A Hugging Face directory and the torch model whose forward is the reference for it."""

    path: pathlib.Path
    hf: torch.nn.Module


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with std fan_in**-0.5, norms 1 +- 0.1, random router score-correction biases."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:  # torch weights are [..., out, in]
                p.copy_(p.shape[-1] ** -0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def write_hf(path: pathlib.Path, cls_name: str, kwargs: dict, seed: int) -> Checkpoint:
    arch = getattr(transformers, cls_name)
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    model = arch(config_cls(**kwargs, attn_implementation="eager")).eval()
    randomize(model, seed)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    model.save_pretrained(path)
    return Checkpoint(path, model)


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def our_logits(runner: ModelRunner, tokens: list[int]) -> np.ndarray:
    result, _ = runner.prefill_monolithic(
        PrefillBatch.build(runner.cfg, [tokens], [0]), all_logits=True
    )
    return np.asarray(result.logits[0, : len(tokens)])


def rel_err(ours: np.ndarray, theirs: np.ndarray) -> float:
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())
