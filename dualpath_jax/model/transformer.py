"""The decoder-only Transformer (every family: Qwen2/3 GQA, DeepSeek MLA, MoE) and its monolithic
forward.

`Transformer.__call__` is the monolithic reference: every layer in one pass over whole sequences.
Serving code runs the same modules one layer at a time through `ModelRunner` (runner.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from dualpath_jax.config import ModelConfig
from dualpath_jax.model import sharding
from dualpath_jax.model.layers import DecoderLayer, Linear, RMSNorm

Array = jax.Array


class Embed(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.embedding = nnx.Param(
            (jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.hidden_size))).astype(
                jnp.dtype(cfg.dtype)
            )
        )

    def __call__(self, tokens: Array) -> Array:
        return jnp.take(self.embedding[...], tokens, axis=0)


class Head(nnx.Module):
    """Final norm + LM head. With tied embeddings the head reuses the embedding matrix."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
        self.lm_head = (
            None
            if cfg.tie_embeddings
            else Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dt, rngs=rngs)
        )

    def __call__(self, h: Array, embedding: Array | None) -> Array:
        """h `[..., hidden]` -> float32 logits `[..., vocab]`."""
        x = self.norm(h)
        if self.lm_head is None:
            return jnp.dot(x, embedding.T, preferred_element_type=jnp.float32)
        return jnp.dot(x, self.lm_head.kernel[...], preferred_element_type=jnp.float32)


class Transformer(nnx.Module):
    """Decoder-only LM. Layers keep no KV state: cached KV rows are passed in and out."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_layers)])
        self.head = Head(cfg, rngs)

    def __call__(
        self,
        tokens: Array,
        cached_kv: Array | None = None,
        cached_lens: Array | None = None,
    ) -> tuple[Array, Array]:
        """Monolithic forward.

        tokens `[B, N]`; optional cached KV rows `[L, B, C, W]` with `cached_lens` `[B]` (new tokens
        then start at position `cached_lens[b]`). Returns (float32 logits `[B, N, V]`, new KV rows
        `[L, B, N, W]`).
        """
        b, n = tokens.shape
        if cached_kv is None:
            cached_kv = jnp.zeros((self.cfg.num_layers, b, 0, self.cfg.kv_width), self.cfg.kv_dtype)
            cached_lens = jnp.zeros((b,), jnp.int32)
        positions = cached_lens[:, None] + jnp.arange(n)[None, :]
        h = self.embed(tokens)
        new = []
        for i, layer in enumerate(self.layers):
            h, rows = layer(h, positions, cached_kv[i], cached_lens)
            new.append(rows)
        return self.head(h, self.embed.embedding[...]), jnp.stack(new)


def init_model(cfg: ModelConfig, seed: int = 0, *, mesh: Mesh | None = None) -> Transformer:
    """A randomly initialised model (the tiny presets in tests and demos). With `mesh`, every
    parameter is created already split over the mesh (`sharding.param_shardings`), so no device
    ever holds the whole model: the embedding, each layer and the head are made by their own
    compiled program whose outputs are the shards (one program per kind of layer, dense or
    MoE, so a real-size model compiles a few small programs, and a program's temporaries are one
    layer's random bits, not the whole model's). The values equal the unsharded model's of the
    same seed: each part continues the one random stream where the part before it stopped."""
    if mesh is None:
        return Transformer(cfg, rngs=nnx.Rngs(seed))
    mesh = sharding.check_mesh(mesh)
    gd, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
    shardings = sharding.param_shardings(nnx.to_pure_dict(state), mesh, cfg)
    parts = [("embed", None, lambda r: Embed(cfg, r))]
    # a layer's index only chooses its kind: layers of one kind share their program
    parts += [("layers", i, lambda r, i=i: DecoderLayer(cfg, i, r)) for i in range(cfg.num_layers)]
    parts.append(("head", None, lambda r: Head(cfg, r)))
    programs: dict = {}
    pure: dict = {"layers": {}}
    count = jnp.zeros((), jnp.uint32)  # the stream's draws so far
    with jax.set_mesh(mesh):
        for name, i, build in parts:
            out = shardings[name] if i is None else shardings[name][i]
            key = (name, i is not None and cfg.is_moe_layer(i))
            if key not in programs:

                def make(start, build=build):
                    rngs = nnx.Rngs(seed)
                    rngs.default.count[...] = start
                    part = nnx.to_pure_dict(nnx.state(build(rngs)))
                    return part, rngs.default.count[...]

                programs[key] = jax.jit(make, out_shardings=(out, None))
            part, count = programs[key](count)
            if i is None:
                pure[name] = part
            else:
                pure[name][i] = part
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(gd, state)


def shard_model(model: Transformer, mesh: Mesh) -> Transformer:
    """`model` with its parameters placed on `mesh` by the partition rules (a new module; the
    arrays already where they belong are not copied). An abstract model (`nnx.eval_shape`)
    gets `ShapeDtypeStruct`s that carry their shardings: what compile-only checks lower."""
    mesh = sharding.check_mesh(mesh)
    gd, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)
    shardings = sharding.param_shardings(pure, mesh, model.cfg)
    nnx.replace_by_pure_dict(state, jax.tree.map(sharding.place, pure, shardings))
    return nnx.merge(gd, state)
