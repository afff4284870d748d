"""jax.export serializes every output container torchjax makes (lowering="xla"): a Hugging
Face ModelOutput (an OutputDict), a torch.return_types structseq (its namedtuple), and a
user's namedtuple once the user registers its class. Each artifact is serialized,
deserialized and called (here, in a fresh process with torchjax, and in one where torch
cannot be imported) and compared with the torch module or function called directly."""

from __future__ import annotations

import collections
import importlib.util
import os
import pickle
import subprocess
import sys
import textwrap
import uuid
from typing import NamedTuple

import jax
import numpy as np
import pytest
import torch

import torchjax
from torchjax._compat import _jax as compat_jax
from torchjax._to_jax._call import _outputs
from torchjax._to_jax._call._outputs import OutputDict

if importlib.util.find_spec("torchax") is None:
    pytest.skip("lowering='xla' needs torchax (the [xla] extra)", allow_module_level=True)

rng = np.random.default_rng(0)
X = rng.standard_normal((4, 3)).astype(np.float32)
IDS = np.array([[1, 5, 7, 9, 2, 3]], np.int32)


def _round_trip(exported: jax.export.Exported) -> jax.export.Exported:
    restored = jax.export.deserialize(exported.serialize())
    assert restored.out_tree == exported.out_tree
    return restored


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope="module")
def gpt2():
    """GPT-2's ModelOutput, exported: logits and hidden_states, in that order (not sorted:
    a deserializer that sorted the keys would pair them with the wrong values)."""
    model = _tiny_gpt2()
    apply, v = torchjax.module_to_jax(model, lowering="xla")
    fn = jax.jit(lambda v, ids: apply(v, ids, use_cache=False, output_hidden_states=True))
    with torch.no_grad():
        want = model(torch.as_tensor(IDS).long(), use_cache=False, output_hidden_states=True)
    return jax.export.export(fn)(v, IDS), v, want


def top(x):  # [N, 3] -> values [3], indices [3]
    return torch.max(x, dim=0)


def _top_exported():
    f = torchjax.to_jax(top, lowering="xla")
    return jax.export.export(jax.jit(f))(X), type(f(X))


# -- in this process ----------------------------------------------------------------------
def test_model_output_serializes_as_output_dict(gpt2):
    exported, v, want = gpt2
    out = _round_trip(exported).call(v, IDS)
    assert type(out) is OutputDict and list(out) == list(want.keys())
    assert list(out) == ["logits", "hidden_states"]
    np.testing.assert_allclose(out.logits, want.logits.numpy(), rtol=1e-5, atol=1e-5)
    assert len(out.hidden_states) == len(want.hidden_states) == 2
    for got, ref in zip(out.hidden_states, want.hidden_states, strict=True):
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-5, atol=1e-5)


def test_structseq_serializes_as_its_namedtuple():
    exported, cls = _top_exported()
    out = _round_trip(exported).call(X)
    want = torch.max(torch.as_tensor(X), dim=0)
    assert type(out) is cls and cls._fields == ("values", "indices")
    np.testing.assert_array_equal(out.values, want.values.numpy())
    np.testing.assert_array_equal(out.indices, want.indices.numpy())


class Pair(NamedTuple):
    total: torch.Tensor
    scaled: torch.Tensor


class Unregistered(NamedTuple):
    total: torch.Tensor


# The user's one line (docs/lowering.md): torchjax returns the user's own class, so the
# name is the user's to give.
jax.export.register_namedtuple_serialization(Pair, serialized_name="tests.export_outputs.Pair")


def _pair(x):
    return Pair(x.sum(0), x * 2)


def test_a_users_registered_namedtuple_serializes_as_itself():
    f = torchjax.to_jax(_pair, lowering="xla")
    out = _round_trip(jax.export.export(jax.jit(f))(X)).call(X)
    want = _pair(torch.as_tensor(X))
    assert type(out) is Pair
    np.testing.assert_allclose(out.total, want.total.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(out.scaled, want.scaled.numpy())


def test_a_users_unregistered_namedtuple_is_named_by_jax():
    f = torchjax.to_jax(lambda x: Unregistered(x.sum(0)), lowering="xla")
    exported = jax.export.export(jax.jit(f))(X)  # exporting works; writing the bytes not
    with pytest.raises(ValueError, match="unregistered type.*Unregistered.*register_namedtuple"):
        exported.serialize()


# -- a name that is taken -------------------------------------------------------------------
def _structseq_like(fields: tuple[str, ...]) -> type:
    """What _namedtuple reads of a structseq class, under a name no other test uses."""
    name = f"fake_{uuid.uuid4().hex}"
    attrs = {"n_sequence_fields": len(fields), "__match_args__": (*fields, "extra")}
    return type(name, (), {**attrs, "__module__": "tests.fake"})


def test_a_namedtuple_made_twice_is_one_registered_class():
    # As two threads making the first one at once do: the second finds the name taken and
    # returns the class registered under it, so no output of an unregistered class escapes.
    structseq = _structseq_like(("values", "indices"))
    first = _outputs._namedtuple.__wrapped__(structseq)
    second = _outputs._namedtuple.__wrapped__(structseq)
    assert second is first and first._fields == ("values", "indices")
    assert compat_jax.export_type_named(f"torchjax.tests.fake.{structseq.__name__}") is first


def test_a_name_the_user_registered_first_gives_the_users_class():
    # The user registered the name to deserialize an artifact before torchjax made its class.
    structseq = _structseq_like(("values", "indices"))
    mine = collections.namedtuple("mine", ["values", "indices"])
    jax.export.register_namedtuple_serialization(
        mine, serialized_name=f"torchjax.tests.fake.{structseq.__name__}"
    )
    assert _outputs._namedtuple.__wrapped__(structseq) is mine


def test_a_name_taken_by_another_kind_of_class_leaves_this_one_unregistered(monkeypatch):
    structseq = _structseq_like(("values", "indices"))
    other = collections.namedtuple("other", ["a", "b"])
    jax.export.register_namedtuple_serialization(
        other, serialized_name=f"torchjax.tests.fake.{structseq.__name__}"
    )
    made = _outputs._namedtuple.__wrapped__(structseq)
    assert made is not other and made._fields == ("values", "indices")
    # Without jax.export's private table (the fallback): the class made here, unregistered.
    monkeypatch.setattr(compat_jax, "_export_names", compat_jax.ABSENT)
    assert compat_jax.export_type_named(f"torchjax.tests.fake.{structseq.__name__}") is None
    assert _outputs._namedtuple.__wrapped__(structseq) is not other


def test_an_output_dict_with_a_key_that_is_not_a_string_names_the_fix():
    exported = jax.export.export(jax.jit(lambda x: OutputDict({0: x})))(X)
    with pytest.raises(TypeError, match="key 0 \\(a int\\).*string keys"):
        exported.serialize()


# -- in a fresh process -------------------------------------------------------------------
# As test_lowering_xla.py's served-without-torch test: the artifacts and inputs go to files,
# a subprocess deserializes and calls them and writes what it got, compared here with torch.
# Where torch cannot be imported, neither can torchjax (it imports torch): the script
# registers the names torchjax wrote, with docs/lowering.md's lines, and an OutputDict comes
# back as an OrderedDict in its own order.
_NO_TORCH = """
sys.modules["torch"] = None  # `import torch` fails in this process
try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch imported")
export.register_pytree_node_serialization(
    type("OutputDict", (), {}),
    serialized_name="torchjax.OutputDict",
    serialize_auxdata=lambda keys: json.dumps(keys).encode(),
    deserialize_auxdata=json.loads,
    from_children=lambda keys, values: collections.OrderedDict(zip(keys, values)),
)
"""
# With torchjax: importing it registers "torchjax.OutputDict"; a return_types name is the
# process's own line, and torchjax then returns that class for torch.max's result.
_WITH_TORCHJAX = """
import torch, torchjax
"""
_SERVE = """
import collections, json, pickle, sys
import numpy as np
from jax import export
{setup}
Max = collections.namedtuple("max", ["values", "indices"])
export.register_namedtuple_serialization(Max, serialized_name="torchjax.return_types.max")
gpt2, top, inputs, result = sys.argv[1:]
v, ids, x = pickle.load(open(inputs, "rb"))
out = export.deserialize(open(gpt2, "rb").read()).call(v, ids)
found = export.deserialize(open(top, "rb").read()).call(x)
got = {{
    "type": type(out).__name__,
    "keys": list(out),
    "logits": np.asarray(out["logits"]),
    "hidden_states": [np.asarray(h) for h in out["hidden_states"]],
    "max_is_registered_class": type(found) is Max,
    "values": np.asarray(found.values),
    "indices": np.asarray(found.indices),
}}
if "torchjax" in sys.modules:
    got["torchjax_returns_it"] = type(torchjax.to_jax(lambda x: torch.max(x, 0))(x)) is Max
pickle.dump(got, open(result, "wb"))
"""


@pytest.fixture(scope="module")
def artifacts(gpt2, tmp_path_factory):
    """The GPT-2 and torch.max artifacts, their inputs, and torch's outputs for them."""
    folder = tmp_path_factory.mktemp("export_outputs")
    exported, v, want = gpt2
    top_exported, _ = _top_exported()
    (folder / "gpt2.bin").write_bytes(exported.serialize())
    (folder / "top.bin").write_bytes(top_exported.serialize())
    (folder / "inputs.pkl").write_bytes(pickle.dumps((jax.tree.map(np.asarray, v), IDS, X)))
    return folder, want


def _serve(artifacts, setup: str) -> dict:
    folder, _ = artifacts
    names = ("gpt2.bin", "top.bin", "inputs.pkl", f"result_{uuid.uuid4().hex}.pkl")
    env = {k: val for k, val in os.environ.items() if k != "PYTHONPATH"}
    script = textwrap.dedent(_SERVE).format(setup=textwrap.dedent(setup))
    result = subprocess.run(
        [sys.executable, "-c", script, *(str(folder / n) for n in names)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    return pickle.loads((folder / names[-1]).read_bytes())


def _check_served(got: dict, want) -> None:
    assert got["keys"] == list(want.keys()) == ["logits", "hidden_states"]
    np.testing.assert_allclose(got["logits"], want.logits.numpy(), rtol=1e-5, atol=1e-5)
    for h, ref in zip(got["hidden_states"], want.hidden_states, strict=True):
        np.testing.assert_allclose(h, ref.numpy(), rtol=1e-5, atol=1e-5)
    ref = torch.max(torch.as_tensor(X), dim=0)
    assert got["max_is_registered_class"]
    np.testing.assert_array_equal(got["values"], ref.values.numpy())
    np.testing.assert_array_equal(got["indices"], ref.indices.numpy())


@pytest.mark.slow
def test_outputs_deserialize_where_torch_cannot_be_imported(artifacts):
    got = _serve(artifacts, _NO_TORCH)
    assert got["type"] == "OrderedDict"
    _check_served(got, artifacts[1])


@pytest.mark.slow
def test_outputs_deserialize_in_a_fresh_process_that_imports_torchjax(artifacts):
    got = _serve(artifacts, _WITH_TORCHJAX)
    assert got["type"] == "OutputDict" and got["torchjax_returns_it"]
    _check_served(got, artifacts[1])
