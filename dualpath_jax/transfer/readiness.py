"""Per-request, per-layer readiness: the prefill loop waits for layer i only.

Lifecycle: the loader creates one `LayerReadiness` per request load, calls `set_ready(i, value)`
as each layer's hit KV lands (in any order), or `set_error(exc)` / `cancel()` once; the prefill
loop calls `wait(i)` just before layer i runs. Errors and cancellation reach every waiter.
"""

from __future__ import annotations

import threading
from typing import Any


class LoadCancelled(RuntimeError):
    """The load was cancelled (request aborted or engine shutting down)."""


class LoadTimeout(TimeoutError):
    """A layer did not become ready within the wait's timeout."""


class LayerReadiness:
    """Readiness of `num_layers` layers, each carrying a value (e.g. that layer's KV rows)."""

    def __init__(self, num_layers: int, name: str = ""):
        self.num_layers = num_layers
        self.name = name
        self._cond = threading.Condition()
        self._values: dict[int, Any] = {}
        self._error: BaseException | None = None

    def set_ready(self, layer: int, value: Any = None) -> None:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"{self.name}: layer {layer} outside [0, {self.num_layers})")
        with self._cond:
            self._values[layer] = value
            self._cond.notify_all()

    def set_error(self, exc: BaseException) -> None:
        """Fails the load; the first error wins."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def cancel(self) -> None:
        self.set_error(LoadCancelled(f"{self.name}: load cancelled"))

    @property
    def error(self) -> BaseException | None:
        return self._error

    def is_ready(self, layer: int) -> bool:
        with self._cond:
            return layer in self._values

    @property
    def ready_count(self) -> int:
        with self._cond:
            return len(self._values)

    def all_ready(self) -> bool:
        return self.ready_count == self.num_layers

    def wait(self, layer: int, timeout_s: float | None = None) -> Any:
        """Blocks until `layer` is ready and returns its value; raises the load's error, or
        `LoadTimeout` after `timeout_s`."""
        with self._cond:
            ok = self._cond.wait_for(
                lambda: layer in self._values or self._error is not None, timeout=timeout_s
            )
            if self._error is not None:
                raise self._error
            if not ok:
                raise LoadTimeout(f"{self.name}: layer {layer} not ready after {timeout_s:.1f}s")
            return self._values[layer]

    def wait_all(self, timeout_s: float | None = None) -> list[Any]:
        """Waits for every layer (the Basic baseline loads the whole hit before the forward)."""
        return [self.wait(i, timeout_s) for i in range(self.num_layers)]
