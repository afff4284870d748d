"""torchjax.errors: every error class users may catch, each caught from a realistic failure."""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import pytest
import torch
from helpers import Cube

import torchjax
import torchjax.errors as errors
from torchjax import _errors

PUBLIC = [
    "TorchJaxError",
    "ArgumentError",
    "ConversionError",
    "StaticArgumentError",
    "RuleError",
    "OutputMismatchError",
    "ShapeInferenceError",
    "InPlaceMutationError",
    "VmapError",
    "AutodiffError",
    "JaxOutputError",
    "VariablesError",
    "LoweringError",
]
# warnings, not errors: torchjax carries on after them
WARNINGS = ["StateWarning", "ShardingWarning", "CopyWarning"]


def test_every_error_class_is_public_and_derives_from_the_base():
    assert sorted(errors.__all__) == sorted(PUBLIC + WARNINGS)
    for name in PUBLIC + WARNINGS:
        cls = getattr(errors, name)
        base = errors.TorchJaxError if name in PUBLIC else UserWarning
        assert inspect.isclass(cls) and issubclass(cls, base), name
        assert cls.__module__ == "torchjax._errors"
        assert inspect.getdoc(cls), f"{name} has no docstring"
    # No error or warning class defined privately and left out of the public module.
    private = {
        n for n, c in vars(_errors).items() if inspect.isclass(c) and issubclass(c, Exception)
    }
    assert private == set(PUBLIC + WARNINGS)
    assert torchjax.errors is errors  # reachable as an attribute after `import torchjax`


# Each case provokes the error the way a user would meet it.


def _conversion():
    torchjax.to_jax(torch.sin)(torch.ones(3))  # a tensor where a JAX array is expected


def _static_argument():
    torchjax.to_jax(lambda x, s: x * len(s))(jnp.ones(2), {1, 2})  # a set: unhashable


def _rule():
    p = torchjax.PytreePrimitive("no_jvp")
    p.def_impl(lambda x: x * 2)
    p.def_abstract_eval(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
    jax.grad(lambda x: p.bind(x).sum())(jnp.ones(3))


def _output_mismatch():
    declared = jax.ShapeDtypeStruct((2,), jnp.float32)
    torchjax.to_jax(lambda x: x * 2, result_shape_dtypes=declared)(jnp.ones(3))


def _shape_inference():  # under jit: eagerly it would run for real
    jax.jit(torchjax.to_jax(lambda x: x[: int(x.sum().item())]))(jnp.ones(3))


def _in_place():
    torchjax.to_jax(lambda x: x.mul_(2))(jnp.ones(3))


def _torch_call():
    def f(x):
        if not torch._subclasses.fake_tensor.is_fake(x) and bool((x < 0).any()):
            raise ValueError("negative input")
        return x.sqrt()

    torchjax.to_jax(f)(-jnp.ones(3))


def _vmap():
    # torch.func.vmap cannot batch .item(); the declared types skip the fake run.
    f = torchjax.to_jax(
        lambda x: x * x.sum().item(), result_shape_dtypes=jax.ShapeDtypeStruct((3,), jnp.float32)
    )
    jax.vmap(f)(jnp.ones((2, 3)))


def _autodiff():  # forward mode: torch.func cannot transform an old-style Function
    f = torchjax.to_jax(lambda t: Cube.apply(t).sum())
    jax.jvp(f, (jnp.ones(3),), (jnp.ones(3),))


def _jax_output():
    torchjax.to_torch(lambda x: (x, "label"))(torch.ones(2))


def _variables():
    apply, variables = torchjax.module_to_jax(torch.nn.Linear(3, 2))
    params = {**variables["params"], "weight": jnp.ones((3, 3))}
    apply({"params": params, "buffers": {}}, jnp.ones(3))


def _argument():
    torchjax.to_jax(torch.sin, vmap_method="loop")  # not one of the choices


def _lowering():
    # A symbolic size that is an expression: torch.export's dims map plain symbols only.
    # (Checked before the op table is needed: this case runs without the [xla] extra too.)
    (b,) = jax.export.symbolic_shape("b")
    f = torchjax.to_jax(lambda x: x * 2, lowering="xla")
    jax.eval_shape(f, jax.ShapeDtypeStruct((2 * b,), jnp.float32))


CASES = {
    "ArgumentError": (_argument, r"vmap_method.*'loop'.*'torch.func'"),
    "ConversionError": (_conversion, r"args\[0\] is a torch.Tensor"),
    "StaticArgumentError": (_static_argument, r"args\[1\] is a set"),
    "RuleError": (_rule, "no jvp rule"),
    "OutputMismatchError": (_output_mismatch, r"float32\[3\].*float32\[2\] was declared"),
    "ShapeInferenceError": (_shape_inference, "result_shape_dtypes"),
    "InPlaceMutationError": (_in_place, r"modifies its input args\[0\] in place"),
    "VmapError": (_vmap, "torch.func.vmap could not batch"),
    "AutodiffError": (_autodiff, "grad_method='autograd'"),
    "JaxOutputError": (_jax_output, r"output\[1\] is a str"),
    "VariablesError": (_variables, r"'weight'\] has shape \[3, 3\]"),
    "LoweringError": (_lowering, r"args\[0\] has the symbolic dimension '2\*b'"),
}


def test_every_subclass_has_a_case():
    assert set(CASES) == set(PUBLIC) - {"TorchJaxError"}
    assert set(WARNING_CASES) == set(WARNINGS) - {"ShardingWarning"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_raised_error_is_caught_by_its_public_class(name):
    provoke, message = CASES[name]
    cls = getattr(errors, name)
    with pytest.raises(cls, match=message) as info:
        provoke()
    assert type(info.value) is cls  # exactly this class, not merely a subclass of it
    # ... and by the common base.
    try:
        provoke()
    except errors.TorchJaxError as e:
        assert isinstance(e, cls)
    else:
        pytest.fail(f"{name}: nothing raised the second time")


def _state_warning():
    apply, variables = torchjax.module_to_jax(torch.nn.BatchNorm1d(2))  # training mode
    apply(variables, jnp.ones((4, 2)))  # writes running statistics, mutable=False drops them


def _copy_warning():
    torchjax.to_jax(lambda t: t * (t.data_ptr() > 0))(jnp.ones(3))  # a writable pointer


WARNING_CASES = {  # ShardingWarning needs several devices: tests/multidevice_script.py
    "StateWarning": (_state_warning, r"running_mean.*mutable=True"),
    "CopyWarning": (
        _copy_warning,
        r"(?s)writable pointer without writing to it, at test_errors.py:\d+ in <lambda>"
        r".*const_data_ptr\(\).*filterwarnings\(\"ignore\", category=torchjax.errors.CopyWarning",
    ),
}


@pytest.mark.parametrize("name", sorted(WARNING_CASES))
def test_warning_is_caught_by_its_public_class(name):
    provoke, message = WARNING_CASES[name]
    with pytest.warns(getattr(errors, name), match=message):
        provoke()


def _warned_where(call):
    """(file, line) each torchjax warning of `call()` names, and those of `call`'s line."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    ours = [w for w in caught if w.category.__module__.startswith("torchjax")]
    assert ours, caught
    return {(w.filename, w.lineno) for w in ours}


@pytest.mark.parametrize("jit", [False, True])
def test_warnings_point_at_the_users_call(jit):
    """Not at torchjax's own code: the user's line (through JAX's tracing under jit)."""
    here = inspect.getsourcefile(test_warnings_point_at_the_users_call)
    wrap = jax.jit if jit else (lambda f: f)
    apply, variables = torchjax.module_to_jax(torch.nn.BatchNorm1d(2))
    line = inspect.currentframe().f_lineno + 1
    state = lambda: wrap(lambda x: apply(variables, x))(jnp.ones((4, 2)))
    assert _warned_where(state) == {(here, line)}
    f = torchjax.to_jax(lambda t: t * (t.data_ptr() > 0))
    line = inspect.currentframe().f_lineno + 1
    copy = lambda: wrap(f)(jnp.ones(3))
    assert _warned_where(copy) == {(here, line)}
    held = torch.nn.Linear(2, 2)
    kept = held.weight  # still referenced here: "move" copies it, and says so
    line = inspect.currentframe().f_lineno + 1
    move = lambda: torchjax.module_to_jax(held, copy="move")
    assert _warned_where(move) == {(here, line)}
    del kept


def test_builtin_kinds_still_catch():
    # Code written against the builtin exception types keeps working.
    with pytest.raises(TypeError):
        _conversion()
    with pytest.raises(ValueError):
        _variables()
    with pytest.raises(RuntimeError):
        _in_place()
    with pytest.raises(NotImplementedError):
        _rule()
    with pytest.raises(TypeError):
        _jax_output()
