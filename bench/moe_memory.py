"""Memory of one MoE FFN per routed-expert implementation, compile-only: XLA's temporary bytes.

Run: python bench/moe_memory.py [--json] [--tiny]

Nothing is allocated: one DeepSeek-V3-shaped MoE layer (`layers.MoE` of the `deepseek-v3-660b`
preset: 256 routed experts of hidden 7168 and moe inter 2048, top-8 of 8 groups, one shared
expert, bf16 weights), parameters from `nnx.eval_shape`, is lowered for 2,048 tokens
(`jax.ShapeDtypeStruct` `[1, 2048, 7168]`) once per `ModelConfig.moe_impl`
(`model.moe.MOE_IMPLS`), compiled for the local backend, and `compiled.memory_analysis()` read.
The figure is `temp_size_in_bytes`, the scratch beyond the arguments (the 22.5 GB of expert
weights) and the output. Routing, the sort by expert, the experts and the combine are all in
it, so the implementations differ only in the grouped matmul. On CPU, `gmm` is Pallas'
interpret mode, not the TPU kernel, and XLA:CPU also counts the f32 copies it makes of bf16 dot
operands (all of the expert weights, 42 GiB, for `ragged_dot` and `grouped`); `--dtype=float32`
measures without those copies. Run it where the implementation matters. `--tiny` measures the
tiny preset at 32 tokens. `--json` prints exactly one JSON object `{impl: temp bytes}` on stdout.
"""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from dualpath_jax.config import ModelConfig
from dualpath_jax.model.layers import MoE
from dualpath_jax.model.moe import MOE_IMPLS
from dualpath_jax.presets import DEEPSEEK_V3_660B, TINY_DEEPSEEK


@dataclasses.dataclass(frozen=True)
class Shapes:
    model: ModelConfig
    tokens: int


FULL = Shapes(DEEPSEEK_V3_660B, 2048)
TINY = Shapes(TINY_DEEPSEEK, 32)


@functools.partial(jax.jit, static_argnums=0)
def _moe(gd, state, x):
    return nnx.merge(gd, state)(x)


def lower(shapes: Shapes, impl: str) -> jax.stages.Lowered:
    """The MoE layer's forward with `moe_impl=impl`, lowered with abstract inputs."""
    cfg = dataclasses.replace(shapes.model, moe_impl=impl)
    gd, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((1, shapes.tokens, cfg.hidden_size), jnp.dtype(cfg.dtype))
    return _moe.lower(gd, state, x)


def measure(shapes: Shapes, impls=MOE_IMPLS) -> dict[str, dict[str, int]]:
    """{impl: {"temp", "argument", "output": bytes}}."""
    out = {}
    for impl in impls:
        mem = lower(shapes, impl).compile().memory_analysis()
        out[impl] = {
            "temp": int(mem.temp_size_in_bytes),
            "argument": int(mem.argument_size_in_bytes),
            "output": int(mem.output_size_in_bytes),
        }
    return out


def temps(results: dict[str, dict[str, int]]) -> dict[str, int]:
    """The `--json` object: {impl: temp bytes}."""
    return {impl: r["temp"] for impl, r in results.items()}


def table(results: dict[str, dict[str, int]]) -> str:
    gib = 2.0**30
    head = f"{'impl':<12} {'temp GiB':>10} {'args GiB':>9} {'out GiB':>8}"
    lines = [head, "-" * len(head)]
    for impl, r in results.items():
        lines.append(
            f"{impl:<12} {r['temp'] / gib:>10.3f} {r['argument'] / gib:>9.2f}"
            f" {r['output'] / gib:>8.3f}"
        )
    return "\n".join(lines)


def main(argv):
    del argv
    shapes = TINY if _TINY.value else FULL
    if _DTYPE.value:
        shapes = dataclasses.replace(
            shapes, model=dataclasses.replace(shapes.model, dtype=_DTYPE.value)
        )
    results = measure(shapes)
    if _JSON.value:
        print(json.dumps(temps(results)))
    else:
        print(f"device: {jax.devices()[0]}  (compile-only; nothing allocated)")
        print(f"{shapes.model.name} ({shapes.model.dtype}), {shapes.tokens} tokens")
        print(table(results))


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    _JSON = flags.DEFINE_bool("json", False, "print one JSON object {impl: temp bytes}")
    _TINY = flags.DEFINE_bool("tiny", False, "measure the tiny preset at 32 tokens (a quick check)")
    _DTYPE = flags.DEFINE_string("dtype", "", "parameter/compute dtype (default: the preset's)")
    app.run(main)
