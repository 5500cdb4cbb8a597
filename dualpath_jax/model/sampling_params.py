"""`SamplingParams`: how a round draws its tokens, the one value that carries it from the user's
call (rollout, client, HTTP server) over the wire (`wire.messages.Submit`, `LoadJobMsg`) to the
engines' sampling (`model.sampler.sample_at`, `Decoder.insert`).

`temperature` 0 is greedy; above 0 the token at absolute position p of a sequence is drawn from
softmax(logits / temperature), restricted to the smallest set of most likely tokens whose mass
reaches `top_p`, with the key `fold_in(key(seed), p)`: a round's tokens depend only on the
params, the context and the seed, never on batching, engine or retries.

`logprobs` (as vLLM's): None reports no log-probabilities; 0 reports, for each generated token,
its log-probability under the distribution it was drawn from (temperature and top-p applied, stop
tokens held back by `min_tokens` excluded; a greedy round's is the model's) and under the model
(the plain log-softmax of its logits); k > 0 adds the k most likely tokens under the model with
their log-probabilities (at most `MAX_TOP_LOGPROBS`). It changes no token.

`min_tokens` (as vLLM's): the round's stop tokens (`Submit.stop_tokens`, e.g. the end-of-turn
ids) cannot end it before it has `min_tokens` tokens. While fewer have been generated their
logits are -inf before any other step of sampling (`held_back` says which a draw masks), so
greedy and sampled rounds alike draw another token; 0 masks nothing and changes no token.

Its fields are checked when it is made, here and nowhere else, also when it arrives on the wire
(msgspec runs `__post_init__` while decoding, so a bad value never enters a process):

>>> SamplingParams(temperature=0.7, top_p=0.9, seed=5)
SamplingParams(temperature=0.7, top_p=0.9, seed=5, min_tokens=0, logprobs=None)
>>> SamplingParams(top_p=0.0)
Traceback (most recent call last):
...
dualpath_jax.model.sampling_params.SamplingError: top_p must lie in (0, 1], got 0.0

Imports no JAX: the control plane (`wire.messages`) carries it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import msgspec

SEED_LIMIT = 2**32  # seeds are uint32
TOKEN_LIMIT = 2**31  # min_tokens, like token counts, is an int32
# The most stop tokens a round with min_tokens > 0 may have: the decode step masks them from a
# fixed table per slot (one compiled shape), this wide.
MAX_HELD_STOP_TOKENS = 16
# The most alternatives `logprobs` may ask for per token (OpenAI's `top_logprobs` limit): the
# engines compute this many for every row that asks (one compiled shape) and keep what it asked.
MAX_TOP_LOGPROBS = 20


class SamplingError(ValueError):
    """A sampling field is out of range or of the wrong type; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a round samples (see the module docstring). Frozen; on the wire the fields left at
    their defaults are omitted (a greedy round's is an empty map)."""

    temperature: float = 0.0
    top_p: float = 1.0  # nucleus sampling (with temperature > 0)
    seed: int = 0  # uint32
    min_tokens: int = 0  # stop tokens cannot end the round before it has this many tokens
    logprobs: int | None = None  # None: none; 0: the drawn tokens'; k: and the top k (see above)

    def __post_init__(self) -> None:
        # Plain Python numbers (numpy scalars are accepted and converted), so the value encodes.
        msgspec.structs.force_setattr(self, "temperature", _real(self.temperature, "temperature"))
        msgspec.structs.force_setattr(self, "top_p", _real(self.top_p, "top_p"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise SamplingError("seed", f"seed must be an int, got {self.seed!r}")
        msgspec.structs.force_setattr(self, "seed", int(self.seed))
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, numbers.Integral):
            raise SamplingError("min_tokens", f"min_tokens must be an int, got {self.min_tokens!r}")
        msgspec.structs.force_setattr(self, "min_tokens", int(self.min_tokens))
        if self.logprobs is not None:
            if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, numbers.Integral):
                raise SamplingError(
                    "logprobs", f"logprobs must be None or an int, got {self.logprobs!r}"
                )
            msgspec.structs.force_setattr(self, "logprobs", int(self.logprobs))
            if not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
                raise SamplingError(
                    "logprobs",
                    f"logprobs must lie in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}",
                )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise SamplingError("top_p", f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise SamplingError("seed", f"seed must lie in [0, 2**32), got {self.seed}")
        if not 0 <= self.min_tokens < TOKEN_LIMIT:
            raise SamplingError(
                "min_tokens", f"min_tokens must lie in [0, 2**31), got {self.min_tokens}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_logprobs(self) -> int:
        """How many alternatives each token reports (0: none, also without `logprobs`)."""
        return self.logprobs or 0


def held_back(params: SamplingParams, stop_tokens: Sequence[int], generated: int) -> list[int]:
    """The tokens a round drawn with `params` may not draw as its generated token number
    `generated` (0: the first): its `stop_tokens` while fewer than `min_tokens` came before."""
    return list(stop_tokens) if generated < params.min_tokens else []


def min_tokens_problem(params: SamplingParams, gen: int, stop_tokens: Sequence[int]) -> str:
    """Why a round of `gen` tokens cannot take `params.min_tokens` with these stop tokens ("":
    it can)."""
    if params.min_tokens > gen:
        return f"min_tokens ({params.min_tokens}) exceeds the tokens to generate ({gen})"
    if params.min_tokens and len(set(stop_tokens)) > MAX_HELD_STOP_TOKENS:
        return (
            f"a round with min_tokens has at most {MAX_HELD_STOP_TOKENS} stop tokens, got"
            f" {len(set(stop_tokens))}"
        )
    return ""


def _real(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(field, f"{field} must be a number, got {value!r}")
    return float(value)


GREEDY = SamplingParams()
