"""Tokenizers for the HTTP server: a Hugging Face checkpoint's own, or bytes for the tiny models.

`load_tokenizer(path, vocab_size)` returns a `Tokenizer`: `encode(text)`, `decode(ids)`,
`chat(messages)` (the prompt's token ids after the chat template, ending with the assistant's
generation prompt) and `eos_ids` (the ids that end a turn: a round stops after one unless the
request sets `ignore_eos`).

- A directory with tokenizer files (a Hugging Face checkpoint) loads with `transformers`'
  `AutoTokenizer`, offline; `chat` applies the checkpoint's chat template.
- Without one, models of 257 ids (the tiny presets) read text as UTF-8 bytes: id b is byte b and
  id 256 ends a turn. Their chat format is `<|role|>\\n` + content + the end id per message, then
  `<|assistant|>\\n`. Any other vocabulary needs a tokenizer directory.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

BYTE_VOCAB = 257  # 256 bytes and the end-of-turn id

log = logging.getLogger(__name__)


class TokenizerError(ValueError):
    """A tokenizer could not be loaded, or text could not be turned into ids."""


class Tokenizer(Protocol):
    name: str
    eos_ids: list[int]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]: ...


def _text_of(content: Any) -> str:
    """A chat message's content as text: a string, or OpenAI's list of `{"type": "text"}`
    parts (other part types are refused)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                raise TokenizerError(f"content parts of type {kind!r} are not supported")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    if content is None:
        return ""
    raise TokenizerError(f"message content must be a string or a list of parts, got {content!r}")


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and 256 as the end of a turn (the tiny presets' 257 ids)."""

    name = "bytes"
    END = 256

    def __init__(self):
        self.eos_ids = [self.END]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        ids: list[int] = []
        for m in messages:
            ids += self.encode(f"<|{m.get('role', 'user')}|>\n{_text_of(m.get('content'))}")
            ids.append(self.END)
        return ids + self.encode("<|assistant|>\n")


class HFTokenizer:
    """A Hugging Face tokenizer (`transformers.AutoTokenizer`, local files only); `as_written`:
    the directory's `tokenizer.json` as it is (`PreTrainedTokenizerFast`), whatever class the
    model type maps to."""

    def __init__(self, path: str | pathlib.Path, as_written: bool = False):
        try:
            from transformers import AutoTokenizer, PreTrainedTokenizerFast
        except ImportError as e:  # pragma: no cover - the serve extra installs it
            raise TokenizerError(
                "a checkpoint's tokenizer needs transformers (pip install 'dualpath_jax[serve]')"
            ) from e
        cls = PreTrainedTokenizerFast if as_written else AutoTokenizer
        try:
            self.tok = cls.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # noqa: BLE001 - any loading problem names the directory
            raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
        self.name = pathlib.Path(path).name
        eos = self.tok.eos_token_id
        ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
        # A chat model's end-of-turn token may differ from its end of text (e.g. <|im_end|>).
        for t in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<｜end▁of▁sentence｜>"):
            i = self.tok.convert_tokens_to_ids(t)
            if isinstance(i, int) and i != self.tok.unk_token_id and i not in ids:
                ids.append(i)
        self.eos_ids = [int(i) for i in ids]

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise TokenizerError(f"the tokenizer of {self.name} has no chat template")
        msgs = [{**m, "content": _text_of(m.get("content"))} for m in messages]
        try:
            out = self.tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - template errors are the request's problem
            raise TokenizerError(f"the chat template failed: {e}") from e
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # a BatchEncoding
            out = out["input_ids"]
        return [int(i) for i in out]


def has_tokenizer(path: str | pathlib.Path) -> bool:
    p = pathlib.Path(path)
    return any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


PROBE = "hello world the answer is 42"  # words every text tokenizer can spell and join back


def check_tokenizer(tok: Tokenizer, vocab_size: int, where: str) -> None:
    """Refuses a tokenizer that cannot serve: one that encodes `PROBE` to no ids, to ids outside
    the model's vocabulary, or that decodes its own ids to other text (a tokenizer `transformers`
    loaded as another class than its files describe does all of these)."""
    unknown = {getattr(getattr(tok, "tok", None), "unk_token_id", None)} - {None}
    ids = tok.encode(PROBE)
    if not [i for i in ids if i not in unknown]:
        raise TokenizerError(f"the tokenizer in {where} encodes {PROBE!r} to no known ids: {ids}")
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise TokenizerError(
            f"the tokenizer in {where} encodes {PROBE!r} to ids {bad[:4]} outside the model's"
            f" {vocab_size}"
        )
    back = tok.decode(ids)
    if back.strip() != PROBE:
        raise TokenizerError(
            f"the tokenizer in {where} does not decode its own ids: {PROBE!r} -> {ids[:8]}..."
            f" -> {back!r}"
        )


def load_tokenizer(path: str | pathlib.Path | None, vocab_size: int) -> Tokenizer:
    """The tokenizer in `path` (a Hugging Face directory, checked by `check_tokenizer`), else
    bytes for a 257-id model."""
    if path and has_tokenizer(path):
        names = ("tokenizer.json", "tokenizer_config.json")
        files = [f for f in names if (pathlib.Path(path) / f).exists()]
        where = f"{path} ({', '.join(files)})"
        tok = HFTokenizer(path)
        try:
            check_tokenizer(tok, vocab_size, where)
        except TokenizerError as e:
            # transformers may map the model type to a tokenizer class that rebuilds the files
            # differently (a word-level tokenizer.json beside a Qwen2 config.json loads as a BPE
            # Qwen2Tokenizer that encodes nothing): the file as written, if it serves
            if "tokenizer.json" not in files:
                raise
            try:
                written = HFTokenizer(path, as_written=True)
                check_tokenizer(written, vocab_size, where)
            except TokenizerError as e2:
                cls = type(tok.tok).__name__
                raise TokenizerError(f"{e2} (and as transformers loads it, {cls}: {e})") from None
            log.warning(
                "%s: transformers loads it as %s, which fails (%s); serving tokenizer.json as"
                " written", where, type(tok.tok).__name__, e,
            )  # fmt: skip
            return written
        return tok
    if vocab_size == BYTE_VOCAB:
        return ByteTokenizer()
    where = f"{path} has no tokenizer files" if path else "no tokenizer directory was given"
    raise TokenizerError(
        f"{where}, and a model of {vocab_size} ids cannot use the byte tokenizer"
        f" (it needs {BYTE_VOCAB})"
    )
