"""KV sizes, the layer groups of a KV layout, and the Layer Block / Full Block byte layout
(docs/architecture.md).

A layer's cached KV is held as *KV rows*: `[T, W]` in `kv_dtype`, one row per token, where
`W = ModelConfig.kv_width` (GQA: K then V, each `[num_kv_heads, head_dim]` flattened; MLA: the
normalized latent `c_kv` then the RoPE'd shared key `k_pe`). The byte layout is the rows viewed as
uint8, so no conversion happens between the model and the store:

- Full Block:  `[num_layers, block_tokens, bytes_per_token_per_layer]` uint8 (storage unit)
- Layer Block: `[1, block_tokens, bytes_per_token_per_layer]` uint8 (streaming unit)

Concatenating a block's layer blocks along axis 0 gives its full block.

A `BlockLayout` names its layers' *groups* (as vLLM's `KVCacheSpec` per layer group): a
`LayerGroup` is the layers that keep the same KV, with one row width, one page geometry and one
`Retention` rule (all tokens: full attention; the last W tokens: a sliding window; one state per
block: a recurrent layer). Every model the forward computes today is one group keeping all
tokens, and that group's block is the uniform Full Block above (`shape`,
`bytes_per_token_per_layer`, `layer_nbytes` are its). A block of several groups is its layers'
parts in layer order, layer `l`'s part `[rows_per_block, row_bytes]` of its group
(`layer_offset`, `layer_part_shape`); what cannot take such a block yet raises
`UnsupportedLayout` naming itself.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from dualpath_jax.config import ModelConfig
from dualpath_jax.kernels.kv_rows import RowLayout

# FlashMLA's FP8 KV format per token per layer: 512 FP8 latent + 4 FP32 scales + 64 BF16 RoPE.
_FLASHMLA_TILE = 128
FP8_FLASHMLA = "fp8_flashmla"


def np_dtype(name: str) -> np.dtype:
    """numpy dtype for a config dtype name (bfloat16 and float8 via ml_dtypes)."""
    try:
        return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) else np.dtype(name)
    except TypeError:
        raise ValueError(f"unknown dtype {name!r}") from None


def kv_bytes_per_token_per_layer(cfg: ModelConfig, kv_format: str | None = None) -> int:
    """Bytes of cached KV for one token in one layer.

    `kv_format` is a dtype name (default `cfg.kv_dtype`) or `"fp8_flashmla"` for the MLA FP8
    layout with per-tile FP32 scales and a BF16 RoPE part (656 B for DeepSeek-V3's 512 + 64).
    """
    kv_format = kv_format or cfg.kv_dtype
    if kv_format == FP8_FLASHMLA:
        if not cfg.is_mla:
            raise ValueError("fp8_flashmla applies to MLA models only")
        tiles = -(-cfg.kv_lora_rank // _FLASHMLA_TILE)
        return cfg.kv_lora_rank + 4 * tiles + 2 * cfg.qk_rope_head_dim
    return cfg.kv_width * np_dtype(kv_format).itemsize


def kv_bytes_per_token(cfg: ModelConfig, kv_format: str | None = None) -> int:
    """Bytes of cached KV for one token across all layers."""
    return cfg.num_layers * kv_bytes_per_token_per_layer(cfg, kv_format)


class UnsupportedLayout(NotImplementedError):
    """A KV layout that a part of the system cannot take yet (several layer groups, or a group
    that does not keep every token); the message names the part and the layout."""


class Retention(enum.StrEnum):
    """Which KV of a context of `n` tokens a layer group keeps (`LayerGroup.kept_tokens`)."""

    ALL = "all"  # full attention: every token's row
    WINDOW = "window"  # sliding window: the rows of the last `window` tokens
    STATE = "state"  # recurrent: one state per block (the state after its last token), no rows


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers that keep the same KV: which layers, their row, page geometry and retention.

    `layers` are model layer indices, ascending. A *row* is `row_bytes` bytes: one token's KV
    (`Retention.ALL`, `WINDOW`), or the whole state (`STATE`). `row` says where each KV head's
    key and value sit in a row of `kv_dtype` elements (`row_bytes == row.row_width *
    itemsize`); it is None where the layout is bytes only (made from sizes, or a KV format with
    no `RowLayout` such as `fp8_flashmla`). A block covers `block_tokens` tokens and holds, per
    layer, `[rows_per_block, row_bytes]` uint8: every token's row (`ALL` and `WINDOW` store all
    of them, so a prefix may end at any block), or one state (`STATE`). A device page holds
    `page_size` tokens' rows per layer (0 is read as `block_tokens`: a page is one block); a
    `STATE` group's page is its one state. Frozen and hashable: static config under jit.
    """

    layers: tuple[int, ...]
    row_bytes: int
    block_tokens: int
    page_size: int = 0
    retention: Retention = Retention.ALL
    window: int = 0  # WINDOW: how many of the last tokens the group keeps (W)
    row: RowLayout | None = None
    kv_dtype: str = ""  # the row's element dtype (or KV format) name; "" with no `row`

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # normalize what JSON and callers may give as lists / strings
        set_(self, "layers", tuple(int(i) for i in self.layers))
        set_(self, "retention", Retention(self.retention))
        set_(self, "page_size", self.page_size or self.block_tokens)
        where = f"layer group {self.layers}"
        if not self.layers or self.layers[0] < 0 or list(self.layers) != sorted(set(self.layers)):
            raise ValueError(f"{where}: layers must be distinct, ascending and >= 0")
        if min(self.row_bytes, self.block_tokens, self.page_size) <= 0:
            raise ValueError(f"{where}: row_bytes, block_tokens and page_size must be positive")
        if self.block_tokens % self.page_size:
            raise ValueError(f"{where}: page_size {self.page_size} must divide {self.block_tokens}")
        if (self.retention == Retention.WINDOW) != (self.window > 0):
            raise ValueError(f"{where}: a window > 0 goes with retention 'window' and only with it")
        if self.retention == Retention.STATE and self.page_size != self.block_tokens:
            raise ValueError(f"{where}: a state group's page is its one state per block")
        if self.row is not None:
            if not self.kv_dtype:
                raise ValueError(f"{where}: a row layout needs its kv_dtype")
            width = self.row.row_width * np_dtype(self.kv_dtype).itemsize
            if width != self.row_bytes:
                raise ValueError(
                    f"{where}: row_bytes {self.row_bytes} != the row layout's {width} bytes"
                )

    @property
    def rows_per_block(self) -> int:
        """Rows one layer of the group holds per block: `block_tokens`, or 1 (a state)."""
        return 1 if self.retention == Retention.STATE else self.block_tokens

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer's part of a block, `[rows_per_block, row_bytes]`."""
        return self.rows_per_block * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the group's parts of a block (every layer of it)."""
        return len(self.layers) * self.layer_nbytes

    @property
    def pages_per_block(self) -> int:
        return self.block_tokens // self.page_size if self.retention != Retention.STATE else 1

    @property
    def page_nbytes(self) -> int:
        """Bytes of one layer's page: `[page_size, row_bytes]`, or one state."""
        return self.layer_nbytes // self.pages_per_block

    def kept_tokens(self, n: int) -> int:
        """How many tokens' rows the group keeps for a context of `n` tokens: `n` (all),
        `min(n, window)` (a window), 0 (a state keeps no token's row)."""
        if n < 0:
            raise ValueError(f"a context of {n} tokens")
        if self.retention == Retention.ALL:
            return n
        return min(n, self.window) if self.retention == Retention.WINDOW else 0

    def kept_bytes(self, n: int) -> int:
        """Bytes one layer keeps for a context of `n` tokens (a state: its one row, once n > 0)."""
        if self.retention == Retention.STATE:
            return self.row_bytes if n > 0 else 0
        return self.kept_tokens(n) * self.row_bytes

    def needed_blocks(self, n: int) -> range:
        """The blocks (indices) whose part of this group a context of `n` tokens reads: those
        holding its kept rows (a window's may begin inside a block), or for a state the last
        whole block's (empty before the first block ends)."""
        bt = self.block_tokens
        if self.retention == Retention.STATE:
            return range(n // bt - 1, n // bt) if n >= bt else range(0)
        return range((n - self.kept_tokens(n)) // bt, -(-n // bt))

    @property
    def summary(self) -> str:
        """One line for errors and logs, e.g. `layers 0-2: all tokens, 256 B rows`."""
        rule = {
            Retention.ALL: "all tokens",
            Retention.WINDOW: f"last {self.window} tokens",
            Retention.STATE: "one state per block",
        }[self.retention]
        which = "layer" if len(self.layers) == 1 else "layers"
        return f"{which} {_span(self.layers)}: {rule}, {self.row_bytes} B rows"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`from_dict` reads it back equal)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["layers"] = list(self.layers)
        d["retention"] = self.retention.value
        d["row"] = None if self.row is None else _row_to_dict(self.row)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerGroup:
        row = d.get("row")
        return cls(**{**d, "row": None if row is None else _row_from_dict(row)})


def _span(layers: Sequence[int]) -> str:
    """`0-2` for a run of three or more consecutive layers, else the list (`0,2`, `1`)."""
    if len(layers) > 2 and list(layers) == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ",".join(map(str, layers))


def _resized(
    groups: tuple[LayerGroup, ...],
    num_layers: int | None,
    block_tokens: int | None,
    bytes_per_token_per_layer: int | None,
) -> LayerGroup:
    """The one group of a uniform layout with the sizes given changed (what
    `dataclasses.replace(layout, num_layers=2)` asks for); the row stays if its width does."""
    if len(groups) != 1 or groups[0].retention != Retention.ALL:
        raise TypeError("only a one-group layout keeping all tokens is resized by its sizes")
    g = groups[0]
    width = g.row_bytes if bytes_per_token_per_layer is None else bytes_per_token_per_layer
    same_row = width == g.row_bytes
    return LayerGroup(
        tuple(range(len(g.layers) if num_layers is None else num_layers)),
        width,
        g.block_tokens if block_tokens is None else block_tokens,
        page_size=0 if g.page_size == g.block_tokens else g.page_size,
        row=g.row if same_row else None,
        kv_dtype=g.kv_dtype if same_row else "",
    )


def _row_to_dict(row: RowLayout) -> dict[str, Any]:
    return json.loads(json.dumps(dataclasses.asdict(row)))  # tuples -> lists


def _row_from_dict(d: dict[str, Any]) -> RowLayout:
    def tup(v: Any) -> Any:
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    return RowLayout(**{k: tup(v) for k, v in d.items()})


@dataclasses.dataclass(frozen=True, init=False)
class BlockLayout:
    """The KV of one block of `block_tokens` tokens, as layer groups (`LayerGroup`).

    Two ways to make one: `BlockLayout(num_layers, block_tokens, bytes_per_token_per_layer)`,
    one group keeping all tokens of every layer (bytes only, no `RowLayout`), or
    `BlockLayout(groups=...)`; `for_model` maps a `ModelConfig` to its groups (the store's
    layout is its model's). Sizes given with the one group of a uniform layout resize it, so
    `dataclasses.replace(layout, num_layers=2)` works as on a Full Block's shape. The groups'
    layers partition `0..num_layers-1` and share `block_tokens` (a block is one span of tokens
    for every group: the hash chain names it); they are kept ordered by first layer. A block's
    bytes are its layers' parts in layer order (`layer_offset`).

    The uniform Full Block's attributes (`shape` `[num_layers, block_tokens,
    bytes_per_token_per_layer]`, `bytes_per_token_per_layer`, `layer_nbytes`) are those of a
    one-group layout keeping all tokens (`uniform`); on any other they raise
    `UnsupportedLayout`, as do the parts that take only such a layout (`require_uniform`).
    """

    groups: tuple[LayerGroup, ...]

    def __init__(
        self,
        num_layers: int | None = None,
        block_tokens: int | None = None,
        bytes_per_token_per_layer: int | None = None,
        *,
        groups: Iterable[LayerGroup] = (),
    ):
        sizes = (num_layers, block_tokens, bytes_per_token_per_layer)
        groups = tuple(groups)
        if groups and any(s is not None for s in sizes):
            groups = (_resized(groups, *sizes),)  # dataclasses.replace(layout, num_layers=...)
        elif not groups:
            if any(s is None for s in sizes):
                raise TypeError(
                    "BlockLayout(num_layers, block_tokens, bytes_per_token_per_layer) needs all three"
                )
            if min(sizes) <= 0:
                raise ValueError(f"block layout {sizes} must be positive")
            groups = (
                LayerGroup(tuple(range(num_layers)), bytes_per_token_per_layer, block_tokens),
            )
        groups = tuple(sorted(groups, key=lambda g: g.layers[0]))
        layers = sorted(i for g in groups for i in g.layers)
        if layers != list(range(len(layers))):
            raise ValueError(
                f"the groups' layers {[g.layers for g in groups]} must cover 0..L-1 once each"
            )
        if len({g.block_tokens for g in groups}) != 1:
            raise ValueError(
                f"every group covers the same block_tokens, got {[g.block_tokens for g in groups]}"
            )
        object.__setattr__(self, "groups", groups)

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, block_tokens: int, kv_format: str | None = None, page_size: int = 0
    ) -> BlockLayout:
        """The layout of `cfg`'s KV in blocks of `block_tokens` tokens (pages of `page_size`,
        0: one block): one group keeping all tokens, plus a "last `sliding_window` tokens" group
        of `cfg.sliding_window_layers` if it has any. Rows are `RowLayout.for_model(cfg)` in
        `kv_format` (default `cfg.kv_dtype`; `fp8_flashmla`: bytes only)."""
        fmt = kv_format or cfg.kv_dtype
        common = dict(
            row_bytes=kv_bytes_per_token_per_layer(cfg, kv_format),
            block_tokens=block_tokens,
            page_size=page_size,
            row=None if fmt == FP8_FLASHMLA else RowLayout.for_model(cfg),
            kv_dtype=fmt,
        )
        windowed = set(cfg.sliding_window_layers) if cfg.sliding_window else set()
        full = tuple(i for i in range(cfg.num_layers) if i not in windowed)
        groups = [LayerGroup(full, **common)] if full else []
        if windowed:
            groups.append(
                LayerGroup(
                    tuple(sorted(windowed)),
                    retention=Retention.WINDOW,
                    window=cfg.sliding_window,
                    **common,
                )
            )
        return cls(groups=groups)

    # ----------------------------------------------------------------- any layout

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def block_tokens(self) -> int:
        return self.groups[0].block_tokens

    @property
    def nbytes(self) -> int:
        """Bytes of one block (every group's parts)."""
        return sum(g.nbytes for g in self.groups)

    @property
    def uniform(self) -> bool:
        """One group keeping all tokens: the uniform Full Block every part takes today."""
        return len(self.groups) == 1 and self.groups[0].retention == Retention.ALL

    def group_index(self, layer: int) -> int:
        """The index in `groups` of the group holding `layer`."""
        for k, g in enumerate(self.groups):
            if layer in g.layers:
                return k
        raise IndexError(f"layer {layer} outside [0, {self.num_layers})")

    def group_of(self, layer: int) -> LayerGroup:
        return self.groups[self.group_index(layer)]

    def layer_part_shape(self, layer: int) -> tuple[int, int]:
        """`[rows_per_block, row_bytes]` of one layer's part of a block."""
        g = self.group_of(layer)
        return (g.rows_per_block, g.row_bytes)

    def layer_offset(self, layer: int) -> int:
        """Byte offset of a layer inside a block's payload (`num_layers`: the payload's end)."""
        if not 0 <= layer <= self.num_layers:
            raise IndexError(f"layer {layer} outside [0, {self.num_layers}]")
        if self.uniform:  # the common case, without a walk over the layers
            return layer * self.groups[0].layer_nbytes
        return sum(self.group_of(i).layer_nbytes for i in range(layer))

    @property
    def summary(self) -> str:
        """One line naming the groups, e.g. `layers 0-2: all tokens, ...; layer 3: last 64
        tokens, ...`."""
        return "; ".join(g.summary for g in self.groups)

    def require_uniform(self, where: str) -> BlockLayout:
        """This layout if it is `uniform`, else `UnsupportedLayout` naming `where` (the part
        that takes only the uniform Full Block)."""
        if not self.uniform:
            raise UnsupportedLayout(
                f"{where} takes one layer group keeping all tokens (the uniform Full Block "
                f"[num_layers, block_tokens, bytes]); this layout has {len(self.groups)} "
                f"group(s): {self.summary}"
            )
        return self

    # ----------------------------------------------------------------- the uniform Full Block

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.require_uniform("BlockLayout.bytes_per_token_per_layer").groups[0].row_bytes

    @property
    def shape(self) -> tuple[int, int, int]:
        """`[num_layers, block_tokens, bytes_per_token_per_layer]` of the uniform Full Block."""
        g = self.require_uniform("BlockLayout.shape").groups[0]
        return (len(g.layers), g.block_tokens, g.row_bytes)

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one Layer Block of the uniform Full Block."""
        return self.require_uniform("BlockLayout.layer_nbytes").groups[0].layer_nbytes

    # ----------------------------------------------------------------- identity

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: `{"groups": [...]}` (`from_dict` reads it back equal)."""
        return {"groups": [g.to_dict() for g in self.groups]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlockLayout:
        return cls(groups=[LayerGroup.from_dict(g) for g in d["groups"]])

    def to_json(self) -> str:
        """Canonical JSON (sorted keys, no spaces): equal layouts give equal text."""
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @property
    def digest(self) -> str:
        """Hex BLAKE2b-128 of `to_json()`: the same in every process (unlike `hash()`)."""
        return hashlib.blake2b(self.to_json().encode(), digest_size=16).hexdigest()


def kv_rows_to_bytes(rows: np.ndarray) -> np.ndarray:
    """`[..., T, W]` KV rows -> `[..., T, W * itemsize]` uint8 (a view when contiguous)."""
    rows = np.ascontiguousarray(rows)
    return rows.view(np.uint8).reshape(*rows.shape[:-1], rows.shape[-1] * rows.dtype.itemsize)


def bytes_to_kv_rows(data: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`[..., T, bytes]` uint8 -> `[..., T, W]` KV rows in `cfg.kv_dtype`."""
    dt = np_dtype(cfg.kv_dtype)
    expected = cfg.kv_width * dt.itemsize
    if data.dtype != np.uint8 or data.shape[-1] != expected:
        raise ValueError(
            f"KV bytes of shape {data.shape} dtype {data.dtype}: expected uint8 with last axis {expected}"
        )
    return np.ascontiguousarray(data).view(dt).reshape(*data.shape[:-1], cfg.kv_width)


def kv_to_full_blocks(kv: np.ndarray, block_tokens: int) -> np.ndarray:
    """All layers' KV rows `[L, T, W]` (T a multiple of block_tokens) -> `[n, L, bt, bytes]` uint8."""
    n_layers, t, _ = kv.shape
    if t % block_tokens:
        raise ValueError(f"{t} tokens is not a whole number of {block_tokens}-token blocks")
    b = kv_rows_to_bytes(kv)  # [L, T, bytes]
    n = t // block_tokens
    return np.ascontiguousarray(b.reshape(n_layers, n, block_tokens, -1).transpose(1, 0, 2, 3))


def full_blocks_to_kv(blocks: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """`[n, L, bt, bytes]` uint8 Full Blocks -> KV rows `[L, n * bt, W]`."""
    n, n_layers, bt, nbytes = blocks.shape
    if n_layers != cfg.num_layers:
        raise ValueError(f"blocks have {n_layers} layers, model has {cfg.num_layers}")
    flat = blocks.transpose(1, 0, 2, 3).reshape(n_layers, n * bt, nbytes)
    return bytes_to_kv_rows(flat, cfg)


def layer_block(full_block: np.ndarray, layer: int) -> np.ndarray:
    """The Layer Block `[1, bt, bytes]` of one layer of a Full Block `[L, bt, bytes]` (a view)."""
    return full_block[layer : layer + 1]


def layer_blocks_to_full(layer_blocks: list[np.ndarray]) -> np.ndarray:
    """Concatenates a block's Layer Blocks (in layer order) into its Full Block."""
    return np.concatenate(layer_blocks, axis=0)
