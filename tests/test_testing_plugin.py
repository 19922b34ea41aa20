"""The pytest plugin for users (aiodist.testing), exercised through pytester."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
from pathlib import Path

import numpy as np
import pytest

import aiodist
from aiodist._backends import visible_gpu_count
from aiodist.testing import assert_same_on_replicas, cpu_strategy

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _aiodist_importable(monkeypatch):
    """The pytester subprocess runs elsewhere: make this checkout importable there
    (CI installs aiodist anyway; a source checkout may not be installed)."""
    paths = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))


INI = """
[pytest]
asyncio_mode = auto
asyncio_default_fixture_loop_scope = function
"""


# Installed (as in CI), the plugin is loaded through its pytest11 entry point, which
# these tests then exercise; from an uninstalled checkout it is named explicitly.
INSTALLED = any(
    entry.value == "aiodist.testing" for entry in importlib.metadata.entry_points(group="pytest11")
)


def run(pytester: pytest.Pytester, source: str, *args: str) -> pytest.RunResult:
    pytester.makeini(INI)
    pytester.makepyfile(source)
    plugin = () if INSTALLED else ("-p", "aiodist.testing")
    return pytester.runpytest_subprocess(*plugin, "-v", *args)


def test_fixtures_and_marker_parametrize_replica_counts(pytester):
    result = run(
        pytester,
        """
        import asyncio
        import numpy as np
        import pytest
        import aiodist

        @pytest.mark.aiodist_replicas(1, 2, 4)
        async def test_counts(aiodist_strategy, aiodist_replicas):
            assert aiodist_strategy.num_replicas_in_sync == aiodist_replicas
            async def step():
                return await aiodist.get_replica_context().all_reduce("sum", 1.0)
            result = await aiodist_strategy.run(step)
            first = aiodist_strategy.experimental_local_results(result)[0]
            assert float(first) == aiodist_replicas

        async def test_default_is_two(aiodist_strategy):
            assert aiodist_strategy.extended.worker_devices == ("/device:CPU:0", "/device:CPU:1")

        @pytest.mark.parametrize("aiodist_replicas", [3])
        def test_fixture_parameter(aiodist_strategy):
            assert aiodist_strategy.num_replicas_in_sync == 3
        """,
    )
    result.assert_outcomes(passed=5)
    result.stdout.fnmatch_lines(
        ["*test_counts[[]1replicas[]] PASSED*", "*test_counts[[]4replicas[]] PASSED*"]
    )


def _run_gpu_fixture_test(pytester):
    """A test using aiodist_gpu_strategy, run where it must skip: its result."""
    result = run(
        pytester,
        """
        def test_on_gpu(aiodist_gpu_strategy):
            raise AssertionError("must not run without a GPU")
        """,
        "-rs",
    )
    result.assert_outcomes(skipped=1)
    return result


def test_a_fixture_may_hold_a_scope_open_for_its_test(pytester):
    """An async generator fixture's two halves run as two tasks of one context: the
    second could not leave the scope the first entered, and the scope stayed current
    for every later test ("Mixing different aiodist strategies")."""
    result = run(
        pytester,
        """
        import pytest
        import aiodist

        @pytest.fixture
        async def scoped(aiodist_strategy):
            with aiodist_strategy.scope():
                yield aiodist_strategy

        async def test_in_scope(scoped):
            assert aiodist.get_strategy() is scoped

        def test_after(aiodist_strategy):
            assert not aiodist.has_strategy()
            with aiodist_strategy.scope():
                pass
        """,
    )
    result.assert_outcomes(passed=2)


@pytest.mark.skipif(not INSTALLED, reason="aiodist is not installed: no pytest11 entry point")
def test_the_plugin_is_loaded_and_turned_off_by_the_name_docs_testing_gives(pytester):
    """docs/testing.md: with autoloading off, `-p aiodist` loads it (and `-p no:aiodist`
    turns it off); naming the module as well, which pytest refuses with "Plugin
    already registered under a different name", is what the page warns against."""
    pytester.makeini(INI)
    pytester.makepyfile(
        """
        async def test_fixture(aiodist_strategy):
            assert aiodist_strategy.num_replicas_in_sync == 2
        """
    )
    loaded = pytester.runpytest_subprocess(
        "--disable-plugin-autoload", "-p", "aiodist", "-p", "asyncio"
    )
    loaded.assert_outcomes(passed=1)
    off = pytester.runpytest_subprocess("-p", "no:aiodist")
    off.assert_outcomes(errors=1)
    off.stdout.fnmatch_lines(["*fixture 'aiodist_strategy' not found*"])
    twice = pytester.runpytest_subprocess("-p", "aiodist.testing")
    assert twice.ret != 0
    twice.stderr.fnmatch_lines(["*Plugin already registered under a different name*"])


def test_gpu_fixture_skips_with_a_reason_without_a_gpu(pytester):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("this machine has CuPy: the fixture may not skip here")
    result = _run_gpu_fixture_test(pytester)
    result.stdout.fnmatch_lines(["*no GPU visible to CuPy*aiodist[[]cuda12[]]*"])


def test_gpu_fixture_skips_with_cupys_own_reason(pytester):
    # CuPy installed where it sees no GPU (no driver, a driver too old: tox -e nodriver):
    # the reason is CUDA's, not "install CuPy".
    if importlib.util.find_spec("cupy") is None or visible_gpu_count() > 0:
        pytest.skip("needs CuPy installed on a machine where it sees no GPU (tox -e nodriver)")
    result = _run_gpu_fixture_test(pytester)
    result.stdout.fnmatch_lines(["*no GPU visible to CuPy: device '/device:GPU:0' is a GPU, but*"])
    result.stdout.no_fnmatch_line("*CuPy is not installed*")
    result.stdout.no_fnmatch_line("*(install CuPy with*")


def test_a_marker_on_a_test_without_the_fixtures_is_a_usage_error(pytester):
    result = run(
        pytester,
        """
        import pytest

        pytestmark = pytest.mark.aiodist_replicas(1, 2)  # a module's: tests of any kind

        def test_other():
            pass

        @pytest.mark.aiodist_replicas(1, 4)
        def test_x():
            pass
        """,
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*test_x: @pytest.mark.aiodist_replicas marks a test*"])
    result.stdout.no_fnmatch_line("*test_other: @pytest.mark*")


def test_a_tests_parametrize_overrides_its_modules_marker(pytester):
    # The module's marker was applied as well, and pytest stopped collecting the
    # whole module: "duplicate parametrization of 'aiodist_replicas'".
    result = run(
        pytester,
        """
        import pytest

        pytestmark = pytest.mark.aiodist_replicas(1, 2)

        async def test_step(aiodist_strategy, aiodist_replicas):
            assert aiodist_strategy.num_replicas_in_sync == aiodist_replicas

        @pytest.mark.parametrize("aiodist_replicas", [4])
        async def test_big(aiodist_strategy):
            assert aiodist_strategy.num_replicas_in_sync == 4
        """,
    )
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["*test_big[[]4[]] PASSED*"])


def test_a_marker_and_a_parametrize_on_one_test_are_a_usage_error(pytester):
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.aiodist_replicas(1, 2)
        @pytest.mark.parametrize("aiodist_replicas", [4])
        def test_x(aiodist_strategy):
            pass
        """,
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*test_x: @pytest.mark.aiodist_replicas*both set the replica*"])


def test_bad_marker_is_a_usage_error(pytester):
    result = run(
        pytester,
        """
        import pytest

        @pytest.mark.aiodist_replicas(0)
        def test_x(aiodist_strategy):
            pass
        """,
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*aiodist_replicas(0,); expected one or more replica counts*"])


def test_numpy_counts_are_replica_counts_in_the_marker_and_the_helper(pytester):
    # Refused, as "@pytest.mark.aiodist_replicas(np.int64(1), np.int64(2)); expected
    # one or more replica counts >= 1": the parameter took them, as the docs say.
    result = run(
        pytester,
        """
        import numpy as np
        import pytest
        from aiodist.testing import assert_same_on_replicas

        @pytest.mark.aiodist_replicas(*np.arange(1, 3))
        async def test_counts(aiodist_strategy, aiodist_replicas):
            assert type(aiodist_replicas) is int
            assert aiodist_strategy.num_replicas_in_sync == aiodist_replicas

        @pytest.mark.aiodist_replicas(np.True_)
        def test_bool(aiodist_strategy):
            pass
        """,
    )
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*test_bool: @pytest.mark.aiodist_replicas(np.True_,); expected*"])
    result.stdout.no_fnmatch_line("*test_counts: @pytest.mark*")


async def test_the_helper_takes_numpy_counts():
    async def predict(rows):
        return rows * 2.0

    answer = await assert_same_on_replicas(predict, np.ones((4, 2)), replicas=(np.int64(1), 3))
    np.testing.assert_array_equal(answer, np.full((4, 2), 2.0))


def test_an_indirect_parametrize_with_a_bad_count_is_refused_not_rounded(pytester):
    # int() made 2.5 two replicas, True one and "3" three: the tests ran, and passed,
    # on counts they did not ask for.
    result = run(
        pytester,
        """
        import numpy as np
        import pytest

        @pytest.mark.parametrize(
            "aiodist_replicas", [2.5, True, "3", 0, np.int64(3)], indirect=True
        )
        def test_count(aiodist_strategy, aiodist_replicas):
            assert aiodist_strategy.num_replicas_in_sync == aiodist_replicas == 3
        """,
    )
    result.assert_outcomes(passed=1, errors=4)
    for shown in ("2.5", "True", "'3'", "0"):
        result.stdout.fnmatch_lines(
            [f"*aiodist_replicas={shown}; expected a replica count, a whole number >= 1*"]
        )


def test_a_plain_parametrize_takes_numpy_counts_and_names_a_bad_one(pytester):
    # docs/testing.md: `parametrize("aiodist_replicas", [...])` does what the marker
    # does, and a count may be a NumPy integer. Not indirect, its values skip the
    # aiodist_replicas fixture's check and went to cpu_strategy, which refused
    # np.int64(2) (np.arange's) as "cpu_strategy: num_replicas=np.int64(2); expected
    # an int >= 1", naming neither the test nor the parameter.
    result = run(
        pytester,
        """
        import numpy as np
        import pytest

        @pytest.mark.parametrize("aiodist_replicas", np.arange(1, 3))
        def test_count(aiodist_strategy, aiodist_replicas):
            assert aiodist_strategy.num_replicas_in_sync == aiodist_replicas

        @pytest.mark.parametrize("aiodist_replicas", [2.5, 0])
        def test_bad(aiodist_strategy):
            pass

        @pytest.mark.parametrize("aiodist_replicas", [np.int64(0)])
        def test_bad_on_gpu(aiodist_gpu_strategy):
            pass
        """,
    )
    result.assert_outcomes(passed=2, errors=3)
    for shown in ("2.5", "0", "np.int64(0)"):
        result.stdout.fnmatch_lines(
            [f"*test_bad*: aiodist_replicas={shown}; expected a replica count, a whole number*"]
        )
    result.stdout.no_fnmatch_line("*cpu_strategy: num_replicas*")


def test_assert_same_on_replicas_catches_a_replica_dependent_step(pytester):
    result = run(
        pytester,
        """
        import numpy as np
        import aiodist
        from aiodist.testing import assert_same_on_replicas

        async def test_good():
            async def predict(rows):
                return rows * 2.0
            await assert_same_on_replicas(predict, np.arange(10.0).reshape(5, 2))

        async def test_bad():
            async def leaky(rows):  # depends on which replica it runs on
                rid = aiodist.get_replica_context().replica_id_in_sync_group
                return rows + rid
            await assert_same_on_replicas(leaky, np.arange(10.0).reshape(5, 2))
        """,
    )
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*on 2 replicas differs from 1 replica(s)*"])


async def test_assert_same_on_replicas_combine_modes():
    async def grads(rows):
        ctx = aiodist.get_replica_context()
        return await ctx.all_reduce("sum", rows.sum(axis=0))

    batch = np.arange(12.0).reshape(6, 2)
    np.testing.assert_array_equal(
        await assert_same_on_replicas(grads, batch, combine="first"), batch.sum(axis=0)
    )

    async def loss(rows):
        return {"sum": rows.sum(), "count": np.float64(len(rows))}

    total = await assert_same_on_replicas(loss, batch, combine="sum", replicas=(1, 3))
    assert float(total["sum"]) == batch.sum() and float(total["count"]) == 6

    async def wrong_shape(rows):
        return rows[:1]

    with pytest.raises(AssertionError):
        await assert_same_on_replicas(wrong_shape, batch)


_COMBINE_EXPECTED = r"combine=.*; expected 'concat', 'first', or a reduce op"
_REPLICAS_EXPECTED = r"replicas=.*; expected a sequence of one or more replica counts >= 1"
_TOLERANCE_EXPECTED = r"tol=.*; expected a finite number >= 0 \(0: exact\), or None"
_TOLERANCES = (-1e-6, math.nan, math.inf, True, "1e-6", [1e-6])


@pytest.mark.parametrize(
    ("keyword", "value", "expected"),
    [
        ("combine", v, _COMBINE_EXPECTED)
        for v in ("concatenate", "First", "avg", None, np.array(["concat", "first"]))
    ]
    + [
        ("replicas", v, _REPLICAS_EXPECTED)
        for v in ((), (0, 2), (1, 2.0), (True,), (np.True_,), (np.int64(0),), 4, "12")
    ]
    + [(k, v, _TOLERANCE_EXPECTED) for k in ("rtol", "atol") for v in _TOLERANCES],
)
async def test_assert_same_on_replicas_names_what_combine_and_replicas_take(
    keyword, value, expected
):
    """(And rtol and atol: a string failed in NumPy's formatting of its message, and
    NaN, a negative or an infinite tolerance were taken; infinity passed anything.)"""

    async def predict(rows):
        return rows * 2.0

    with pytest.raises(aiodist.InvalidArgumentError, match=expected):
        await assert_same_on_replicas(predict, np.ones((4, 2)), **{keyword: value})


async def test_concat_of_a_scalar_result_names_the_value_and_the_combines_that_fit():
    """The default combine joins per-row outputs; a step returning a per-replica
    scalar (a loss, a count) failed with NumPy's words only ("zero-dimensional
    arrays cannot be concatenated"), naming neither the value nor the remedy."""

    async def losses(rows):
        return {"predictions": rows * 2.0, "loss": rows.sum()}

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"value 0 \(\['loss'\]\) of the step's result is a scalar \(np.float64\(66.0\) "
        r"on replica 0 "
        r"of 1\), which combine='concat' cannot join.*combine='sum'.*combine='first'",
    ):
        await assert_same_on_replicas(losses, np.arange(12.0).reshape(6, 2))


async def test_a_bad_batch_is_named_as_assert_same_on_replicas_batch():
    """Its errors said "experimental_distribute_dataset:", an API the test never
    called; rows as Python lists (each number a leaf) named the first number only."""

    async def predict(rows):
        return rows * 2.0

    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"^assert_same_on_replicas: batch: a rank-0 value at \[0\]\[0\] \(1.0\) has no "
        r"batch axis "
        r"\(a list or tuple is a structure here.*np.asarray\)",
    ):
        await assert_same_on_replicas(predict, [[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(
        aiodist.InvalidArgumentError,
        match=r"^assert_same_on_replicas: batch: the leaves of one element have different",
    ):
        await assert_same_on_replicas(predict, {"x": np.ones((4, 2)), "y": np.ones(3)})


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, None, "2"])
def test_cpu_strategy_names_a_bad_replica_count(bad):
    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"cpu_strategy: num_replicas=.*; expected an int >= 1"
    ):
        cpu_strategy(bad)
    assert cpu_strategy(3).num_replicas_in_sync == 3


async def test_assert_same_on_replicas_compares_shapes_and_structures():
    batch = np.arange(8.0).reshape(4, 2)

    async def per_replica_totals(rows):  # () on one replica, (n,) on n
        ctx = aiodist.get_replica_context()
        total = await ctx.all_reduce("sum", rows.sum())
        n = ctx.num_replicas_in_sync
        return total if n == 1 else np.full(n, total)

    with pytest.raises(AssertionError, match=r"shape \(2,\) on 2 replicas but \(\) on 1"):
        await assert_same_on_replicas(per_replica_totals, batch, combine="first")

    async def renamed(rows):  # the same value under another key
        ctx = aiodist.get_replica_context()
        total = await ctx.all_reduce("sum", rows.sum())
        return {"loss": total} if ctx.num_replicas_in_sync == 1 else {"grad": total}

    with pytest.raises(AssertionError, match=r"'grad'.*'loss'.*structure depends on the replica"):
        await assert_same_on_replicas(renamed, batch, combine="first")


async def test_default_tolerance_follows_the_dtype():
    rng = np.random.default_rng(3)
    batch = rng.uniform(0, 1000, size=(64, 8)).astype(np.float32)

    async def loss_sum(rows):  # float32 sums in a different order per replica count
        return rows.sum(dtype=np.float32)

    for _ in range(5):
        await assert_same_on_replicas(loss_sum, batch, combine="sum")

    async def half_sum(rows):  # float16 resolves about 1e-3
        return rows.astype(np.float16).sum(axis=0)

    await assert_same_on_replicas(half_sum, batch / 1000, combine="sum")


async def test_values_that_cancel_to_zero_compare_absolutely_by_default():
    # A centred batch sums to rounding noise (about 1e-16 on either side of 0): no
    # relative tolerance covers it, so atol defaults to noise on the data's scale.
    batch = np.random.default_rng(1).standard_normal((8, 3))
    batch -= batch.mean(axis=0)

    async def loss_sum(rows):
        return rows.sum()

    total = await assert_same_on_replicas(loss_sum, batch, combine="sum")
    assert abs(float(total)) < 1e-12
    with pytest.raises(AssertionError, match=r"on \d replicas differs"):  # relative only
        await assert_same_on_replicas(loss_sum, batch, combine="sum", atol=0)

    async def off_by_a_little(rows):  # above float64's figure (1e-9): still caught
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return rows.sum() + 1e-6 * rid

    with pytest.raises(AssertionError, match=r"on 2 replicas differs"):
        await assert_same_on_replicas(off_by_a_little, batch, combine="sum")

    async def tiny_but_wrong(rows):  # far above float64 noise on data of this scale
        return 1e-10 * aiodist.get_replica_context().num_replicas_in_sync

    with pytest.raises(AssertionError, match=r"on 2 replicas differs"):
        await assert_same_on_replicas(tiny_but_wrong, batch, combine="first")
    with pytest.raises(AssertionError, match=r"on \d replicas differs"):  # rtol=0: exact
        await assert_same_on_replicas(loss_sum, batch, combine="sum", rtol=0)


async def test_values_that_are_not_numbers_compare_exactly():
    """A step predicting string labels (or dates) failed inside assert_allclose,
    equal or not: "The DType <class StrDType> could not be promoted by ..."."""
    labels = np.array(["cat", "dog"])
    batch = np.arange(12.0).reshape(6, 2)

    async def predict(rows):
        days = np.datetime64("2024-01-01") + rows[:, 0].astype("timedelta64[D]")
        return {"label": labels[(rows[:, 0] % 4 > 1).astype(int)], "day": days}

    answer = await assert_same_on_replicas(predict, batch)
    assert list(answer["label"]) == ["cat", "dog"] * 3

    async def leaky(rows):  # the label depends on the replica
        return labels[np.full(len(rows), aiodist.get_replica_context().replica_id_in_sync_group)]

    with pytest.raises(AssertionError, match=r"(?s)on 2 replicas differs.*dog \(ACTUAL\)"):
        await assert_same_on_replicas(leaky, batch)


async def test_a_value_of_a_nested_result_is_named_by_its_path():
    """Messages named a leaf by its place in the flattening order only ("value 3"),
    which sorts dict keys: not the order the step wrote them in."""
    batch = np.arange(12.0).reshape(6, 2)

    async def predict(rows):
        rid = aiodist.get_replica_context().replica_id_in_sync_group
        return {"score": rows[:, 1] + rid, "label": rows[:, 0] * 0, "aux": [rows, rows]}

    with pytest.raises(
        AssertionError, match=r"value 3 \(\['score'\]\) of the step's result on 2 replicas differs"
    ):
        await assert_same_on_replicas(predict, batch)

    async def shapes(rows):
        n = aiodist.get_replica_context().num_replicas_in_sync
        return {"loss": np.float64(n > 0), "rows": [rows[:1], rows[: 1 if n > 1 else 2]]}

    with pytest.raises(
        AssertionError, match=r"value 2 \(\['rows'\]\[1\]\) of the step's result has shape"
    ):
        await assert_same_on_replicas(shapes, batch, combine="first")


async def test_an_error_in_the_step_says_which_run_raised_it():
    """A step failing on an empty shard (3 rows on 4 replicas) raised NumPy's
    IndexError alone: nothing said the helper had run it on 4 replicas, one with
    no rows."""
    failure = IndexError("the step's own")

    async def first_row(rows):
        if len(rows) == 0:
            raise failure
        return rows[0] * 2

    with pytest.raises(IndexError) as caught:
        await assert_same_on_replicas(first_row, np.arange(6.0).reshape(3, 2), combine="first")
    assert caught.value is failure
    assert failure.__notes__ == [
        "(raised in replica 3 of 4, on /device:CPU:3, by strategy.run)",
        "(raised by assert_same_on_replicas running the step on 4 replica(s); rows of the "
        "batch per replica: 1, 1, 1, 0)",
    ]
    with pytest.raises(IndexError):  # the same object again: one note, not two
        await assert_same_on_replicas(first_row, np.arange(6.0).reshape(3, 2), replicas=(4,))
    assert len(failure.__notes__) == 2


async def test_a_nan_in_the_batch_keeps_the_default_atol_on_the_datas_scale():
    """One NaN (missing data, in a column the step skips) made the batch's largest
    magnitude NaN, read as 0: atol 0, and rounding noise around zero failed a step
    that is right."""
    batch = np.random.default_rng(1).standard_normal((8, 3)) * 1000
    batch -= batch.mean(axis=0)
    batch[0, 0] = np.nan

    async def centred_sums(rows):  # about 1e-13 either side of 0, by shard
        return np.nansum(rows[:, 1:], axis=0)

    for replicas in ((1, 2), (1, 4)):
        await assert_same_on_replicas(centred_sums, batch, combine="sum", replicas=replicas)
    with pytest.raises(AssertionError, match=r"on \d replicas differs"):  # atol=0: it is noise
        for replicas in ((1, 2), (1, 4)):
            await assert_same_on_replicas(
                centred_sums, batch, combine="sum", replicas=replicas, atol=0
            )


async def test_the_helper_inside_a_scope_or_a_replica_says_to_call_it_outside():
    """Inside a scope (a fixture holding one open for its test), its own strategy's
    run raised "Mixing different aiodist strategies: MirroredStrategy(devices=
    ['/device:CPU:0']) was used while ..." (a strategy the user never made), and in
    a replica function "strategy.run() was called inside a replica function", each
    with the note that the step had raised it on 1 replica, which never ran."""
    two = cpu_strategy(2)
    ran = []

    async def predict(rows):
        ran.append(len(rows))
        return rows * 2.0

    batch = np.arange(8.0).reshape(4, 2)
    inside = r"^assert_same_on_replicas\(\) was called inside {}.*call it outside"
    in_scope = inside.format(r"the scope of MirroredStrategy")
    with two.scope(), pytest.raises(aiodist.ContextError, match=in_scope):
        await assert_same_on_replicas(predict, batch)

    async def in_replica():
        await assert_same_on_replicas(predict, batch)

    for strategy in (two, aiodist.get_strategy()):  # (the default one's replica too)
        with pytest.raises(aiodist.ContextError, match=inside.format(r"replica 0's function")):
            await strategy.run(in_replica)
    assert ran == []
    await assert_same_on_replicas(predict, batch)  # outside: runs on 1, 2 and 4
    assert ran == [4, 2, 2, 1, 1, 1, 1]


async def test_a_result_the_combine_cannot_reduce_is_named_with_the_combine():
    """combine='sum' over string labels raised strategy.reduce's "reduce: cannot
    reduce values of dtype <U5 with SUM", a reduce the user never called, naming
    neither the helper, the combine nor which value of the result."""
    batch = np.arange(8.0).reshape(4, 2)

    async def scored(rows):
        return {"label": np.array(["cat"] * len(rows)), "loss": rows.sum()}

    with pytest.raises(
        aiodist.InvalidArgumentError, match=r"cannot reduce values of dtype <U3"
    ) as info:
        await assert_same_on_replicas(scored, batch, combine="sum")
    assert info.value.__notes__ == [
        "(raised by assert_same_on_replicas reducing value 0 (['label']) of the step's "
        "result across 1 replica(s) with combine='sum'; for values that cannot be reduced, "
        "such as labels, use combine='concat' (per-row values) or combine='first')"
    ]
