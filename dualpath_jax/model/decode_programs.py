"""The decode programs `Decoder` runs (`decode.py`): one step over paged KV with sampling on the
device (`decode_step`), jitted per runner over its parameters' leaves (`step_fn`), several steps
in one program (`steps_fn`, multi-step decode), and the page pool's writes, reads and copies."""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from dualpath_jax.model.layers import PagedKV
from dualpath_jax.model.runner import JITTED, ModelRunner
from dualpath_jax.model.sampler import draw_step

Array = jax.Array


def decode_step(
    embed_gd, runs, head_gd, params, pages, table, lengths, pending, active, seeds, temps,
    top_ps, stop_ids, held_until, wants_logprobs,
):  # fmt: skip
    """One token for every slot over paged KV, everything on the device.

    pages `[P, L, page_size, W]` (bits, see `Decoder`), table `[S, M]`, lengths, pending tokens,
    the active mask, sampling seeds, temperatures and top-p `[S]`, and each slot's stop tokens
    `[S, K]` that may not be drawn before position `held_until` `[S]` (`min_tokens`), and which
    slots ask for log-probabilities `wants_logprobs` `[S]`. The layers of each run (`runs`:
    `ModelRunner.layer_runs`, with `params` from `ModelRunner.stacked_params`) go under one
    `lax.scan`, so the program and its dispatch do not grow with depth. Each layer attends
    over the slot's cached pages and the token's own row, and writes that row into the slot's
    page. Returns (logits `[S, V]` (the model's, before masking), the next tokens `[S]` (sampled
    as `sample_at` samples; idle slots keep theirs), their log-probabilities `[S, 2]`
    (`sampler.draw_step`: zeros when no active slot asks), pages, lengths + active)."""
    embed_state, stacked, head_state = params
    embed = nnx.merge(embed_gd, embed_state)
    h = embed(pending[:, None])
    positions = lengths[:, None]
    write = active.astype(jnp.int32)
    for (gd, start, count), states in zip(runs, stacked):

        def body(carry, xs, gd=gd):
            h, pages = carry
            state, layer = xs
            h, _, pages = nnx.merge(gd, state).run(
                h, positions, PagedKV(pages, table, lengths, layer, write, new_lens=write)
            )
            return (h, pages), None

        layers = start + jnp.arange(count, dtype=jnp.int32)
        (h, pages), _ = jax.lax.scan(body, (h, pages), (states, layers))
    logits = nnx.merge(head_gd, head_state)(h[:, 0], embed.embedding[...])
    lengths = lengths + write
    wants = wants_logprobs & active
    tokens, chosen = draw_step(logits, stop_ids, held_until, lengths, seeds, temps, top_ps, wants)
    return logits, jnp.where(active, tokens, pending), chosen, pages, lengths


# Per runner: (the treedef of its stacked parameters, {steps: its jitted program}).
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def step_fn(runner: ModelRunner):
    """The runner's jitted decode step, shared by its decoders. It takes the stacked parameters
    as their flat leaves (`ModelRunner.stacked_leaves`), the graph definitions and the treedef
    bound: a call then flattens a plain list in C++ and hashes no static argument, instead of
    running the parameter containers' Python flatten on every step."""
    return steps_fn(runner, 1)


def steps_fn(runner: ModelRunner, steps: int):
    """The runner's jitted `steps`-step program (`decode_steps`; one step: `decode_leaves`),
    bound as `step_fn` says. New parameters of the same structure keep the programs (the
    structure is compared once per `update_params`, not per step)."""
    treedef, _ = runner.stacked_leaves
    entry = _PROGRAMS.get(runner)
    if entry is None or (entry[0] is not treedef and entry[0] != treedef):
        entry = (treedef, {})
    fns = entry[1]
    if steps not in fns:
        bound = (runner.embed_gd, runner.layer_runs, runner.head_gd, treedef)
        prog = (
            functools.partial(decode_leaves, *bound)
            if steps == 1
            else functools.partial(decode_steps, *bound, steps)
        )
        fns[steps] = jax.jit(prog, donate_argnums=(1,))
        JITTED.add(fns[steps])
    _PROGRAMS[runner] = (treedef, fns)
    return fns[steps]


def decode_leaves(embed_gd, runs, head_gd, treedef, leaves, pages, table, lengths, pending,
                   *rest):  # fmt: skip
    """`decode_step` over the first `table.shape[0]` slots (`Decoder`'s active rows); `pending`
    holds every slot's, and the rest keep theirs."""
    params = jax.tree.unflatten(treedef, leaves)
    rows = table.shape[0]
    logits, tokens, chosen, pages, lengths = decode_step(
        embed_gd, runs, head_gd, params, pages, table, lengths, pending[:rows], *rest
    )
    return logits, pending.at[:rows].set(tokens), chosen, pages, lengths


def decode_steps(embed_gd, runs, head_gd, treedef, steps, leaves, pages, table, lengths,
                  pending, active, *rest):  # fmt: skip
    """`steps` decode steps in one program (`lax.scan` of `decode_step`), each fed the
    tokens the one before drew: what `steps` calls of the single step compute, in one
    dispatch. Returns (tokens `[steps, B]` of the first B = `table.shape[0]` slots, every
    slot's next pending token `[S]`, the tokens' log-probabilities `[steps, B, 2]`, pages,
    lengths); no logits (a caller that wants the top-k runs single steps)."""
    params = jax.tree.unflatten(treedef, leaves)
    rows = table.shape[0]  # (as `decode_leaves`)

    def body(carry, _):
        pages, lengths, pending = carry
        _, tokens, chosen, pages, lengths = decode_step(
            embed_gd, runs, head_gd, params, pages, table, lengths, pending, active, *rest
        )
        return (pages, lengths, tokens), (tokens, chosen)

    (pages, lengths, last), (tokens, chosen) = jax.lax.scan(
        body, (pages, lengths, pending[:rows]), None, length=steps
    )
    return tokens, pending.at[:rows].set(last), chosen, pages, lengths


@functools.partial(jax.jit, static_argnums=(1,))
def pad_rows(x, rows):
    return jnp.zeros((rows, *x.shape[1:]), x.dtype).at[: x.shape[0]].set(x)


@jax.jit
def merge(old, mask, new):
    return jnp.where(mask, new, old)


@functools.partial(jax.jit, donate_argnums=(0,))
def write_pages(pages, ids, blocks):
    """pages `[P, L, ps, W]` <- blocks `[n, L, ps, W]` (bits) at page ids `[n]`."""
    return pages.at[ids].set(blocks)


@jax.jit
def read_pages(pages, ids):
    return pages[ids]


@functools.partial(jax.jit, donate_argnums=(0,))
def copy_page(pages, where):
    """pages[where[1]] <- pages[where[0]] (a fork's copy of its prompt's last page)."""
    return pages.at[where[1]].set(pages[where[0]])


JITTED.update((pad_rows, merge, write_pages, read_pages, copy_page))
