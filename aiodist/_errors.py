"""The aiodist error tree.

Every error aiodist raises on purpose is an :class:`AiodistError`, and also the
built-in exception a Python user would reach for, so ``except ValueError`` keeps
working::

    AiodistError
    ├── InvalidArgumentError(ValueError)     a bad value was passed to an aiodist API
    │   └── DeviceError                      a device string is malformed or unavailable
    ├── ContextError(RuntimeError)           an API was called in the wrong context
    └── RendezvousError(RuntimeError)        a rendezvous cannot complete; raised instead
        │                                    of hanging, in every waiting replica
        ├── ReplicaExitedError               a replica finished without joining it
        ├── CollectiveMismatchError(ValueError)   replicas called different things
        └── RendezvousTimeoutError(TimeoutError)  CommunicationOptions.timeout_seconds ran out

and, in ``aiodist.serving``, the batcher's ``Overloaded`` and ``NotServing``
(both ``RuntimeError``).

Messages say what happened (with the values), what was expected, and what to do,
and end with a link to their section of ``docs/errors.md`` (one per class).
"""

from __future__ import annotations

__all__ = [
    "AiodistError",
    "CollectiveMismatchError",
    "ContextError",
    "DeviceError",
    "InvalidArgumentError",
    "RendezvousError",
    "RendezvousTimeoutError",
    "ReplicaExitedError",
]


class AiodistError(Exception):
    """Base class of every error aiodist raises on purpose.

    Its message ends with where the docs explain it: the section of
    ``docs/errors.md`` for the class (or its nearest documented base).
    """

    def __str__(self) -> str:
        message = super().__str__()
        # Every aiodist error class has a section there (tests/test_package.py checks
        # it): the nearest one in the class's MRO, so a user's own subclass links to
        # the aiodist class it derives from.
        documented = next(c for c in type(self).__mro__ if c.__module__.startswith("aiodist."))
        return f"{message} [docs/errors.md#{documented.__name__.lower()}]"


class InvalidArgumentError(AiodistError, ValueError):
    """A value passed to an aiodist API is not one it accepts."""


class DeviceError(InvalidArgumentError):
    """A device string is malformed, or names a device that is not available."""


class ContextError(AiodistError, RuntimeError):
    """An API was called in a context where it cannot work.

    For example a cross-replica method called inside a replica function, or
    ``strategy.run`` called inside another ``strategy.run``.
    """


class RendezvousError(AiodistError, RuntimeError):
    """A rendezvous (merge_call, all_reduce, all_gather) cannot complete.

    TensorFlow hangs in these situations; aiodist raises a subclass of this in
    every replica that waits, and ``strategy.run`` raises it.
    """


class ReplicaExitedError(RendezvousError):
    """A replica returned or raised while others wait in a collective it never joined."""


class CollectiveMismatchError(RendezvousError, ValueError):
    """Replicas called different collectives (or ops, structures, shapes, dtypes)
    at the same call number."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """``CommunicationOptions(timeout_seconds=...)`` expired before every replica arrived."""
