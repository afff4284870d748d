# The private JAX, jaxlib and torch names torchjax uses: every one is listed here and must
# exist in the installed versions, so an upgrade that removes one fails here, by name. They
# are all looked up in src/torchjax/_compat/ and nowhere else; where a public API can do a
# name's job, the fallback is exercised here too (it must cost speed, not function).
#
# Nothing is imported from torchjax at module level: if a required name is missing, importing
# torchjax raises, and the per-name tests below must still run and name it.
from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

# The version matrix runs this module; it is about the CPU (CPU private entry points).
pytestmark = [pytest.mark.core, pytest.mark.cpu_only]

SRC = Path(__file__).resolve().parent.parent / "src" / "torchjax"

COMPAT = SRC / "_compat"


def _listed_names() -> list[str]:
    """Every name _compat looks up or records, read from its source: `private("a", "b")`
    (alternatives, one per JAX or torch generation, joined by " | ": one of them must
    exist) and `register("a")`. "()" after a part means an instance of it; the torch.compile
    names are checked below. Read as text, so that a missing required name, which makes
    importing torchjax fail, is still named by the test below."""
    names = []
    for path in sorted(COMPAT.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "private",
                "register",
            ):
                paths = [a.value for a in node.args if isinstance(a, ast.Constant)]
                if node.func.id == "register":
                    paths = paths[:1]
                names.append(" | ".join(paths))
    return names


PRIVATE_NAMES = _listed_names()


def _exists(path: str) -> bool:
    """Whether a dotted path names something (``()``: an instance), without deprecation."""
    if path == "torch._dynamo.eval_frame.OptimizedModule()._orig_mod":
        linear = torch.nn.Linear(1, 1)
        return torch.compile(linear)._orig_mod is linear
    if path == "torch._dynamo.eval_frame.OptimizedModule().dynamo_ctx":
        compiled = torch.compile(torch.nn.Linear(1, 1))
        other = torch.nn.Linear(1, 1)
        return type(compiled)(other, compiled.dynamo_ctx)._orig_mod is other
    if path == "torch.compile(function)._torchdynamo_orig_callable":

        def f(x):
            return x

        return getattr(torch.compile(f), "_torchdynamo_orig_callable", None) is f
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        if any("()" in p for p in parts[:i]):
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            try:
                for part in parts[i:]:
                    obj = getattr(obj, part.removesuffix("()"))
                    obj = obj() if part.endswith("()") else obj
            except (AttributeError, DeprecationWarning):
                return False
        return True
    return False


@pytest.mark.parametrize("name", PRIVATE_NAMES)
def test_private_name_exists_in_installed_versions(name):
    versions = f"jax {jax.__version__}, torch {torch.__version__}"
    assert any(_exists(p) for p in name.split(" | ")), f"{name} is missing in {versions}"


def test_the_list_is_compat_registry():
    from torchjax._compat import _registry

    assert len(PRIVATE_NAMES) > 60  # the source was read
    assert sorted(PRIVATE_NAMES) == sorted(_registry.PRIVATE_NAMES)
    assert _registry.MISSING == []  # its own lookups agree: no fallback is in use here


# Private names written outside _compat/: module paths and attributes of other libraries.
_PRIVATE_TEXT = re.compile(
    r"_src|(?<!\w)torch\._|torch\.utils\._|jaxlib\.|StorageWeakRef|multiprocessing\.reductions"
    r"|experimental\.buffer_callback"
)
_PRIVATE_ATTRS = {
    "_version",
    "_is_zerotensor",
    "_parameters",
    "_buffers",
    "_modules",
    "_orig_mod",
    "_torchdynamo_orig_callable",
    "_current_level",
    "_C",
    "_functorch",
    "_jax",
    "_committed",
    "_device",
    "_use_count",
    "_is_view",
    "_base",
    "_cdata",
    "_schema",
}


@pytest.mark.parametrize(
    "path",
    sorted(p for p in SRC.rglob("*.py") if "_compat" not in p.parts),
    ids=lambda p: str(p.relative_to(SRC)),
)
def test_private_names_appear_only_in_compat(path):
    text = path.read_text()
    lines = [f"{i}: {line}" for i, line in enumerate(text.splitlines(), 1)]
    named = [ln for ln in lines if _PRIVATE_TEXT.search(ln)]
    assert not named, f"{path.name}: route these through torchjax._compat: {named}"
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRS:
            found.append(f"{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Constant) and node.value in _PRIVATE_ATTRS:
            found.append(f"{node.lineno}: {node.value!r}")  # getattr(x, "_version")
    assert not found, f"{path.name}: route these through torchjax._compat: {found}"


def test_dlpack_fast_paths_are_in_use_and_zero_copy():
    from torchjax._compat import _jax, _torch
    from torchjax._convert import array_to_tensor, tensor_to_jax

    t = torch.arange(16.0)
    a = tensor_to_jax(t)
    assert _torch.cpu_array_from_tensor.forms, "jaxlib's DLPack import fell back to jax.dlpack"
    assert a.unsafe_buffer_pointer() == t.data_ptr()
    assert type(a) is _jax.ArrayImpl and _jax.dlpack_export is not None
    assert array_to_tensor(a).data_ptr() == t.data_ptr()


# -- fallbacks: each must give the same results as the fast path ----------------------------


def test_dlpack_import_fallback_is_zero_copy():
    from torchjax._compat import _torch

    fallback = _torch._CpuImport()
    fallback.forms = []  # as where jaxlib's function is missing or takes none of the forms
    t = torch.arange(16.0)
    a = fallback(t, jax.devices("cpu")[0])
    np.testing.assert_array_equal(np.asarray(a), t.numpy())
    assert a.unsafe_buffer_pointer() == t.data_ptr()


def test_dlpack_import_tries_older_signatures():
    from torchjax._compat import _torch

    calls = []

    def only_three_args(capsule, device, stream):  # jaxlib <= 0.8.0's signature
        calls.append(stream)
        return jax.dlpack.from_dlpack(torch.utils.dlpack.from_dlpack(capsule), device=device)

    def strict(*args):
        if len(args) != 3:
            raise TypeError("dlpack_managed_tensor_to_buffer(): incompatible function arguments")
        return only_three_args(*args)

    convert = _torch._CpuImport()
    original = _torch.dlpack_import
    _torch.dlpack_import = strict
    try:
        out = convert(torch.ones(3), jax.devices("cpu")[0])
    finally:
        _torch.dlpack_import = original
    np.testing.assert_array_equal(np.asarray(out), np.ones(3))
    assert calls == [None] and convert.forms == [(None,)]


def test_eager_calls_without_trace_context(monkeypatch):
    import torchjax
    from torchjax._primitive import _core

    f = torchjax.to_jax(lambda x: torch.sin(x) * 2)
    x = jnp.linspace(0.0, 1.0, 5)
    expected = f(x)
    monkeypatch.setattr(_core, "at_top_level", lambda: False)  # every call binds
    np.testing.assert_allclose(f(x + 0), expected)
    np.testing.assert_allclose(jax.grad(lambda x: f(x).sum())(x), 2 * np.cos(x), rtol=1e-6)


def test_apply_primitive_fallback_runs_the_lowering(monkeypatch):
    from torchjax import PytreePrimitive
    from torchjax._compat import _jax

    p = PytreePrimitive("lowered_only")
    p.def_abstract_eval(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype))
    p.def_lowering(lambda x: x * 3)
    monkeypatch.setattr(_jax.dispatch, "apply_primitive", _jax._jit_apply_primitive)
    np.testing.assert_allclose(p.bind(jnp.arange(3.0)), [0.0, 3.0, 6.0])


def test_public_x64_flag_reads_the_same_state():
    from torchjax._compat import _jax

    public = _jax._PublicX64()
    assert public.value == _jax.jax_config.enable_x64.value == jax.config.jax_enable_x64
    with jax.enable_x64(not public.value):
        assert public.value == _jax.jax_config.enable_x64.value


def test_to_torch_without_functorch_state(monkeypatch):
    import torchjax
    from torchjax._to_torch import _to_torch

    # As if torch lacked the functorch and forward-AD probes: every call is autograd.Function.
    monkeypatch.setattr(_to_torch, "functorch_transforms_active", lambda: True)
    f = torchjax.to_torch(lambda x: jnp.sin(x) * 2)
    x = torch.linspace(0.0, 1.0, 5, requires_grad=True)
    f(x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * torch.cos(x.detach()))
    torch.testing.assert_close(torch.func.vmap(f)(x.detach()[:, None]), 2 * torch.sin(x[:, None]))


def test_grad_mode_setter_fallback():
    was = torch.is_grad_enabled()
    try:
        torch.set_grad_enabled(False)  # the fallback, called as a function
        assert not torch.is_grad_enabled()
    finally:
        torch.set_grad_enabled(was)


def test_a_missing_required_name_fails_the_import_by_name():
    code = (
        "import torch\n"
        "del torch._C._DisableFuncTorch\n"
        "try:\n"
        "    import torchjax\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch._C._DisableFuncTorch" in out.stdout and "docs/install.md" in out.stdout


def test_direct_linearization_is_registered_and_agrees_with_jax_fallback(monkeypatch):
    # Each JAX generation's calling convention is recognized (the matrix runs this on the
    # oldest and newest), and without the rule JAX's own linearization of the JVP rule
    # gives the same values: the rule costs nothing but time to lose.
    import torchjax
    from torchjax._compat import _jax
    from torchjax._to_jax._torch_call._primitive import torch_call_p

    assert _jax.LINEARIZE_CONVENTION in ("nonzeros", "is_vjp", "structured")
    table = _jax._linearizations
    assert torch_call_p.primitive in table

    def loss(w, x):
        return (torch.tanh(x @ w) ** 2).sum(), x.sum()

    f = torchjax.to_jax(loss)
    w = jnp.linspace(-1.0, 1.0, 6).reshape(3, 2)
    x = jnp.linspace(0.5, 2.0, 12).reshape(4, 3)
    step = lambda w, x: jax.value_and_grad(lambda w: f(w, x)[0])(w)
    got = [step(w, x), jax.jit(step)(w, x), jax.linearize(lambda w: f(w, x)[0], w)[1](w)]
    monkeypatch.delitem(table, torch_call_p.primitive)
    want = [step(w, x), jax.jit(step)(w, x), jax.linearize(lambda w: f(w, x)[0], w)[1](w)]
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    ref = jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2))(w)
    np.testing.assert_allclose(got[0][1], ref, rtol=1e-5)
