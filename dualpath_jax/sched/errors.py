"""The scheduler's exceptions (pure Python: `dualpath_jax.native` compiles the modules that raise
them, and compiled classes cannot subclass `RuntimeError`)."""


class QueueFull(RuntimeError):
    """The scheduler holds `max_queue` requests already; the client should retry later."""
