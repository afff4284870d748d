"""lowering="xla"'s route table (_xla/_routes.py): each route lowering_report prints comes
from a rule of the table, the table's records name real ops, and docs/lowering.md lists the
rules and refusals in the table's order."""

from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchjax

pytestmark = [
    pytest.mark.core,
    pytest.mark.skipif(
        importlib.util.find_spec("torchax") is None, reason="lowering='xla' needs torchax"
    ),
]

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _routes():
    from torchjax._to_jax._xla import _routes

    return _routes


def _listed_in_docs(marker: str) -> list[str]:
    """The bold names of the numbered list after `<!-- {marker}: ... -->` in lowering.md."""
    text = (ROOT / "docs" / "lowering.md").read_text()
    start = text.index(f"<!-- {marker}:")
    names = []
    for line in text[start:].splitlines()[1:]:
        found = re.match(r"\d+\. \*\*(.+?)\*\*", line)
        if found:
            names.append(found.group(1))
        elif line and not line.startswith(" ") and names:
            break
    return names


def test_the_docs_list_the_rules_and_refusals_in_the_tables_order():
    routes = _routes()
    assert _listed_in_docs("rules") == [r.name for r in routes.RULES]
    assert _listed_in_docs("refusals") == [r.name for r in routes.REFUSALS]


def test_each_policy_names_a_real_op_and_carries_what_its_kind_needs():
    routes = _routes()
    kinds = {routes.CALLBACK, routes.OWN_LOWERING, routes.KEPT_WHOLE, routes.DECOMPOSED_AS}
    for op, policy in routes.POLICIES.items():
        if policy.kind == routes.CAPTURED_AS:  # a torch function, by its path
            assert callable(routes.resolve(op)) and callable(policy.function), policy
            continue
        namespace, name, overload = op.split(".")
        assert isinstance(
            getattr(getattr(getattr(torch.ops, namespace), name), overload), torch._ops.OpOverload
        ), op
        assert policy.kind in kinds and policy.why, policy
        needs_function = policy.kind in (routes.OWN_LOWERING, routes.DECOMPOSED_AS)
        assert (policy.function is not None) == needs_function, policy


def test_the_last_rule_catches_every_node():
    routes = _routes()
    assert routes.RULES[-1].route == routes.OP_TABLE
    anything = routes.Site("aten.sin.default", None, None, object(), True)
    assert routes.RULES[-1].applies(anything)


@torch.library.custom_op("torchjax_test::routed", mutates_args=())
def _routed(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@_routed.register_fake
def _(x):
    return torch.empty_like(x)


def _reasons(routes) -> dict[str, str]:
    """{rule or fallback name: its reason as a pattern} for every callback route."""
    found = {r.name: re.escape(r.why) for r in routes.RULES if r.route == routes.TORCH_CALLBACK}
    for name, template in routes.FALLBACKS.items():
        parts = re.split(r"\{\w+\}", template)
        found[f"fallback: {name}"] = ".+".join(re.escape(p) for p in parts)
    return found


def _whys(fn, *args) -> set[str]:
    report = torchjax.lowering_report(fn, *args)
    return {route.why for route in report.callbacks}


def _with_entry(monkeypatch, op: str, **changes):
    """The op table's entry for `op` changed by `changes` (a lowering that raises, returns
    the wrong shape, or runs torch code), as a torchax release could give it."""
    from torchjax._to_jax._xla import _op_table

    real = _op_table.OpTable.lowering

    def lowering(self, target):
        entry = real(self, target)
        return dataclasses.replace(entry, **changes) if str(target) == op else entry

    monkeypatch.setattr(_op_table.OpTable, "lowering", lowering)


def test_every_reason_the_report_prints_comes_from_a_rule_of_the_table(monkeypatch):
    routes = _routes()
    x = jnp.asarray(np.eye(3, dtype=np.float32) * 2)
    whys = set()
    whys |= _whys(lambda t: torch.cholesky_inverse(t) + torch.rand_like(t), x)  # listed, random
    whys |= _whys(lambda t: _routed(t).sin(), x)  # no op-table entry
    with monkeypatch.context() as m:
        _with_entry(m, "aten.cos.default", is_jax_function=False)
        whys |= _whys(lambda t: t.cos(), x)
    with monkeypatch.context() as m:

        def raises(*args, **kwargs):
            raise ValueError("not for these arguments")

        _with_entry(m, "aten.cos.default", func=raises)
        whys |= _whys(lambda t: t.cos(), x)
    with monkeypatch.context() as m:
        _with_entry(m, "aten.cos.default", func=lambda t: jnp.cos(t)[0])
        whys |= _whys(lambda t: t.cos(), x)
    with monkeypatch.context() as m:
        _with_entry(m, "aten.max.dim", func=lambda t, dim, keepdim=False: jnp.max(t, dim))
        whys |= _whys(lambda t: t.max(dim=0).values, x)
    reasons = _reasons(routes)
    covered = set()
    for why in whys:
        matching = [name for name, pattern in reasons.items() if re.fullmatch(pattern, why)]
        assert matching, f"{why!r} is no reason of the route table"
        covered.update(matching)
    # Each callback rule and fallback is exercised above, so a new one needs a case here.
    assert covered == set(reasons), set(reasons) - covered


def test_no_route_is_decided_outside_the_table():
    # The lists that once decided routes beside the table are gone from the package.
    source = "\n".join(p.read_text() for p in (ROOT / "src").rglob("*.py"))
    for name in ("CALLBACK_OPS", "OWN_LOWERINGS", "KEPT_WHOLE:", "_callback_ops"):
        assert name not in source, name
