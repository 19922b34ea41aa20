"""Replica and cross-replica contexts, kept in a ``contextvars.ContextVar``.

The state is one immutable tuple ``(strategy, replica, in_scope, group)``, read by
index with the constants ``STRATEGY``, ``REPLICA``, ``IN_SCOPE`` and ``GROUP``:

=============================  ==========  =========  =================================
where the code runs            strategy    replica    get_replica_context()
=============================  ==========  =========  =================================
outside any scope              None        None       the default replica context
``with s.scope():``            s           None       None (cross-replica context)
inside ``s.run(fn)``'s ``fn``  s           ctx        ctx (that replica's context)
inside a ``merge_fn``          s           None       None (cross-replica context)
=============================  ==========  =========  =================================

Every asyncio task copies the context it was created in, so concurrent tasks (a
server's requests, the replicas of one run) never see each other's state:
unlike TensorFlow's thread-local stacks, nothing leaks between coroutines.

``strategy.scope()`` returns a ``Scope``: as TF's, one object may be entered
again inside its own block, and tasks and threads sharing it may leave it in any
order (each entry is undone by the task or thread that made it, or, once that
task has finished, by another task in the context it was made in: pytest-asyncio
runs an async fixture's code before and after its ``yield`` as two tasks sharing
one context).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from typing import TYPE_CHECKING, Any

from ._errors import ContextError, InvalidArgumentError

if TYPE_CHECKING:
    from ._replica_context import ReplicaContext
    from ._strategy import Strategy

__all__ = [
    "GROUP",
    "IN_SCOPE",
    "REPLICA",
    "STRATEGY",
    "Scope",
    "current_replica",
    "current_strategy",
    "current_state",
    "experimental_set_strategy",
    "get_cross_replica_context",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "outside_any_scope",
    "register_default_strategy",
    "require_cross_replica",
    "scope_of",
    "twin_note",
]


# The fields of the state tuple:
# - STRATEGY: the Strategy, or None (the default strategy);
# - REPLICA: the ReplicaContext in a replica function, else None;
# - IN_SCOPE: entered with `with strategy.scope()` (vs experimental_set_strategy);
# - GROUP: the RunGroup whose replica function this is, in replica context, else None.
# A plain tuple, not a NamedTuple: the state is built for every replica of every run
# and read by every get_replica_context() and collective, and on Python 3.11 a
# NamedTuple's field is an unspecialised attribute lookup, building one calls
# tuple.__new__, and freeing one skips the tuple free list. Plain tuples: 7k
# instructions (about 1 us) less per (b) step at four replicas.
STRATEGY, REPLICA, IN_SCOPE, GROUP = range(4)
_State = tuple  # (strategy, replica, in_scope, group): for annotations

_OUTSIDE: _State = (None, None, False, None)
_STATE: contextvars.ContextVar[_State] = contextvars.ContextVar("aiodist_state", default=_OUTSIDE)
_default: dict[str, Any] = {}


def register_default_strategy(strategy: Strategy, replica_context: ReplicaContext) -> None:
    """Called once by the strategy module: the objects used outside any scope."""
    _default["strategy"] = strategy
    _default["replica_context"] = replica_context


def current_state() -> _State:
    return _STATE.get()


def current_replica() -> ReplicaContext | None:
    """The ReplicaContext of the replica function we are in, else None."""
    return _STATE.get()[REPLICA]


set_state = _STATE.set  # the ContextVar's own (C) method: called once per replica per run


def outside_any_scope() -> contextvars.Context:
    """A copy of the current context in which no strategy is current: for a task that
    serves on after its starter has left the scope or replica it started it in (a
    Batcher's), which would otherwise keep that state for good."""
    context = contextvars.copy_context()
    context.run(_STATE.set, _OUTSIDE)
    return context


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope (or run) we are in, else the default."""
    strategy = _STATE.get()[STRATEGY]
    return _default["strategy"] if strategy is None else strategy


def current_strategy() -> Strategy | None:
    """The current strategy, or None for none or the default one (see ``non_default``)."""
    return non_default(_STATE.get()[STRATEGY])


def has_strategy() -> bool:
    """Whether a strategy other than the default one is current."""
    return current_strategy() is not None


def non_default(strategy: Strategy | None) -> Strategy | None:
    """``strategy``, or None for the default strategy: as in TF, the default one
    current (in its own run or merge_fn) is no strategy."""
    return None if strategy is _default.get("strategy") else strategy


def in_cross_replica_context() -> bool:
    """True in a strategy's scope or a merge_fn; False in a replica function or outside."""
    state = _STATE.get()
    return state[STRATEGY] is not None and state[REPLICA] is None


def get_replica_context() -> ReplicaContext | None:
    """The current replica's context; the default one outside any scope; None in
    cross-replica context."""
    state = _STATE.get()
    replica = state[REPLICA]
    if replica is not None:
        return replica
    if state[STRATEGY] is None:
        return _default["replica_context"]
    return None


def get_cross_replica_context() -> Strategy | None:
    """The current strategy in cross-replica context (a scope, a merge_fn); None in a
    replica function and outside any scope, which is the default replica context (as
    in TF: exactly one of this and ``get_replica_context()`` is None)."""
    state = _STATE.get()
    if state[REPLICA] is not None:
        return None
    return state[STRATEGY]


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Make ``strategy`` current without a ``with`` block (None: back to the default).

    Meant for interactive use; not allowed inside a ``with strategy.scope()``.
    """
    if _STATE.get()[IN_SCOPE]:
        raise ContextError(
            "experimental_set_strategy() was called inside a strategy scope or replica "
            "function; leave the `with strategy.scope():` block first, or use the scope "
            "instead of experimental_set_strategy()."
        )
    from ._strategy import Strategy  # (here: strategies are a layer above contexts)

    if strategy is not None and not isinstance(strategy, Strategy):
        # Taken as it is, it became what get_strategy() returns, and failed later
        # where it was used as one (an AttributeError in Variable(), say).
        raise InvalidArgumentError(
            f"experimental_set_strategy(strategy={strategy!r}); expected an aiodist "
            "strategy (e.g. aiodist.MirroredStrategy([...])), or None for the default."
        )
    if strategy is not None and strategy is _default.get("strategy"):
        strategy = None
    _STATE.set(_OUTSIDE if strategy is None else (strategy, None, False, None))


def _mixing(current: Strategy, other: Strategy) -> ContextError:
    return ContextError(
        f"Mixing different aiodist strategies: {other!r} was used while {current!r} is "
        f"current.{twin_note(current, other)} Use one strategy per scope: leave the other "
        "strategy's `with ...scope():` block (or its run) first."
    )


def twin_note(one: Strategy, other: Strategy) -> str:
    """For a "Mixing different aiodist strategies" message: where the two strategies'
    reprs are alike (two objects on the same devices, a strategy made twice), a
    sentence saying they are two objects; else nothing. Without it the message named
    the same text twice, "X was used while X is current"."""
    if repr(one) != repr(other):
        return ""
    return (
        f" These are two {type(other).__name__} objects on the same devices (was the "
        "strategy made twice? Make it once and share that object)."
    )


def scope_of(strategy: Strategy) -> Scope:
    """``strategy.scope()``: make it current and enter cross-replica context.

    Re-entering the current strategy (in its scope or in one of its replica
    functions) changes nothing; entering a different one raises ``ContextError``.
    """
    return Scope(strategy)


class Scope:
    """What ``strategy.scope()`` returns. As TF's, one object may be entered again
    inside its own ``with`` block (and after it): each entry's token is kept, with
    the thread and task that entered it and the state it made current, until that
    task leaves the block (or, once it has finished, another task does, in the same
    context)."""

    __slots__ = ("_entries", "_strategy")

    def __init__(self, strategy: Strategy):
        self._strategy = strategy
        # (who entered, the token undoing the entry or None, the state it left current)
        self._entries: list[tuple[Any, contextvars.Token | None, _State]] = []

    def __repr__(self) -> str:
        return f"<scope of {self._strategy!r}, entered {len(self._entries)} time(s)>"

    def __enter__(self) -> Strategy:
        token = _enter_scope(self._strategy)
        self._entries.append((_entrant(), token, _STATE.get()))
        return self._strategy

    def __exit__(self, *exc_info: object) -> None:
        entries = self._entries
        entrant = _entrant()
        # The latest entry of this task (thread): tasks and threads sharing one scope
        # object leave it in any order.
        for i in range(len(entries) - 1, -1, -1):
            if entries[i][0] == entrant:
                token = entries.pop(i)[1]
                break
        else:
            self._leave_for_another_task()
            return
        if token is not None:
            _STATE.reset(token)

    def _leave_for_another_task(self) -> None:
        """Leave an entry another task made, in the context this one runs in.

        A with statement cannot leave what it did not enter, but a block's two halves
        may run in two tasks: pytest-asyncio runs an async generator fixture's code
        before and after its ``yield`` as two tasks in one context. The entry is the
        latest whose state is current here and whose task has finished (a task still
        running leaves its own entries: a task started inside the block, which
        inherits its state, may be inside a block of this same scope object); its
        token resets only in the context that made it (anywhere else the entry is
        another task's, and stays)."""
        entries, state = self._entries, _STATE.get()
        for i in range(len(entries) - 1, -1, -1):
            (_, task), token, made = entries[i]
            if made is state and task is not None and task.done():
                if token is not None:
                    try:
                        _STATE.reset(token)
                    except ValueError:  # made in another context: not this block's entry
                        break
                del entries[i]
                return
        raise ContextError(
            f"{self!r} was left by a task or thread that did not enter it; leave a "
            "`with strategy.scope():` block in the task or thread that entered it."
        )


def _entrant() -> tuple[int, Any]:
    """Who is entering or leaving a scope: the thread, and its running asyncio task
    (None outside one: synchronous code). Each has its own context, so a token is
    reset only where it was made."""
    try:
        task = asyncio.current_task()
    except RuntimeError:  # no running event loop
        task = None
    return threading.get_ident(), task


def _enter_scope(strategy: Strategy) -> contextvars.Token | None:
    """Enter ``strategy``'s scope: the token that undoes it, None when it changes
    nothing (re-entry, or the default strategy where no other is current)."""
    state = _STATE.get()
    current = state[STRATEGY]
    if current is not strategy:
        current = non_default(current)
    default = strategy is _default.get("strategy")
    if default and current is not None and current is not strategy:
        raise _mixing(current, strategy)  # TF: scopes must not nest
    if default or current is strategy:
        if current is strategy and not state[IN_SCOPE]:
            return _STATE.set((current, state[REPLICA], True, state[GROUP]))
        return None
    if current is not None:
        raise _mixing(current, strategy)
    return _STATE.set((strategy, None, True, None))


def require_cross_replica(strategy: Strategy | None, method: str) -> None:
    """Raise ``ContextError`` unless cross-replica (or default) context of ``strategy``
    (of any strategy when ``strategy`` is None)."""
    state = _STATE.get()
    if state[REPLICA] is not None:
        raise ContextError(
            f"{method}() needs cross-replica context, but it was called in replica "
            f"context (replica {state[REPLICA].replica_id_in_sync_group} of a run). "
            "Inside a replica function use `await aiodist.get_replica_context()"
            f".merge_call(merge_fn)` and call {method}() from merge_fn, or use the "
            "ReplicaContext collectives (all_reduce, all_gather)."
        )
    current = state[STRATEGY]
    if (
        strategy is not None
        and current is not None
        and current is not strategy
        and non_default(current) is not None  # (the default one's merge_fn: no strategy)
    ):
        raise _mixing(current, strategy)
