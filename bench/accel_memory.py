"""Accelerator memory of the model's attention paths, compile-only: XLA's temporary bytes per figure.

Run: python bench/accel_memory.py [--json] [--tiny]

Nothing is allocated: every figure lowers one of the real jitted entry points of the model code
with abstract inputs (`jax.ShapeDtypeStruct`, parameters from `nnx.eval_shape` of the model's
init), compiles it for the local backend and reads `compiled.memory_analysis()`. The figure is
`temp_size_in_bytes`, the scratch XLA needs beyond the arguments and outputs (those two are in
the table too). On the project's CPU hosts that is XLA:CPU's buffer assignment, which also holds
the f32 copies XLA:CPU makes of bf16 operands (weights of the dots, a bf16 scatter target).

Figures (the default shapes; `--tiny` measures the same functions at the tiny presets). Cached
KV is paged as the model holds it (`layers.PagedKV`: pages of `PAGE` = 64 tokens, each request's
cached tokens in its own pages, held as the bits of the KV dtype):

- `prefill_7b`: one Qwen2.5-7B-shaped layer (hidden 3584, 28 query / 4 KV heads of 128, SwiGLU
  18944, bf16 weights and KV) through the runner's paged per-layer prefill entry
  (`runner._layer_paged`): 2,048 new tokens over 32,768 cached, batch 1.
- `prefill_ragged8`: the same layer and entry for 8 requests of mixed lengths (`RAGGED`); the new
  tokens are padded as `PrefillBatch.build` pads them (to the longest of the batch), the cached
  ones are not (each request has its own pages). The table's `real` column is the fraction of
  the (query, key) pairs a dense backend computes that the mask keeps.
- `mla_prefill`: DeepSeek-V3's MLA (the `deepseek-v3-660b` preset: 128 heads, q_lora 1536,
  kv_lora 512, rope 64, FP8 KV rows of 576) for 2,048 new over 32,768 cached, batch 1: the
  attention half of `DecoderLayer` (`input_layernorm`, `self_attn.project`, `self_attn.attend`
  over the pages, the residual). The MoE FFN is left out (see `bench/moe_memory.py`).
- `decode_64`: one decode step (`decode_programs.decode_step`, what `Decoder.advance` runs) of a one-layer
  Qwen2.5-7B-shaped model (so embedding, head and in-step sampling are in it) over 64 slots
  with contexts 1,024..32,272 (`DECODE_CONTEXTS`) in a pool of exactly their pages. The paged
  kernel gets every slot's full page table (one shape for all lengths); the dense backends get
  the columns up to the longest slot's bucket and gather that much for every slot.

Backends are `BACKENDS`: one per `ModelConfig.attention_impl` (`model.layers.ATTENTION_IMPLS`):
`reference` (`dense_attention.attend` over the gathered pages: dense einsums, a boolean mask, f32
scores), `xla` (`jax.nn.dot_product_attention` over the gathered pages; on GPU JAX may pick
cuDNN's fused kernel, on CPU it is XLA's own lowering) and `pallas` (the paged kernel,
`kernels/paged_attention.py`, in interpret mode off GPU: XLA's loops over the kernel's blocks).
The figures are this machine's compiler's: run it where the backend matters.
`--json` prints exactly one JSON object `{backend: {figure: temp bytes}}` on stdout.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from dualpath_jax.config import ModelConfig
from dualpath_jax.kernels.kv_rows import bits_dtype
from dualpath_jax.model.decode_programs import step_fn
from dualpath_jax.model.layers import ATTENTION_IMPLS, PagedKV
from dualpath_jax.model.page_pool import pages_for
from dualpath_jax.model.runner import ModelRunner, PrefillBatch, _layer_paged, bucket_len
from dualpath_jax.model.sampling_params import MAX_HELD_STOP_TOKENS
from dualpath_jax.model.transformer import init_model
from dualpath_jax.presets import DEEPSEEK_V3_660B, QWEN25_7B, TINY_DEEPSEEK, TINY_QWEN2

FIGURES = ("prefill_7b", "prefill_ragged8", "mla_prefill", "decode_64")

# (new, cached) tokens of the ragged prefill batch: new 128..2048, cached 0..32K.
RAGGED = (
    (2048, 0),
    (128, 32768),
    (512, 4096),
    (1024, 16384),
    (256, 1024),
    (1536, 8192),
    (384, 24576),
    (768, 2048),
)
DECODE_CONTEXTS = tuple(1024 + 496 * i for i in range(64))  # 1,024 .. 32,272
PAGE = 64  # tokens per KV page (the store's default block_tokens)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """What the figures are measured at: the models and the lengths."""

    gqa: ModelConfig  # prefill_7b, prefill_ragged8, decode_64
    mla: ModelConfig  # mla_prefill
    prefill: tuple[int, int]  # (new, cached), batch 1
    ragged: tuple[tuple[int, int], ...]  # (new, cached) per request
    mla_prefill: tuple[int, int]  # (new, cached), batch 1
    decode_contexts: tuple[int, ...]  # one per slot
    decode_max_len: int  # T_max of the decoder's cache


FULL = Shapes(
    gqa=QWEN25_7B,
    mla=DEEPSEEK_V3_660B,
    prefill=(2048, 32768),
    ragged=RAGGED,
    mla_prefill=(2048, 32768),
    decode_contexts=DECODE_CONTEXTS,
    decode_max_len=32768,
)

TINY = Shapes(
    gqa=TINY_QWEN2,
    mla=TINY_DEEPSEEK,
    prefill=(32, 96),
    ragged=((32, 0), (8, 96), (16, 40)),
    mla_prefill=(32, 96),
    decode_contexts=(10, 40, 100),
    decode_max_len=128,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One figure: a thunk that lowers it, a description of its shapes, the useful fraction."""

    lower: Callable[[], jax.stages.Lowered]
    shapes: str
    real: float  # fraction of the attended (query, key) pairs that the mask keeps


def _one_layer(cfg: ModelConfig) -> ModelRunner:
    """A runner of a one-layer abstract model (parameters are `ShapeDtypeStruct`s)."""
    cfg = dataclasses.replace(cfg, num_layers=1)
    return ModelRunner(nnx.eval_shape(lambda: init_model(cfg, 0)))


def _prefill_args(cfg: ModelConfig, requests):
    """Abstract inputs of one layer's paged prefill (`runner._layer_paged`) for `requests`
    [(new, cached)]: new tokens padded as `PrefillBatch.build` pads them, each request's cached
    tokens in its own pages of `PAGE` tokens; also the description and the kept fraction."""
    batch = PrefillBatch.build(cfg, [[0] * n for n, _ in requests], [c for _, c in requests])
    b, n = batch.batch_size, batch.n_pad
    pages = [pages_for(c, PAGE) for _, c in requests]
    sds = jax.ShapeDtypeStruct
    args = (
        sds((b, n, cfg.hidden_size), jnp.dtype(cfg.dtype)),
        sds((b, n), jnp.int32),
        sds((max(sum(pages), 1) + 1, 1, PAGE, cfg.kv_width), bits_dtype(cfg.kv_dtype)),
        sds((b, max(max(pages), 1)), jnp.int32),
        sds((b,), jnp.int32),
        sds((b,), jnp.int32),  # real new tokens
    )
    kept = sum(nn * cc + nn * (nn + 1) // 2 for nn, cc in requests)
    desc = f"B={b} N={n} pages={sum(pages)}x{PAGE} W={cfg.kv_width} {cfg.kv_dtype}"
    c_pad = max(pages) * PAGE
    return args, desc, kept / (b * n * (c_pad + n))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _attention_half(
    norm_gd, attn_gd, norm_state, attn_state, h, positions, pages, table, lens, new_lens
):  # fmt: skip
    """`DecoderLayer.__call__` up to the FFN over paged cached KV."""
    norm, attn = nnx.merge(norm_gd, norm_state), nnx.merge(attn_gd, attn_state)
    q, new_rows = attn.project(norm(h), positions)
    out, _ = attn.attend(q, new_rows, PagedKV(pages, table, lens, new_lens=new_lens))
    return h + out, new_rows


def cases(shapes: Shapes, impl: str) -> dict[str, Case]:
    """The figures' lowerings with attention backend `impl` (`ModelConfig.attention_impl`)."""
    shapes = dataclasses.replace(
        shapes,
        gqa=dataclasses.replace(shapes.gqa, attention_impl=impl),
        mla=dataclasses.replace(shapes.mla, attention_impl=impl),
    )
    gqa = _one_layer(shapes.gqa)

    def prefill(requests) -> Case:
        args, desc, real = _prefill_args(shapes.gqa, requests)
        return Case(
            lambda: _layer_paged.lower(gqa.layer_gds[0], gqa.layer_states[0], *args), desc, real
        )

    mla_layer = nnx.eval_shape(
        lambda: init_model(dataclasses.replace(shapes.mla, num_layers=1), 0)
    ).layers[0]
    norm_gd, norm_state = nnx.split(mla_layer.input_layernorm)
    attn_gd, attn_state = nnx.split(mla_layer.self_attn)
    mla_args, mla_desc, mla_real = _prefill_args(shapes.mla, [shapes.mla_prefill])

    cfg, ctx = shapes.gqa, shapes.decode_contexts
    s, t_max = len(ctx), shapes.decode_max_len
    # The pool holds every slot's pages (its context and the token fed now); the table is as
    # `Decoder.step` passes it: every slot's page columns up to max_len for the paged kernel,
    # up to the bucket of the longest slot for the dense backends (they gather that much).
    n_pages = sum(pages_for(c + 1, PAGE) for c in ctx)
    bucket = min(bucket_len(max(ctx) + 1, 64), t_max)
    cols = pages_for(t_max if impl == "pallas" else bucket, PAGE)
    sds = jax.ShapeDtypeStruct
    dec_args = (
        gqa.stacked_leaves[1],
        sds((n_pages + 1, 1, PAGE, cfg.kv_width), bits_dtype(cfg.kv_dtype)),
        sds((s, cols), jnp.int32),
        sds((s,), jnp.int32),
        sds((s,), jnp.int32),
        sds((s,), jnp.bool_),
        sds((s,), jnp.uint32),
        sds((s,), jnp.float32),  # temperatures
        sds((s,), jnp.float32),  # top-p
        sds((s, MAX_HELD_STOP_TOKENS), jnp.int32),  # stop tokens held back (min_tokens)
        sds((s,), jnp.int32),  # ... until this position
        sds((s,), jnp.bool_),  # slots asking for log-probabilities
    )
    return {
        "prefill_7b": prefill([shapes.prefill]),
        "prefill_ragged8": prefill(shapes.ragged),
        "mla_prefill": Case(
            lambda: _attention_half.lower(norm_gd, attn_gd, norm_state, attn_state, *mla_args),
            mla_desc,
            mla_real,
        ),
        "decode_64": Case(
            lambda: step_fn(gqa).lower(*dec_args),
            f"S={s} pages={n_pages}x{PAGE} table={s}x{cols} W={cfg.kv_width} {cfg.kv_dtype}",
            sum(c + 1 for c in ctx) / (s * cols * PAGE),
        ),
    }


BACKENDS: dict[str, Callable[[Shapes], dict[str, Case]]] = {
    impl: functools.partial(cases, impl=impl) for impl in ATTENTION_IMPLS
}


def measure(shapes: Shapes, backends=None) -> dict[str, dict[str, dict]]:
    """{backend: {figure: {"temp", "argument", "output", "alias": bytes, "shapes", "real"}}}."""
    out: dict[str, dict[str, dict]] = {}
    for name, build in (backends or BACKENDS).items():
        cases = build(shapes)
        out[name] = {}
        for fig in FIGURES:
            case = cases[fig]
            mem = case.lower().compile().memory_analysis()
            out[name][fig] = {
                "temp": int(mem.temp_size_in_bytes),
                "argument": int(mem.argument_size_in_bytes),
                "output": int(mem.output_size_in_bytes),
                "alias": int(mem.alias_size_in_bytes),
                "shapes": case.shapes,
                "real": case.real,
            }
    return out


def temps(results: dict[str, dict[str, dict]]) -> dict[str, dict[str, int]]:
    """The `--json` object: {backend: {figure: temp bytes}}."""
    return {b: {f: r["temp"] for f, r in figs.items()} for b, figs in results.items()}


def table(results: dict[str, dict[str, dict]]) -> str:
    gib = 2.0**30
    head = f"{'backend':<10} {'figure':<16} {'temp GiB':>9} {'args GiB':>9} {'out GiB':>8}  real   shapes"
    lines = [head, "-" * len(head)]
    for b, figs in results.items():
        for f, r in figs.items():
            lines.append(
                f"{b:<10} {f:<16} {r['temp'] / gib:>9.2f} {r['argument'] / gib:>9.2f}"
                f" {r['output'] / gib:>8.2f}  {r['real']:.2f}   {r['shapes']}"
            )
    return "\n".join(lines)


def main(argv):
    del argv
    results = measure(TINY if _TINY.value else FULL)
    if _JSON.value:
        print(json.dumps(temps(results)))
    else:
        print(f"device: {jax.devices()[0]}  (compile-only; nothing allocated)")
        print(table(results))


if __name__ == "__main__":
    # Flags exist only when run as a script: tests import several bench modules at once.
    _JSON = flags.DEFINE_bool(
        "json", False, "print one JSON object {backend: {figure: temp bytes}}"
    )
    _TINY = flags.DEFINE_bool(
        "tiny", False, "measure at the tiny presets and lengths (a quick check)"
    )
    app.run(main)
