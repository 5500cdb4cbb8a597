"""Incremental detokenization with stop strings, shared by the completion and chat endpoints."""

from __future__ import annotations

from collections.abc import Sequence

from dualpath_jax.serving.tokenizer import Tokenizer


class TextStream:
    """Turns a round's generated ids into text as they arrive.

    `add(ids)` returns the text that is now final: it holds back ids that do not yet decode to
    whole characters (a trailing U+FFFD) and a tail that could still become a stop string. When a
    stop string appears, the text ends before it and `stopped` is set; later ids are ignored.
    `close()` returns what was held back (none of it once stopped). End-of-turn ids (`eos_ids`)
    never show as text. `used` counts the ids the answer is made of: all of them, or once
    stopped those up to the one that completed the stop string (ids decoded after it are not the
    answer's). A stop string counts only once `min_tokens` ids have come (as vLLM checks them):
    one completed by an earlier id is part of the answer.

    Decoding is incremental: each `add` decodes a window of the ids (from the last emitted
    boundary, with the ids before it as context for tokenizers whose pieces depend on their
    neighbours), not the whole sequence, so a round of n tokens costs O(n) decoding, and a stop
    string is looked for only where new text could complete it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: Sequence[str] = (),
        eos_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ):
        self.tok = tokenizer
        self.stops = [s for s in stops if s]
        self.eos = set(eos_ids)
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to the context before the undecoded ids
        self.read = 0  # ids[:read] are decoded into `done`
        self.done = ""  # their text
        self.sent = 0  # characters of `text` already returned
        self.text = ""  # the text so far (cut at a stop string once one matched)
        self.stopped = False
        self.used = 0
        self.min_tokens = min_tokens

    def add(self, ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        early = max(0, min(len(ids), self.min_tokens - self.used))  # before min_tokens: no stop
        out = self._add(ids[:early], find=False) if early else ""
        if early < len(ids):
            out += self._add(ids[early:], find=True)
        return out

    def _add(self, ids: Sequence[int], find: bool) -> str:
        base = len(self.ids)
        self.ids += [i for i in ids if i not in self.eos]
        self._decode(final=False)
        cut = self._first_stop(self.text) if find else -1
        if cut >= 0:
            self.stopped = True
            self.used += self._ids_to_stop(ids, base)
            self.text = self.text[:cut]
            return self._release(cut)
        self.used += len(ids)
        safe = len(self.text) - self._stop_prefix(self.text)
        return self._release(safe)

    def _decode(self, final: bool) -> None:
        """`text` after the ids past `read`: their whole characters, moved into `done` once no
        character is left incomplete (or anyway when `final`); an incomplete one stays undecoded
        (its ids are decoded again with the next ones)."""
        if self.read == len(self.ids):
            return
        before = self.tok.decode(self.ids[self.prefix : self.read])
        new = self.tok.decode(self.ids[self.prefix :])[len(before) :]
        if new.endswith("\ufffd") and not final:
            self.text = self.done + new.rstrip("\ufffd")
            return
        self.done += new
        self.text = self.done
        self.prefix, self.read = self.read, len(self.ids)

    def _ids_to_stop(self, ids: Sequence[int], base: int) -> int:
        """How many of `ids` (appended after `base` text ids) it took for a stop string to
        appear (once per round: a decode per id of this delta)."""
        for j in range(1, len(ids)):
            head = self.ids[:base] + [i for i in ids[:j] if i not in self.eos]
            if self._first_stop(self.tok.decode(head)) >= 0:
                return j
        return len(ids)

    def close(self) -> str:
        """The rest of the text (held-back characters) once no more ids come."""
        if self.stopped:
            return ""
        self._decode(final=True)
        cut = self._first_stop(self.text) if self.used >= self.min_tokens else -1
        if cut >= 0:
            self.stopped = True
            self.text = self.text[:cut]
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out = self.text[self.sent : upto]
        self.sent = upto
        return out

    def _first_stop(self, text: str) -> int:
        """Where the earliest stop string starts in `text` (-1: none). Only the part after what
        was released can hold a new match."""
        found = -1
        for s in self.stops:
            i = text.find(s, max(0, self.sent - len(s) + 1))
            if i >= 0 and (found < 0 or i < found):
                found = i
        return found

    def _stop_prefix(self, text: str) -> int:
        """The length of the longest tail of `text` that begins some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
