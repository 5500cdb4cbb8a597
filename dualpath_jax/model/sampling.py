"""`SamplingParams`: how a round draws its tokens, the one value that carries it from the user's
call (rollout, client, HTTP server) over the wire (`engine.messages.Submit`, `LoadJobMsg`) to the
engines' sampling (`model.sampler.sample_at`, `Decoder.insert`).

`temperature` 0 is greedy; above 0 the token at absolute position p of a sequence is drawn from
softmax(logits / temperature), restricted to the smallest set of most likely tokens whose mass
reaches `top_p`, with the key `fold_in(key(seed), p)`: a round's tokens depend only on the
params, the context and the seed, never on batching, engine or retries.

Its fields are checked when it is made, here and nowhere else, also when it arrives on the wire
(msgspec runs `__post_init__` while decoding, so a bad value never enters a process):

>>> SamplingParams(temperature=0.7, top_p=0.9, seed=5)
SamplingParams(temperature=0.7, top_p=0.9, seed=5)
>>> SamplingParams(top_p=0.0)
Traceback (most recent call last):
...
dualpath_jax.model.sampling.SamplingError: top_p must lie in (0, 1], got 0.0

Imports no JAX: the control plane (`engine.messages`) carries it.
"""

from __future__ import annotations

import math
import numbers

import msgspec

SEED_LIMIT = 2**32  # seeds are uint32


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

    def __post_init__(self) -> None:
        # Plain Python numbers (numpy scalars are accepted and converted), so the value encodes.
        msgspec.structs.force_setattr(self, "temperature", _real(self.temperature, "temperature"))
        msgspec.structs.force_setattr(self, "top_p", _real(self.top_p, "top_p"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise SamplingError("seed", f"seed must be an int, got {self.seed!r}")
        msgspec.structs.force_setattr(self, "seed", int(self.seed))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise SamplingError(
                "temperature", f"temperature must be a finite number >= 0, got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise SamplingError("top_p", f"top_p must lie in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < SEED_LIMIT:
            raise SamplingError("seed", f"seed must lie in [0, 2**32), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _real(value: object, field: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(field, f"{field} must be a number, got {value!r}")
    return float(value)


GREEDY = SamplingParams()
