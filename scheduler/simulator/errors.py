"""The simulator's own error: a module of its own because mypyc compiles the engine, and a
compiled class cannot subclass a builtin exception (scheduler.native leaves this one Python)."""


class PlanError(RuntimeError):
    """A plan that breaks the contract for the snapshot it was given."""
