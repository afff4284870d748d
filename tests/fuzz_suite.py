"""The differential program fuzzer (tests/fuzz_programs.py) on both lowerings, against torch.

`make test` runs this file in a fresh process (tests/test_fuzz.py); `make fuzz` runs its
first test at length.

* ``test_programs_agree_with_torch[callback|xla]``: random programs of 2-10 ops (views,
  in-place writes into fresh and cloned buffers, detach and no_grad, casts, reductions,
  indexing, scatter, broadcasting) through ``to_jax`` under jit, grad, vmap and jvp. CI runs
  a fixed share: hypothesis derandomized, ``CI_EXAMPLES`` programs per lowering.
  ``TORCHJAX_FUZZ_EXAMPLES=n`` runs n instead, and ``TORCHJAX_FUZZ_SEED=s`` draws them from
  seed s (``make fuzz``: 2000 from a random seed, printed). A failure shrinks to a minimal
  program and prints its source and a script that reproduces it.
* ``test_regression``: minimal programs the fuzzer (or an issue) found, each on both
  lowerings. A new one goes in ``REGRESSIONS`` (CONTRIBUTING.md, "The program fuzzer").
* ``test_fuzzer_catches_a_broken_rule``: with lowering="xla"'s stop-gradient made the
  identity, the fuzzer finds a mismatch (and the program it finds agrees without the break).

The session ends with one line, ``fuzz: N programs, ...: P passed, R refused, M mismatches``
(a refusal: lowering="xla" raising LoweringError, or the callback path failing where the
torch.func transform it is built on fails on the program itself).
"""

from __future__ import annotations

import importlib.util
import os
import textwrap

import fuzz_programs as fp
import pytest
from hypothesis import HealthCheck, Phase, find, given, seed, settings

CI_EXAMPLES = 40  # ~4-6 minutes for the file on the 2-core CI machine (CONTRIBUTING.md)
EXAMPLES = int(os.environ.get("TORCHJAX_FUZZ_EXAMPLES", CI_EXAMPLES))
SEED = os.environ.get("TORCHJAX_FUZZ_SEED")

COUNTERS = fp.Counters()
NO_TORCHAX = importlib.util.find_spec("torchax") is None
_needs_torchax = pytest.mark.skipif(NO_TORCHAX, reason="lowering='xla' needs torchax ([xla])")
LOWERINGS = ["callback", pytest.param("xla", marks=_needs_torchax)]


class _Summary:
    """A plugin, registered by the fixture below, that writes the counters at the end."""

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if COUNTERS.programs:
            terminalreporter.write_line(COUNTERS.summary() + (f" (seed {SEED})" if SEED else ""))
            if COUNTERS.total("refused") or COUNTERS.total("mismatch"):
                terminalreporter.write_line(COUNTERS.breakdown())


@pytest.fixture(scope="module", autouse=True)
def _summary(request: pytest.FixtureRequest):
    manager = request.config.pluginmanager
    if not manager.has_plugin("torchjax-fuzz-summary"):
        manager.register(_Summary(), "torchjax-fuzz-summary")
    yield


def _assert_agrees(program: fp.Program, lowering: str, full: bool = True) -> None:
    """Fails with the program's source, what differed, and a repro where any transform
    disagrees; unless `full`, stops at the first (the transform that failed last first)."""
    order = sorted(fp.TRANSFORMS, key=lambda t: t != _LAST_FAILED.get(lowering))
    outcomes = fp.check(program, lowering, order, stop_at_mismatch=not full)
    COUNTERS.add(outcomes)
    bad = [o for o in outcomes if o.status == "mismatch"]
    if bad:
        _LAST_FAILED[lowering] = bad[0].transform
        raise AssertionError(fp.failure_report(program, outcomes))


_LAST_FAILED: dict[str, str] = {}


def _final_run() -> bool:
    """Whether hypothesis runs the (shrunk) failing example a last time, to report it. A
    shrink step needs only "fails", and the export every transform shares costs most of a
    check, so the searches stop at the first mismatch and the final run checks all."""
    try:
        from hypothesis.control import current_build_context

        return bool(current_build_context().is_final)
    except Exception:  # (a private attribute: without it, every run is checked in full)
        return True


_settings = settings(
    max_examples=EXAMPLES,
    derandomize=SEED is None,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.slow
@pytest.mark.parametrize("lowering", LOWERINGS)
@_settings
@given(program=fp.programs())
def test_programs_agree_with_torch(lowering: str, program: fp.Program) -> None:
    _assert_agrees(program, lowering, full=_final_run())


if SEED is not None:
    test_programs_agree_with_torch = seed(int(SEED))(test_programs_agree_with_torch)


# -- regressions: minimal programs, each against torch on both lowerings ----------------


def _program(source: str, x=(3, 4), y=(4,), dynamic: bool = False) -> fp.Program:
    return fp.Program(
        source=textwrap.dedent(source).lstrip(), x_shape=x, y_shape=y, jit=True, dynamic=dynamic
    )


REGRESSIONS = {
    # issue 56: a slice assignment into zeros_like: JAX's gradient was 0 under xla
    "zeros_like_slice_assign": _program(
        """
        def program(x, y):
            out = torch.zeros_like(x)
            out[1:] = 2 * x[:-1]
            return (out * out).sum()
        """
    ),
    # issue 56: the scatter idiom new_zeros + index_add_: the same
    "new_zeros_index_add": _program(
        """
        def program(x, y):
            out = x.new_zeros(2, 4)
            out.index_add_(0, torch.tensor([0, 1, 0]), x)
            return (out * out).sum()
        """
    ),
    # issue 56: float64 arithmetic inside, x64 off: computed in float32 (off by up to 4)
    "float64_inside": _program(
        """
        def program(x, y):
            z = ((x.to(torch.float64) + 1e8) - 1e8).to(torch.float32)
            return (z * y).sum()
        """
    ),
    # issue 56: indexing with a boolean mask crashed (StaticArgumentError) under xla
    "bool_mask_read": _program(
        """
        def program(x, y):
            return (x[torch.tensor([True, False, True])] ** 2).sum()
        """,
        dynamic=True,
    ),
    # fuzzer: a one-element mask: a ShapeInferenceError under xla, not the LoweringError that
    # a longer mask gets
    "bool_mask_read_one_element": _program(
        """
        def program(x, y):
            return torch.sin(x[torch.tensor([True])]).sum()
        """,
        x=(1,),
        y=(1,),
        dynamic=True,
    ),
    # fuzzer: a boolean-mask read whose size a later op fixes (torch.export then records a
    # static shape): a ShapeInferenceError under xla, not a LoweringError
    "bool_mask_read_size_fixed_later": _program(
        """
        def program(x, y):
            v = x[torch.tensor([True, False, True])]
            return (v * torch.tensor([0.5, 2.0])).sum()
        """,
        x=(3,),
        y=(3,),
        dynamic=True,
    ),
    # fuzzer: a write into a no_grad-made tensor (a detach/no_grad block, then an in-place write)
    "no_grad_then_write": _program(
        """
        def program(x, y):
            with torch.no_grad():
                out = torch.sin(x) * 2
            out[1:] = torch.tanh(x[:-1])
            return (out * y).sum()
        """
    ),
    # fuzzer: an in-place op under no_grad on a differentiated tensor: torch's gradient does
    # not see the mul_ (its value does)
    "no_grad_inplace_after_write": _program(
        """
        def program(x, y):
            out = torch.zeros_like(x)
            out[1:] = x[:-1]
            with torch.no_grad():
                out.mul_(2.0)
            return (out * y).sum()
        """
    ),
}


@pytest.mark.parametrize("lowering", LOWERINGS)
@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(name: str, lowering: str) -> None:
    _assert_agrees(REGRESSIONS[name], lowering)


# -- the fuzzer catches a broken rule ----------------------------------------------------


@_needs_torchax
def test_fuzzer_catches_a_broken_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """lowering="xla" lowers what torch does not differentiate (aten.detach, and
    torchjax::stop_gradient for a no_grad block's values) to jax.lax.stop_gradient. Made the
    identity, the fuzzer's first few programs of detach / no_grad ops find a mismatch."""
    from torchjax._to_jax._xla._program import Program

    call = Program._call
    stops = {"aten.detach.default", "torchjax.stop_gradient.default"}

    def broken(self, node, args, kwargs, *rest):
        if str(node.target) in stops:
            return args[0]
        return call(self, node, args, kwargs, *rest)

    ops = [fp.OPS_BY_NAME[n] for n in ("unary", "detach", "no_grad")]
    strategy = fp.programs(min_ops=1, max_ops=3, ops=ops)

    def mismatches(program: fp.Program) -> bool:
        return any(o.status == "mismatch" for o in fp.check(program, "xla", ("grad",)))

    search = settings(
        max_examples=10,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    with monkeypatch.context() as patch:
        patch.setattr(Program, "_call", broken)
        found = find(strategy, mismatches, settings=search)
    assert {"detach", "no_grad"} & set(found.ops), found.source
    assert not mismatches(found), f"agrees with torch unbroken, or not?\n{found.source}"
