# One input signature of a torch function captured by torch.export: example tensors of the
# signature's shapes (JAX's symbolic dimensions become torch.export dims), the graph in core
# ATen after decompositions, and a LoweringError naming the frame where capture fails.
from __future__ import annotations

import contextlib
import dataclasses
import gc
import traceback
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import torch

from torchjax._compat._messages import refuses_grad, refuses_view
from torchjax._compat._torch import (
    export_silenced,
    imports_outside_fakes,
    is_fake,
    is_op_overload,
    op_schema,
)
from torchjax._convert import torch_dtype
from torchjax._errors import LoweringError, TorchJaxError
from torchjax._log import logger
from torchjax._to_jax._call._outputs import as_jax_tree
from torchjax._to_jax._context import FAKE_RUN_LOCK
from torchjax._to_jax._fake._isolation import FakeRunState
from torchjax._to_jax._fake._run import output_struct
from torchjax._to_jax._xla._autograd_functions import AutogradFunctions
from torchjax._to_jax._xla._gradients import mark_stop_gradients
from torchjax._to_jax._xla._op_table import OpTable
from torchjax._to_jax._xla._routes import captured_as, decomposed_as, kept_whole
from torchjax._to_jax._xla._value_checks import ChecksSkipped
from torchjax._x64 import widened_dtype

_tree = jax.tree_util

_NOT_CAPTURED = """\
lowering="xla": torch.export cannot capture {name}{where}:
    {error}
lowering="xla" turns the torch ops of one traced run into JAX ops, so the function must run
the same ops whatever its inputs' values: no Python branch on a tensor's value (`if x.sum() >
0:`), no .item() or .tolist() that decides what runs next. Rewrite such code with torch.where
(torch.cond is captured, but lowering="xla" has no lowering for it yet), or use
lowering="callback" (the default), which runs any torch code."""

_EXPRESSION = """\
lowering="xla": {path} has the symbolic dimension {dim!r}, an expression. torch.export's dims
map only plain symbols: give the argument its own symbol (jax.export.symbolic_shape("b, 3")),
and compute derived sizes inside the function."""

_TREESPEC_NOTICE = r".*isinstance\(treespec, LeafSpec\)"

# Example sizes for symbolic dimensions: distinct and above 1, so torch.export neither
# specializes a dim to 0/1 nor takes two different symbols for equal.
_HINTS = (5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43)


@dataclasses.dataclass
class Captured:
    """What one run of the function under torch.export left beside its graph: the output's
    tree, and its leaves that are not tensors (Python numbers, None), which stay constants."""

    out_tree: Any = None
    constants: dict = dataclasses.field(default_factory=dict)  # leaf index -> value
    fake_mode: Any = None  # the capture's: what it made and left behind is found by it
    # the torch.autograd.Function classes the run applied: torch.export keeps their
    # forward's ops and drops their backward
    autograd_functions: list = dataclasses.field(default_factory=list)


class _Flat(torch.nn.Module):
    """The function as torch.export wants it: a module whose forward takes a list of tensors
    (the signature's arrays, in flattening order) and returns a tuple of tensors."""

    def __init__(self, fn: Callable, name: str, in_tree: Any, template: tuple, captured: Captured):
        super().__init__()
        self.fn, self.name, self.in_tree = fn, name, in_tree
        self.template, self.captured = template, captured

    def forward(self, tensors: list) -> tuple:
        # (not on self: torch.export puts back the attributes its run sets on a module)
        self.captured.fake_mode = next((t.fake_mode for t in tensors if _is_fake(t, None)), None)
        it = iter(tensors)
        leaves = [next(it) if is_slot else leaf for is_slot, leaf in self.template]
        args, kwargs = _tree.tree_unflatten(self.in_tree, leaves)
        # (torch.return_types' structseqs and dict-like outputs as the callback path returns
        # them: containers JAX knows)
        out = as_jax_tree(self.fn(*args, **kwargs))
        with_paths, self.captured.out_tree = _tree.tree_flatten_with_path(out)
        out_leaves = [leaf for _, leaf in with_paths]
        for path, leaf in with_paths:
            if not isinstance(leaf, torch.Tensor):
                output_struct(path, leaf, self.name)  # a number, else a clear error
        self.captured.constants = {
            i: v for i, v in enumerate(out_leaves) if not isinstance(v, torch.Tensor)
        }
        tensors_out = tuple(v for v in out_leaves if isinstance(v, torch.Tensor))
        return tensors_out


def _dim_spec(shape: tuple, path: str, dims: dict) -> tuple[list, dict | None]:
    """Example sizes for `shape` and its torch.export dynamic-shape spec (None: all static)."""
    sizes, spec = [], {}
    for axis, d in enumerate(shape):
        if isinstance(d, int | np.integer):
            sizes.append(int(d))
            continue
        name = str(d)
        if not name.isidentifier():
            raise LoweringError(_EXPRESSION.format(path=path, dim=name))
        if name not in dims:
            hint = _HINTS[len(dims) % len(_HINTS)] + 64 * (len(dims) // len(_HINTS))
            dims[name] = (torch.export.Dim(name), hint)
        spec[axis] = dims[name][0]
        sizes.append(dims[name][1])
    return sizes, (spec or None)


def examples(avals: list, paths: list[str], widen: bool = False) -> tuple[list, dict | None]:
    """Example tensors for a signature's arrays and torch.export's dynamic shapes for them
    (None where every size is static): JAX's symbolic dimensions become torch.export dims,
    one per symbol. `paths` name the arrays in messages. With `widen`, an int32 array is an
    int64 tensor, as the callback path hands it to torch with x64 off (_convert.py's x64
    policy: torch's indexing code wants int64); JAX computes it in int32 all the same."""
    dims: dict = {}
    tensors, specs = [], []
    for aval, path in zip(avals, paths, strict=True):
        sizes, spec = _dim_spec(tuple(aval.shape), path, dims)
        dtype = torch_dtype(aval.dtype)
        if widen:
            dtype = widened_dtype(dtype)
        tensors.append(torch.zeros(sizes, dtype=dtype))
        specs.append(spec)
    return tensors, ({"tensors": specs} if any(s is not None for s in specs) else None)


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Within: what torch.export prints to stderr (the partial FX graph of a failed capture,
    twice) and its loggers' warnings go to torchjax's logger at DEBUG, not to stderr: a
    failed capture shows torchjax's error alone, a healthy one nothing."""
    with export_silenced() as printed:
        try:
            yield
        finally:
            if printed.getvalue().strip():
                logger.debug(
                    "torch.export printed while capturing %s:\n%s", name, printed.getvalue()
                )


def capture(
    fn: Callable,
    name: str,
    in_tree: Any,
    template: tuple,
    example: tuple[list, dict | None],
    table: OpTable,
) -> tuple[torch.export.ExportedProgram, Captured]:
    """torch.export `fn` at one signature and decompose its graph to the ops the table lowers.

    `template` holds (True, None) where an array goes and (False, leaf) for a static leaf;
    `example` is what examples() made of the signature's arrays.
    """
    tensors, dynamic = example
    captured = Captured()
    flat = _Flat(fn, name, in_tree, template, captured)
    # torch.export runs the function's Python on fake tensors: what it leaves in the state
    # the function reaches (a cache filled on first use) is put back, as after a fake run.
    touched = FakeRunState(fn, name)
    functions = AutogradFunctions()
    try:
        try:
            # (enable_grad: the grad mode plain torch code runs in)
            with FAKE_RUN_LOCK, torch.enable_grad(), warnings.catch_warnings():
                # torch.export's own pytree deprecation notice, about its internals.
                warnings.filterwarnings("ignore", _TREESPEC_NOTICE, FutureWarning)
                with functions, ChecksSkipped(captured_as()), _quiet(name):
                    with imports_outside_fakes():  # (see _fake/_run.py)
                        program = _export(flat, tensors, dynamic)
        finally:
            touched.restore()
            touched.clear_grown_caches()  # a cache filled on first use holds a fake tensor
        captured.autograd_functions = [f.__qualname__ for f in functions.found]
    except TorchJaxError:
        raise
    except Exception as error:
        _take_back_fakes(captured.fake_mode, None, touched, after=error)
        captured.fake_mode = None
        if _raised_by_user(error):
            raise  # the user's own exception (an input check, say) stays theirs
        if functions.derivatives:
            raise LoweringError(_derivative_inside(name, functions.derivatives)) from error
        raise LoweringError(_not_captured(name, error)) from error
    if functions.derivatives:
        raise LoweringError(_derivative_inside(name, functions.derivatives))
    _take_back_fakes(captured.fake_mode, program, touched)
    captured.fake_mode = None  # (it holds what it made fakes of: the module's tensors)
    try:
        mark_stop_gradients(program.graph_module, name)
        return _decomposed(program, table), captured
    except TorchJaxError:
        raise
    except Exception as error:  # torch's own failure replaying the graph it captured
        raise LoweringError(_NOT_DECOMPOSED.format(name=name, error=_first_lines(error))) from error


_LEFT_BEHIND = """\
lowering="xla": torch.export ran {name} on tensors without data to capture it, and the run
left one in {holder}, which outlives the capture: a later call, in JAX or in plain torch,
would read it as garbage. torchjax puts back the state of the modules it can reach from the
function and clears lru_caches; this holder it could not reach. That object now holds a
tensor without data: rebuild it. Make the state an input of the function, or fill it before
the first lowered call, or use lowering="callback" (the default), whose eager calls run on
real tensors."""


def _take_back_fakes(
    mode: Any,
    program: torch.export.ExportedProgram | None,
    touched: FakeRunState,
    after: BaseException | None = None,
) -> None:
    """Take back the fake tensors (of `mode`, the capture's) the capture's run left in the
    function's state (a store filled on first use, keyed by a tensor made there:
    pyro.param's), as after a fake run (_fake/_isolation.py), or refuse naming the holder.
    What the program holds (its nodes' types, torch.export's records of its fake inputs)
    is not the run's leftovers; `after`: the failure of a capture that made no program."""
    if mode is None:
        return
    with warnings.catch_warnings():  # (isinstance on torch's deprecated module proxies)
        warnings.simplefilter("ignore")
        touched.held = _held_by(program) if program is not None else set()
        touched.made = [weakref.ref(o) for o in gc.get_objects() if _is_fake(o, mode)]
    touched.check_left_behind(after, message=_LEFT_BEHIND, error=LoweringError)
    touched.held = set()


def _is_fake(o: Any, mode: Any) -> bool:
    """Whether `o` is a fake tensor (of `mode`, this capture's, unless None)."""
    # (type(o), not isinstance: isinstance asks a weakref.proxy's referent, maybe dead)
    if not issubclass(type(o), torch.Tensor) or not is_fake(o):
        return False
    return mode is None or getattr(o, "fake_mode", None) is mode


# Where a walk of the program's own objects stops: code and namespaces lead to everything.
_NOT_WALKED = (type, types.ModuleType, types.FunctionType, types.MethodType, types.CodeType)


def _held_by(root: Any) -> set[int]:
    """The ids of the objects `root` holds (gc's referents, breadth first), but through
    functions, classes and modules."""
    seen = {id(root)}
    frontier = [root]
    while frontier:
        nxt = []
        for o in gc.get_referents(*frontier):
            if id(o) not in seen and not issubclass(type(o), _NOT_WALKED):
                seen.add(id(o))
                nxt.append(o)
        frontier = nxt
    return seen


def _decomposed(
    program: torch.export.ExportedProgram, table: OpTable
) -> torch.export.ExportedProgram:
    """`program` decomposed to the ops the table lowers. torch replays the graph to do it,
    and a decomposition may give a value other strides than the capture saw (SDPA's output,
    in transformers' GPT-2 at a batch above 1): an aten.view of it that was valid then fails.
    Where that happens in a graph that writes nothing in place, its views become reshapes,
    the same values (a functional graph's outputs alias nothing JAX could see), and it is
    decomposed again."""
    decompositions = _decompositions(table)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _TREESPEC_NOTICE, FutureWarning)
        try:
            return program.run_decompositions(decompositions)
        except (RuntimeError, ValueError) as error:
            if not refuses_view(error) or not _views_as_reshapes(program):
                raise
        return program.run_decompositions(decompositions)


def _views_as_reshapes(program: torch.export.ExportedProgram) -> bool:
    """Turn the aten.view nodes of `program`'s graphs into aten.reshape; False (nothing
    changed) where a graph writes a tensor in place, as a view's aliasing matters there."""
    graphs = [m for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    nodes = [n for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    if any(is_op_overload(n.target) and op_schema(n.target).is_mutable for n in nodes):
        return False
    views = [n for n in nodes if n.target is torch.ops.aten.view.default]
    for node in views:
        node.target = torch.ops.aten.reshape.default
    for graph in graphs:
        graph.recompile()
    return bool(views)


def _export(flat: _Flat, tensors: list, dynamic: dict | None) -> torch.export.ExportedProgram:
    """torch.export of `flat` with its floating inputs requiring grad, as JAX may
    differentiate any of them: torch code that branches on requires_grad (embedding_bag,
    linear_cross_entropy's chunked op, which computes its gradients in the forward only
    then) is captured on the branch that differentiates. Where torch refuses grad for an
    input (batch norm's running statistics, an op without a derivative) or an in-place
    write into it (a module's buffers; an input, which Lowered then refuses by name),
    without."""
    differentiable = [
        t.detach().requires_grad_(t.is_floating_point() or t.is_complex()) for t in tensors
    ]
    try:
        return torch.export.export(flat, (differentiable,), dynamic_shapes=dynamic, strict=False)
    except (RuntimeError, NotImplementedError) as error:
        if not refuses_grad(error):
            raise
    return torch.export.export(flat, (tensors,), dynamic_shapes=dynamic, strict=False)


def _decompositions(table: OpTable) -> Any:
    """torch.export's core ATen decompositions and the op table's, in one table (one run:
    torch rebuilds its tables on each run, half the time of a capture), less the ops
    _routes.py keeps whole and with its own decompositions in place of torch's."""
    decompositions = torch.export.default_decompositions()
    decompositions.update(table.decompositions)
    for op in list(decompositions.keys()):
        if kept_whole(str(op)):
            decompositions.pop(op)
    decompositions.update(decomposed_as())
    return decompositions


def _raised_by_user(error: BaseException) -> bool:
    """Whether `error` was raised by code outside torch (the user's, a library's)."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return False
    return not _is_library_frame(frames[-1].filename)


def _is_library_frame(filename: str) -> bool:
    return any(part in filename for part in ("/torch/", "/torchjax/", "/jax/", "/sympy/"))


_DERIVATIVE_INSIDE = """\
lowering="xla": {name} takes a derivative inside itself ({calls}). torch.export records
the ops torch runs, not autograd's tape, so lowering="xla" cannot turn that derivative into
JAX ops. Either take it in JAX, outside the lowered function (forces from an energy:
`forces = -jax.grad(energy)(positions)` around the lowered energy, which also lowers the
derivative), or use lowering="callback" (the default), which runs torch.autograd.grad as
torch code."""


def _derivative_inside(name: str, calls: list[str]) -> str:
    return _DERIVATIVE_INSIDE.format(name=name, calls="; ".join(calls))


_NOT_DECOMPOSED = """\
lowering="xla": torch.export captured {name}, but torch failed to decompose its graph to core
ATen ops (replaying the graph it had captured: a torch.export bug, not in your code):
    {error}
Use lowering="callback" (the default) for this function."""


def _first_lines(error: BaseException, n: int = 8) -> str:
    lines = str(error).strip().splitlines() or [""]
    text = "\n    ".join(lines[:n]) + ("\n    ..." if len(lines) > n else "")
    return f"{type(error).__name__}: {text}"


def _not_captured(name: str, error: BaseException) -> str:
    frames = [
        f for f in traceback.extract_tb(error.__traceback__) if not _is_library_frame(f.filename)
    ]
    where = f", at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    return _NOT_CAPTURED.format(name=name, where=where, error=_first_lines(error))
