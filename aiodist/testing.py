"""Testing your own step functions with pytest (and pytest-asyncio).

Installing aiodist registers this module as a pytest plugin (``pytest11`` entry
point), so its fixtures are available in every test:

- ``aiodist_replicas``: how many CPU replicas a test gets; 2 by default.
  ``@pytest.mark.aiodist_replicas(1, 2, 4)`` runs the test once per count.
- ``aiodist_strategy``: a fresh ``MirroredStrategy`` with that many CPU replicas.
  Strategies hold no event loop, so it works on whatever loop pytest-asyncio
  runs the test on.
- ``aiodist_gpu_strategy``: the same on GPUs (replicas spread over the visible
  GPUs); the test is skipped, with the reason, where CuPy, a GPU, or aiodist's
  GPU backend is missing.

And one helper, ``assert_same_on_replicas``: run a step function on 1 and on N
replicas over the same global batch and check the answers agree.

Example (a test module of yours)::

    import numpy as np
    import pytest
    import aiodist
    from aiodist.testing import assert_same_on_replicas

    @pytest.mark.aiodist_replicas(1, 2, 4)
    async def test_loss_is_reduced(aiodist_strategy, aiodist_replicas):
        async def step(x):
            ctx = aiodist.get_replica_context()
            return await ctx.all_reduce("sum", x.sum())
        batch = aiodist_strategy.experimental_distribute_values_from_function(
            lambda ctx: np.ones(3))
        result = await aiodist_strategy.run(step, args=(batch,))
        first = aiodist_strategy.experimental_local_results(result)[0]
        assert float(first) == 3 * aiodist_replicas

    async def test_predictions_do_not_depend_on_replicas():
        async def predict(rows):
            return rows * 2.0
        await assert_same_on_replicas(predict, np.arange(10.0).reshape(5, 2))
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest

from . import _context, _nest
from ._arrays import leaf_path
from ._backends import backend_for, visible_gpu_count
from ._checks import short_repr, whole_number
from ._devices import Device
from ._errors import ContextError, DeviceError, InvalidArgumentError
from ._input import split_batch
from ._ops import ReduceOp
from ._strategy import MirroredStrategy
from ._values import PerReplica, regroup

__all__ = [
    "aiodist_gpu_strategy",
    "aiodist_replicas",
    "aiodist_strategy",
    "assert_same_on_replicas",
    "cpu_strategy",
]


def cpu_strategy(num_replicas: int) -> MirroredStrategy:
    """A ``MirroredStrategy`` on ``cpu:0`` … ``cpu:{num_replicas - 1}``."""
    # (0 said "devices=[] names no device", 2.0 "'float' object cannot be interpreted
    # as an integer", and True made one replica.)
    num_replicas = whole_number(num_replicas, "cpu_strategy: num_replicas", 1)
    return MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])


# -- the plugin ------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "aiodist_replicas(*counts): run the test once per replica count "
        "(for the aiodist_strategy / aiodist_gpu_strategy fixtures)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "aiodist_replicas" not in metafunc.fixturenames:
        # The marker on the test itself (not a module's or class's, which may mark
        # tests of every kind) would otherwise be ignored without a word.
        if any(m.name == "aiodist_replicas" for m in metafunc.definition.own_markers):
            raise pytest.UsageError(
                f"{metafunc.definition.nodeid}: @pytest.mark.aiodist_replicas marks a test "
                "that uses no aiodist fixture, so it would run once, untouched; take "
                "aiodist_strategy (or aiodist_replicas) as an argument, or drop the marker."
            )
        return
    marker = _closest_counts(metafunc.definition)
    if marker is None:
        return
    counts = _replica_counts(marker.args)
    if counts is None:
        raise pytest.UsageError(
            f"{metafunc.definition.nodeid}: @pytest.mark.aiodist_replicas{marker.args!r}; "
            "expected one or more replica counts >= 1, e.g. "
            "@pytest.mark.aiodist_replicas(1, 2, 4)."
        )
    metafunc.parametrize(
        "aiodist_replicas", counts, indirect=True, ids=[f"{n}replicas" for n in counts]
    )


def _closest_counts(definition: pytest.Function) -> pytest.Mark | None:
    """The aiodist_replicas marker that sets the test's replica counts, if one does.

    The closest setting wins: a ``@pytest.mark.parametrize("aiodist_replicas", ...)``
    on a test overrides its module's or class's marker (pytest applies it itself).
    Both on one node, or a marker inside a parametrize of a module or class (which
    pytest applies anyway), would parametrize the fixture twice: a usage error."""
    found: dict[str, Any] = {}  # "marker" / "parametrize" -> the node it is on
    marker = None
    for node, mark in definition.iter_markers_with_node():  # the test's own first
        if mark.name == "aiodist_replicas" and "marker" not in found:
            found["marker"], marker = node, mark
        elif mark.name == "parametrize" and "parametrize" not in found and _names_counts(mark):
            found["parametrize"] = node
    if marker is None or "parametrize" not in found:
        return marker
    marker_node, parametrize_node = found["marker"], found["parametrize"]
    if _depth(parametrize_node) > _depth(marker_node):  # (one chain: deeper is closer)
        return None  # the test's (or its class's) parametrize overrides the marker
    raise pytest.UsageError(
        f"{definition.nodeid}: @pytest.mark.aiodist_replicas (on {marker_node.nodeid}) "
        f"and @pytest.mark.parametrize('aiodist_replicas', ...) (on {parametrize_node.nodeid}) "
        "both set the replica counts; keep one. (A parametrize on a test overrides its "
        "module's or class's marker.)"
    )


def _names_counts(parametrize: pytest.Mark) -> bool:
    """Whether a parametrize marker's argument names include aiodist_replicas."""
    names = parametrize.args[0] if parametrize.args else parametrize.kwargs.get("argnames", ())
    if isinstance(names, str):
        names = names.split(",")
    return any(str(name).strip() == "aiodist_replicas" for name in names)


def _depth(node: pytest.Item | pytest.Collector) -> int:
    """How deep ``node`` is in the collection tree (a test deeper than its class)."""
    return len(node.listchain())


@pytest.fixture
def aiodist_replicas(request: pytest.FixtureRequest) -> int:
    """The number of replicas for this test (2 unless the marker or a parameter says)."""
    # An indirect parametrize's value, unchecked by the marker's checks: int() made
    # 2.5 two replicas, True one, and "3" three, so the test ran, and passed, on a
    # count it did not ask for. A whole number (a NumPy one too) of at least 1.
    return _checked_count(request, getattr(request, "param", 2))


def _checked_count(request: pytest.FixtureRequest, count: Any) -> int:
    """``count`` as a replica count, an int, or ``InvalidArgumentError`` naming the test.

    The strategy fixtures check it again: a plain ``parametrize("aiodist_replicas",
    ...)`` (not indirect) hands its values to them without calling the
    ``aiodist_replicas`` fixture, and ``cpu_strategy`` would refuse a bad count in
    its own words, naming neither the test nor the parameter."""
    number = _count(count)
    if number is None:
        raise InvalidArgumentError(
            f"{request.node.nodeid}: aiodist_replicas={count!r}; expected a replica count, "
            "a whole number >= 1, e.g. @pytest.mark.parametrize('aiodist_replicas', [1, 2, 4])."
        )
    return number


@pytest.fixture
def aiodist_strategy(request: pytest.FixtureRequest, aiodist_replicas: int) -> MirroredStrategy:
    """A fresh ``MirroredStrategy`` with ``aiodist_replicas`` CPU replicas."""
    return cpu_strategy(_checked_count(request, aiodist_replicas))


@pytest.fixture
def aiodist_gpu_strategy(request: pytest.FixtureRequest, aiodist_replicas: int) -> MirroredStrategy:
    """A ``MirroredStrategy`` with ``aiodist_replicas`` replicas on the visible GPUs
    (several per GPU if needed); skipped, with the reason, where that cannot run."""
    aiodist_replicas = _checked_count(request, aiodist_replicas)
    count = visible_gpu_count()
    if count == 0:
        # Why none: the DeviceError says (no CuPy, CUDA not usable, no GPU) and how to
        # fix it. The GPU backend raises it, as MirroredStrategy(["GPU:0"]) would.
        try:
            backend_for(Device("GPU", 0))
        except DeviceError as exc:
            pytest.skip(f"no GPU visible to CuPy: {exc}")
        pytest.skip("no GPU visible to CuPy")
    try:
        return MirroredStrategy([f"GPU:{i % count}" for i in range(aiodist_replicas)])
    except DeviceError as exc:
        pytest.skip(f"GPU replicas are not available here: {exc}")


# -- the helper ------------------------------------------------------------------------


async def assert_same_on_replicas(
    step_fn: Callable[..., Awaitable[Any] | Any],
    batch: Any,
    *,
    replicas: Sequence[int] = (1, 2, 4),
    combine: str | ReduceOp = "concat",
    rtol: float | None = None,
    atol: float | None = None,
) -> Any:
    """Run ``step_fn`` on each replica count over the same global ``batch`` and check
    that the combined answers agree with the first count's (usually 1 replica).

    ``batch`` is split along axis 0 as ``experimental_distribute_dataset`` splits
    it, and each replica calls ``step_fn(its_rows)``. The per-replica results are
    combined by ``combine``:

    - ``"concat"``: concatenated along axis 0 (per-row outputs, e.g. predictions;
      a scalar in the result raises ``InvalidArgumentError``);
    - ``"first"``: replica 0's result (values every replica already agrees on,
      e.g. all-reduced gradients);
    - a reduce op (``"sum"``, ``"mean"``, ``ReduceOp.MAX``, ...): reduced across
      replicas with ``strategy.reduce`` (e.g. per-replica loss sums).

    Results may be nested structures of arrays. ``rtol`` defaults to what the
    result's dtype can resolve after a change of summation order (1e-2 for
    float16, 1e-5 for float32, 1e-9 for float64, exact for integers), and ``atol``
    to ten times the dtype's resolution (1e-14 for float64) times the largest finite
    magnitude in ``batch``: a value that cancels to about zero (a centred sum, a
    gradient at the optimum) keeps rounding noise on the scale of the data, which
    no relative tolerance covers. With ``rtol`` given, ``atol`` defaults to 0
    (``rtol=0``: exact). Values that are not numbers (string labels, dates,
    objects) compare exactly. Returns the
    reference answer; raises ``AssertionError`` naming the replica count that
    differs and the value (``value 1 (['score'])``: its path in a nested result).
    An exception the step raises propagates unchanged, with a note naming the
    replica count and the rows each replica got.
    """
    counts = (
        None
        if isinstance(replicas, str | bytes) or not isinstance(replicas, Sequence)
        else _replica_counts(replicas)
    )
    if counts is None:
        raise InvalidArgumentError(
            f"assert_same_on_replicas: replicas={replicas!r}; expected a sequence of one or "
            "more replica counts >= 1, e.g. replicas=(1, 2, 4)."
        )
    if not (
        (isinstance(combine, str) and combine in ("concat", "first")) or _is_reduce_op(combine)
    ):
        raise InvalidArgumentError(
            f"assert_same_on_replicas: combine={combine!r}; expected 'concat', 'first', or "
            "a reduce op (a ReduceOp, or 'sum', 'mean', 'min', 'max', 'product' in any case)."
        )
    for name, tolerance in (("rtol", rtol), ("atol", atol)):
        # (A string failed in NumPy's message formatting, "Unknown format code 'g'";
        # NaN, a negative or an infinite tolerance was taken, with a RuntimeWarning
        # at most, and infinity passed any answer; True was a tolerance of 1.)
        if tolerance is not None and (
            isinstance(tolerance, bool)
            or not isinstance(tolerance, numbers.Real)
            or not 0 <= tolerance < math.inf
        ):
            raise InvalidArgumentError(
                f"assert_same_on_replicas: {name}={tolerance!r}; expected a finite number "
                ">= 0 (0: exact), or None for the default."
            )
    _refuse_current_strategy()
    reference, reference_count = None, None
    scale = _magnitude(batch) if atol is None and rtol is None else 0.0
    for count in counts:
        strategy = cpu_strategy(count)
        shards = split_batch(batch, count, "assert_same_on_replicas: batch")
        try:
            result = await strategy.run(step_fn, args=(regroup(shards, strategy._devices),))
        except Exception as exc:
            # The step's own error, unchanged, but for which run raised it: a step
            # that fails on 4 replicas only (a shard of zero rows, where the batch
            # has fewer rows than replicas) said nothing of replicas at all.
            _note_run(exc, count, shards)
            raise
        answer = await _combine(strategy, result, combine)
        if reference is None:
            reference, reference_count = answer, count
            continue
        leaves, expected = _nest.flatten(answer), _nest.flatten(reference)
        if len(leaves) != len(expected) or _nest.skeleton(answer) != _nest.skeleton(reference):
            raise AssertionError(
                f"{count} replicas gave {_describe(answer)}, {reference_count} gave "
                f"{_describe(reference)}: the step's result structure depends on the "
                "replica count."
            )
        for index, (got, want) in enumerate(zip(leaves, expected, strict=True)):
            got, want = np.asarray(got), np.asarray(want)
            name = _value(reference, index)
            if got.shape != want.shape:  # (assert_allclose would broadcast them)
                raise AssertionError(
                    f"{name} of the step's result has shape {got.shape} on "
                    f"{count} replicas but {want.shape} on {reference_count}: its shape "
                    "depends on the replica count."
                )
            differs = (
                f"{name} of the step's result on {count} replicas differs from "
                f"{reference_count} replica(s)"
            )
            if not (_is_numeric(got.dtype) and _is_numeric(want.dtype)):
                # Labels, dates, objects: no tolerance applies, and assert_allclose
                # failed on them, equal or not ("The DType <class StrDType> could not
                # be promoted by <class _PyFloatDType>").
                np.testing.assert_array_equal(got, want, err_msg=differs)
                continue
            np.testing.assert_allclose(
                got,
                want,
                rtol=_default_rtol(want.dtype) if rtol is None else rtol,
                atol=_default_atol(want.dtype, scale) if atol is None else atol,
                err_msg=differs,
            )
    return reference


def _refuse_current_strategy() -> None:
    """Raise ``ContextError`` inside a strategy's scope, merge_fn or replica function,
    where the helper's own strategies cannot run: their runs raised "Mixing different
    aiodist strategies" of a one-replica strategy the user never made, or "runs
    cannot nest", with a note that the step had raised it, which never ran."""
    state = _context.current_state()
    replica, strategy = state[_context.REPLICA], _context.current_strategy()
    if replica is None and strategy is None:
        return
    if replica is not None:
        where = f"replica {replica.replica_id_in_sync_group}'s function of {replica.strategy!r}"
    else:
        where = f"the scope of {strategy!r} (or a merge_fn of its run)"
    raise ContextError(
        f"assert_same_on_replicas() was called inside {where}; it makes a strategy of its "
        "own for each replica count and runs the step on that, which cannot be done where "
        "another strategy is current. Expected no current strategy: call it outside any "
        "`with strategy.scope():` block, run or merge_fn (in a test, not under a fixture "
        "that holds a scope open)."
    )


def _is_numeric(dtype: np.dtype) -> bool:
    """Whether values of ``dtype`` compare within a tolerance (bools, ints, floats,
    complex numbers); others (strings, dates, objects) compare exactly."""
    return dtype.kind in "biufc"


def _note_run(exc: BaseException, count: int, shards: list) -> None:
    """Note on ``exc`` that it came from the run on ``count`` replicas, with the rows
    each got (once: a step may raise one exception object again and again)."""
    rows = ", ".join(str(len(_nest.flatten(shard)[0])) for shard in shards)
    note = (
        f"(raised by assert_same_on_replicas running the step on {count} replica(s); "
        f"rows of the batch per replica: {rows})"
    )
    if note not in getattr(exc, "__notes__", ()):
        exc.add_note(note)


def _count(value: Any) -> int | None:
    """``value`` as a replica count, an int: a whole number of at least 1 (a NumPy
    one too, as from ``np.arange``; not a bool), else None."""
    if isinstance(value, bool | np.bool_):
        return None
    try:
        number = operator.index(value)
    except TypeError:
        return None
    return number if number >= 1 else None


def _replica_counts(counts: Sequence) -> tuple[int, ...] | None:
    """``counts`` (the marker's, or assert_same_on_replicas' replicas) as ints, if it
    is one or more replica counts (see ``_count``); else None. (NumPy's ints were
    refused as "expected ... replica counts >= 1", which they are.)"""
    numbers = tuple(_count(n) for n in counts)
    return numbers if numbers and None not in numbers else None


def _is_reduce_op(combine: Any) -> bool:
    try:
        ReduceOp.of(combine)
    except (ValueError, TypeError):
        return False
    return True


def _describe(value: Any) -> str:
    """A result's structure, for a message: its nesting, keys and leaf count."""
    return f"{_nest.skeleton(value)!r} ({len(_nest.flatten(value))} values)"


def _value(result: Any, index: int) -> str:
    """Leaf ``index`` of a step's ``result``, for a message: ``value 0``, and its path
    in a nested result (``value 1 (['score'])``), as the flattening order (sorted
    dict keys) is not what the step wrote."""
    path = leaf_path(result, index)[0]
    return f"value {index} ({path})" if path else f"value {index}"


def _magnitude(batch: Any) -> float:
    """The largest absolute value among the finite numbers of ``batch`` (0 if none).

    NaN and infinity (missing data, a masked entry) say nothing of the data's
    scale: one of them made the whole batch's 0, and so the default atol 0. Integers
    are taken as floats first (np.abs(int8(-128)) is -128)."""
    largest = 0.0
    for leaf in _nest.flatten(batch):
        array = np.asarray(leaf)
        if array.dtype.kind not in "biufc":
            continue
        if array.dtype.kind in "biu":
            array = array.astype(np.float64)
        finite = np.abs(array[np.isfinite(array)])
        if finite.size:
            largest = max(largest, float(finite.max()))
    return largest


def _noise(dtype: np.dtype) -> float:
    """Ten times the dtype's resolution (0 for integers): 1e-2 for float16, 1e-5 for
    float32 and complex64, 1e-14 for float64."""
    if dtype.kind not in "fc":
        return 0.0
    return 10 * float(np.finfo(dtype).resolution)


def _default_atol(dtype: np.dtype, scale: float) -> float:
    """``_noise`` times ``scale``, the data's largest magnitude: rounding noise left
    by cancellation."""
    return _noise(dtype) * scale


def _default_rtol(dtype: np.dtype) -> float:
    """``_noise``, at least 1e-9 for floats (so 1e-9 for float64 and wider)."""
    noise = _noise(dtype)
    return max(noise, 1e-9) if noise else 0.0


async def _combine(strategy: MirroredStrategy, result: Any, combine: str | ReduceOp) -> Any:
    per_replica = strategy.experimental_local_results(result)
    if combine == "first":
        return per_replica[0]
    if combine == "concat":
        leaves = [_nest.flatten(part) for part in per_replica]
        # A scalar has no rows to join (NumPy only said "zero-dimensional arrays
        # cannot be concatenated"): a per-replica loss or count wants another combine.
        for replica, part in enumerate(leaves):
            for index, leaf in enumerate(part):
                if np.ndim(leaf) == 0:
                    raise InvalidArgumentError(
                        f"assert_same_on_replicas: {_value(per_replica[replica], index)} of "
                        f"the step's result is a scalar ({short_repr(leaf)} on replica "
                        f"{replica} of {len(per_replica)}), which combine='concat' cannot "
                        "join along axis 0; expected per-row outputs (arrays with one row per "
                        "input row). For per-replica values use combine='sum' (or another reduce "
                        "op), or combine='first' for values the replicas agree on."
                    )
        joined = [
            np.concatenate([np.asarray(part[i]) for part in leaves]) for i in range(len(leaves[0]))
        ]
        return _nest.pack_as(per_replica[0], joined)
    op = ReduceOp.of(combine)
    leaves = [_nest.flatten(part) for part in per_replica]
    reduced = []
    for i in range(len(leaves[0])):
        column = tuple(np.asarray(part[i]) for part in leaves)
        value = PerReplica._make(column, strategy._devices) if len(column) > 1 else column[0]
        try:
            reduced.append(await strategy.reduce(op, value, axis=None))
        except Exception as exc:
            # (strategy.reduce's own message said "reduce: cannot reduce ...", a call
            # the user never made, naming neither the combine nor the value.)
            exc.add_note(
                f"(raised by assert_same_on_replicas reducing {_value(per_replica[0], i)} of "
                f"the step's result across {len(column)} replica(s) with combine={combine!r}; "
                "for values that cannot be reduced, such as labels, use combine='concat' "
                "(per-row values) or combine='first')"
            )
            raise
    return _nest.pack_as(per_replica[0], reduced)
