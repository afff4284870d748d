# module_to_jax: a torch.nn.Module as a pure JAX function of a variables pytree.
#
# The module object only supplies the code (its forward) and the structure; its parameters
# and buffers travel as JAX arrays in `variables`. Every call runs in a private copy of the
# module holding that call's tensors (_copies.py), so calls on several threads or
# devices, and backwards that read the module again, each see their own, and the user's
# module never changes. One to_jax function per variant of a call (mutable or not, the
# modules' train/eval modes, with or without an rng key) keeps every per-call decision out
# of the call itself. Whether forward writes its buffers in place (BatchNorm's running
# statistics in training mode) is learnt from the first run of each mode, fake or real:
# until then, and whenever it does, calls hand it copies, so the caller's arrays are never
# written. Over 500 lines, most of them module_to_jax's and apply's docstrings and
# messages (the public API's reference); the copies, placeholders, the move and the
# lowering="xla" path live in their own modules.
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

import jax
import numpy as np
import torch

from torchjax._compat._jax import traceback_boundary, uncommitted
from torchjax._compat._messages import is_write_refusal
from torchjax._compat._torch import (
    compiled_original,
    detect_fake_mode,
    generator_states,
    is_fake,
    is_functorch_wrapped,
    restore_generators,
    tensor_version,
)
from torchjax._convert import tensors_to_jax
from torchjax._errors import ArgumentError, VariablesError
from torchjax._log import logger
from torchjax._module_to_jax._copies import ModuleState
from torchjax._module_to_jax._move import move_out
from torchjax._module_to_jax._variables import ModuleVariables
from torchjax._module_to_jax._xla_module import ModuleLowering
from torchjax._primitive._params import ARRAY
from torchjax._to_jax._call._guard import same_bytes
from torchjax._to_jax._context import SEEDED
from torchjax._to_jax._hooks import CallHooks
from torchjax._to_jax._options import (
    GradMethod,
    Lowering,
    Options,
    VmapMethod,
    VmapRandomness,
    check_lowering,
)
from torchjax._to_jax._to_jax import wrap
from torchjax._to_jax._xla._function import check_declared

__all__ = ["module_to_jax"]

_tree = jax.tree_util

# As torch.func.functional_call: a TorchScript module at the top is refused ("can't be used
# with Jitted modules"), one below it gets each call's tensors set in TorchScript's tables
# (e3nn's compiled tensor products are such submodules).
_SCRIPTED = """\
module_to_jax({name}): it is a TorchScript module (torch.jit.script or torch.jit.trace).
Like torch.func.functional_call, module_to_jax gives a call's arrays to TorchScript
submodules, not to a TorchScript module at the top. Pass the module before scripting it,
hold the scripted one in a plain nn.Module (as a submodule: self.net = scripted), or wrap it
as a function, with its parameters closed over:

    f = torchjax.to_jax(lambda x: scripted(x))"""

_NOT_VARIABLES = (
    "variables must be the mapping {{'params': ..., 'buffers': ...}} returned by "
    "module_to_jax({name}), got {got}. Call apply(variables, *inputs), not "
    "apply(variables['params'], *inputs)."
)


def _is_fake(t: torch.Tensor) -> bool:
    # A plain tensor outside torch.func transforms is real: skip is_fake's slower checks.
    if type(t) is torch.Tensor and not is_functorch_wrapped(t):
        return False
    return is_fake(t)


def _is_fake_call(params: Any, buffers: Any, args: tuple, kwargs: dict) -> bool:
    """Whether forward runs on fake tensors (to_jax's shape inference), not real data."""
    try:  # the common case: the first parameter tells
        for group in (params, buffers):
            for t in group.values():
                return _is_fake(t)
    except AttributeError:  # not mappings: the variables check will say so
        pass
    for leaf in _tree.tree_leaves((params, buffers, args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            return _is_fake(leaf)
    return detect_fake_mode() is not None


class _Apply:
    """What every variant of a call shares: the module, its state and the options."""

    def __init__(self, module: torch.nn.Module, options: dict, result_shape_dtypes: Any):
        original = compiled_original(module)
        # A compiled module's copies run compiled; fake runs use the original, which also
        # names the variables (without the `_orig_mod.` prefix).
        compiled = module if original is not None else None
        self.lowering = options.get("lowering", "callback")
        # (lowering="xla" runs no copy of the module: the variables contract is all it needs)
        state = ModuleVariables if self.lowering == "xla" else ModuleState
        self.state = state(original if original is not None else module, compiled)
        self.name = type(self.state.module).__name__
        self.options = {k: v for k, v in options.items() if k != "lowering"}
        self.result_shape_dtypes = result_shape_dtypes
        self.lowered: ModuleLowering | None = None
        self.variants: dict[tuple, Callable] = {}
        # Whether forward writes a buffer in place, per mode of the submodules, as the
        # first run (fake or real) in that mode saw it; unknown modes hand it copies.
        self.writes: dict[tuple, bool] = {}

    def copies_buffers(self, training: tuple) -> bool:
        return bool(self.state.buffers) and self.writes.get(training) is not False

    def copies_after(self, error: Exception, training: tuple, copied: bool, originals: list):
        """Copies of the buffers in `originals` (the slots' tensors) for a run again, where
        `error` is a protected buffer refusing a write the first run in this mode did not
        make (one that depends on values or arguments: a running max); from then on this
        mode runs on copies. Otherwise `error` is raised: a parameter's refusal, say, which
        the call plan reports."""
        if copied or not self.state.buffers or not is_write_refusal(error):
            raise error
        self.writes[training] = True
        return _copy_buffers(originals, self.state.n_params)

    def note_writes(
        self, training: tuple, names: list, written: list, mutable: bool, warn: bool = True
    ) -> None:
        """Record what a run wrote; without mutable=True the writes are dropped: say so
        where `warn`."""
        self.writes[training] = self.writes.get(training, False) or any(written)
        if not mutable and warn:
            dropped = [name for name, w in zip(names, written, strict=True) if w]
            if dropped:
                self.state.warn_dropped(dropped, "wrote in place into")

    def variant(self, mutable: bool, training: tuple, seeded: bool) -> Callable:
        key = (mutable, training, seeded)
        fn = self.variants.get(key)
        if fn is None:
            fn = self.variants[key] = self._make(mutable, training, seeded)
        return fn

    def _make(self, mutable: bool, training: tuple, seeded: bool) -> Callable:
        state, name = self.state, self.name

        def run(args, kwargs, values, seed):
            if seed is None:  # torch's global generator, advancing as in plain PyTorch
                return state.call(args, kwargs, values, mutable)
            # A generator state derived from the JAX key, leaving the global one alone.
            with SEEDED, torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(seed.item()))
                return state.call(args, kwargs, values, mutable)

        def forward(params, buffers, args, kwargs, seed=None):
            if _is_fake_call(params, buffers, args, kwargs):
                return self._fake_forward(params, buffers, args, kwargs, mutable)
            values = originals = state.slot_values(params, buffers)
            mode = state.training()
            copied = self.copies_buffers(mode)
            if copied:
                values = _copy_buffers(values, state.n_params)
            # A write into a buffer that this mode has not made before runs forward again
            # on copies: with the first run's draws, as torch drew once (a seed replays).
            first = state.buffers and not copied and seed is None
            states = generator_states(values) if first else None
            try:
                out = run(args, kwargs, values, seed)
            except RuntimeError as e:
                values, copied = self.copies_after(e, mode, copied, originals), True
                restore_generators(states)
                out = run(args, kwargs, values, seed)
            if copied:
                self._learn_writes(mode, originals, values, mutable)
            return out

        def flat_form(in_tree: Any, template: list) -> Callable | None:
            return _flat_forward(self, in_tree, template, mutable)

        forward.__name__ = forward.__qualname__ = f"{name}.forward"
        hooks = CallHooks(
            for_module=True,
            describe_path=_describe_path,  # messages name variables[...], args[i]
            parameter_paths=_PARAMS,
            buffer_paths=_BUFFERS,
            flat_form=flat_form,  # see CallPlan: real calls skip rebuilding the tree
            # Eager calls run for real at once: variables are checked on each signature's
            # first call.
            check_signature=lambda p, b, *_, **__: state.check(name, p, b),
            isolates_state=True,  # fake runs use a throwaway copy (see fake_eval)
            seeded=seeded,  # its draws are a function of its inputs (UserFunction.facts)
        )
        options = dict(self.options)
        if seeded:  # a seed read with .item() cannot be batched: one call per example
            options["vmap_method"] = "sequential"
        declared = None
        if self.result_shape_dtypes is not None:
            declared = self._declared(mutable)
        checked = Options.checked(**options)
        return wrap(forward, declared, checked, hooks)

    def _fake_forward(self, params, buffers, args, kwargs, mutable: bool) -> Any:
        """forward on fake tensors (to_jax's shape inference), in a throwaway copy."""
        state = self.state
        state.check(self.name, params, buffers)
        values = _copy_buffers(state.slot_values(params, buffers), state.n_params)  # free
        out = state.fake_call(args, kwargs, values, mutable)
        # (no warning: without data a write that moves no version counter is not seen, so
        # the real run, which sees every write, names the dropped buffers, in one warning)
        self._learn_writes(state.training(), None, values, mutable)
        return out

    def _learn_writes(self, mode: tuple, originals: list | None, copies: list, mutable: bool):
        """After a run on copies of the buffers: which of them forward wrote in place, by
        version counter or, where there is data (`originals`), by value: batch norm's CPU
        kernel writes its running statistics without moving their counters. A run without
        data (`originals` None, a fake run) learns but does not warn."""
        state = self.state
        names = [name for name, _ in state.buffer_reads]
        if self.writes.get(mode) is not None and (mutable or state.warned.issuperset(names)):
            return  # nothing left to learn or to say
        written = [
            tensor_version(copies[j]) != 0
            or (originals is not None and not same_bytes(originals[j], copies[j]))
            for _, j in state.buffer_reads
        ]
        self.note_writes(mode, names, written, mutable, warn=originals is not None)

    def lowered_call(self, params, buffers, args, kwargs, mutable: bool, rng: Any) -> Any:
        """apply's call with lowering="xla" (ModuleLowering)."""
        if self.lowered is None:
            self.lowered = ModuleLowering(
                self.state, Options.checked(**self.options), _describe_path
            )
        out = self.lowered(params, buffers, args, kwargs, mutable, rng)
        if self.result_shape_dtypes is not None:
            check_declared(
                self.name, self.result_shape_dtypes, args, kwargs, out[0] if mutable else out
            )
        return out

    def _declared(self, mutable: bool) -> Callable:
        """result_shape_dtypes for forward's signature, from the user's for the module's."""
        spec = self.result_shape_dtypes

        def declared(params, buffers, args, kwargs, seed=None):
            del seed
            self.state.check(self.name, params, buffers)
            out = spec(*args, **kwargs) if callable(spec) else spec
            if mutable:
                types = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in buffers.items()}
                out = (out, types)
            return out

        return declared


def _copy_buffers(values: list, n_params: int) -> list:
    """`values` with each buffer (after the first n_params slots) replaced by a fresh copy,
    one per distinct tensor (a buffer tied between submodules stays one), of version 0."""
    copies: dict[int, torch.Tensor] = {}
    values = list(values)
    if len(values) > n_params:
        logger.debug(
            "copies of %d buffers for a call that may write them in place (first run in "
            "this mode, or it wrote before)",
            len(values) - n_params,
        )
    for j in range(n_params, len(values)):
        t = values[j]
        if id(t) not in copies:
            copies[id(t)] = t.clone()
        values[j] = copies[id(t)]
    return values


def _flat_forward(impl: _Apply, in_tree: Any, template: list, mutable: bool) -> Callable | None:
    """forward's real call for one call structure, as a function of the call's tensors in
    flattening order (`template`: ARRAY where a tensor goes, else the static leaf).

    Each variable's tensor goes straight into its slots, and the module's arguments are
    rebuilt only where they are more than a tuple of arrays: a tiny module's call spends
    as long rebuilding the variables tree as torch spends computing. None where a call has
    no such form (a seed; a variable that is not an array): forward itself runs then.
    """
    state = impl.state
    call_args, call_kwargs = _tree.tree_unflatten(in_tree, range(in_tree.num_leaves))
    if len(call_args) != 4 or call_kwargs:
        return None
    params, buffers, args, kwargs = call_args
    tensor_at = {}  # leaf index -> index among the call's tensors
    for i, leaf in enumerate(template):
        if leaf is ARRAY:
            tensor_at[i] = len(tensor_at)
    try:
        n_params = state.n_params
        names = [(params, n) for n in state.slot_names[:n_params]]
        names += [(buffers, n) for n in state.slot_names[n_params:]]
        slot_tensors = [tensor_at[group[n]] for group, n in names]
    except (KeyError, TypeError):  # a mapping that does not give its leaves by name
        return None
    has_buffers = len(slot_tensors) > n_params
    rest = _tree.tree_leaves((args, kwargs))
    flat_args = _tree.tree_structure(args) == _tree.tree_structure((0,) * len(args))
    if flat_args and not kwargs and all(template[i] is ARRAY for i in rest):
        first = tensor_at[rest[0]] if rest else len(tensor_at)
        rebuild = lambda tensors: (tensors[first:], {})  # noqa: E731 - (x, y, ...), no kwargs
    else:
        rest_tree = _tree.tree_structure((args, kwargs))
        filled = [
            (tensor_at[i], None) if template[i] is ARRAY else (None, template[i]) for i in rest
        ]
        rebuild = lambda tensors: _tree.tree_unflatten(  # noqa: E731
            rest_tree, [tensors[k] if k is not None else v for k, v in filled]
        )

    def call(*tensors: torch.Tensor) -> Any:
        values = [tensors[k] for k in slot_tensors]
        mode = state.training() if has_buffers else None
        copied = has_buffers and impl.copies_buffers(mode)
        if copied:
            values = _copy_buffers(values, n_params)
        a, kw = rebuild(tensors)
        states = generator_states(values) if has_buffers and not copied else None  # as forward
        try:
            out = state.call(a, kw, values, mutable)
        except RuntimeError as e:
            originals = [tensors[k] for k in slot_tensors]
            values, copied = impl.copies_after(e, mode, copied, originals), True
            restore_generators(states)
            out = state.call(a, kw, values, mutable)
        if copied:
            impl._learn_writes(mode, [tensors[k] for k in slot_tensors], values, mutable)
        return out

    return call


_PARAMS, _BUFFERS = "variables['params']", "variables['buffers']"


def _describe_path(path: tuple) -> str:
    """A path into forward's (params, buffers, args, kwargs) as the user wrote apply's call."""
    group = getattr(path[1], "idx", None) if len(path) > 1 else None
    rest = _tree.keystr(tuple(path[2:]))
    names = {0: _PARAMS, 1: _BUFFERS, 2: "args", 3: "kwargs"}
    return names.get(group, "args") + rest


def _describe(variables: Any) -> str:
    if isinstance(variables, Mapping):
        return f"a {type(variables).__name__} with keys {sorted(map(str, variables))}"
    return f"a {type(variables).__name__}"


def _to_jax_copy(tensors: dict[str, torch.Tensor], copy: bool, group: str) -> dict:
    if copy:  # a private contiguous copy, handed to JAX without another one
        tensors = {
            k: v.detach().clone(memory_format=torch.contiguous_format) for k, v in tensors.items()
        }
    return tensors_to_jax(tensors, f"variables[{group!r}]")


def module_to_jax(
    module: torch.nn.Module,
    *,
    vmap_method: VmapMethod = "torch.func",
    vmap_randomness: VmapRandomness = "error",
    grad_method: GradMethod = "torch.func",
    result_shape_dtypes: Any = None,
    copy: bool | Literal["move"] = True,
    lowering: Lowering = "callback",
) -> tuple[Callable, dict]:
    """Turn a ``torch.nn.Module`` into a pure JAX function and its variables pytree.

    Args:
      module: the module, or a ``torch.compile``'d one (real calls then run the compiled
        code; the variables keep the original module's names). Its forward is the code;
        its mode (``train()``/``eval()``) when torch runs is respected. It is never run
        and never changed: each call runs in a private copy of it made now (later changes
        to the module's Python attributes or hooks are not seen), holding that call's
        arrays from its forward through its backward, on any thread or device.
      vmap_method: how ``jax.vmap`` batches a call, as in ``to_jax``: ``"torch.func"`` (one
        ``torch.func.vmap`` call), ``"sequential"``, ``"expand_dims"`` or
        ``"broadcast_all"``. Calls with ``rng`` always run one call per example.
      vmap_randomness: ``torch.func.vmap``'s ``randomness``, as in ``to_jax``:
        ``"error"`` (default, as in torch.func) refuses random ops under ``jax.vmap``, whose
        draws would differ from a loop over the examples; ``"different"`` lets dropout
        draw independently per example, ``"same"`` shares one draw.
      grad_method: ``"torch.func"`` (default) or ``"autograd"``, as in ``to_jax``.
      result_shape_dtypes: the forward's output types, as in ``to_jax``: a pytree of
        ``jax.ShapeDtypeStruct``, or a callable taking forward's inputs (not the
        variables) as ShapeDtypeStructs. Without it they are found on fake tensors.
      copy: ``True`` (default): ``variables`` are copies, made once now, so training the
        torch module later never changes them. ``"move"``: the module's tensors become
        ``variables`` without a copy, and the module is left holding tensors without data
        (computing with them raises a VariablesError), so one set of weights exists, and
        torch has nothing left to write through. A tensor also held outside the module (an
        optimizer made before, a view) is copied instead, with a ``CopyWarning``.
        ``torchjax.tree_to_torch(variables)`` and ``load_state_dict(..., assign=True)``
        put weights back into the module. ``False``: variables share memory with the
        module's tensors, which keep them; only safe if torch never writes the module's
        parameters or buffers afterwards (an optimizer step, ``load_state_dict``, a
        training-mode forward in torch), since that would change the JAX arrays.
      lowering: ``"callback"`` (default) runs forward as torch code; ``"xla"`` turns its
        ATen ops into JAX ops, per input signature and mode, as in ``to_jax`` (the
        ``torchjax[xla]`` extra): buffer writes come back with ``mutable=True``, and with
        ``rng`` random ops (dropout) draw from JAX's generator, keyed by it; without
        ``rng`` they run as torch callbacks on torch's generator.

    Returns:
      ``(apply, variables)``. ``variables = {"params": {name: array}, "buffers": {name:
      array}}`` with names as in ``named_parameters()``/``named_buffers()`` (tied weights
      appear once). ``apply(variables, *args, mutable=False, rng=None, **kwargs)`` returns
      the module's output; ``variables`` may be any mapping with those two groups (a flax
      ``nnx.State`` too). With ``mutable=True`` it returns ``(output, new_buffers)`` (e.g.
      BatchNorm running statistics after a training-mode step). ``rng``, a JAX PRNG key,
      seeds torch's generator for the call (dropout): the same key gives the same masks.
      Without it, torch's global generator is used, as in plain PyTorch. apply works under
      jit, vmap and grad (w.r.t. params and inputs), and pickles with plain pickle (its
      module as it is then; unpickling runs module_to_jax on it again).

    Raises:
      ArgumentError: `module` is not an ``nn.Module``, is a TorchScript module (one among
        its submodules is fine), or an option is not one of its choices.
      VariablesError: (from apply) ``variables`` lacks a group, or a name or shape differs
        from the module's.

    Examples:
      >>> import jax, jax.numpy as jnp, torch, torchjax
      >>> apply, variables = torchjax.module_to_jax(torch.nn.Linear(3, 2))
      >>> loss = lambda v, x: jnp.sum(apply(v, x) ** 2)  # [B, 3] -> []
      >>> grads = jax.grad(loss)(variables, jnp.ones((4, 3)))
      >>> grads["params"]["weight"].shape
      (2, 3)
    """
    if not isinstance(module, torch.nn.Module):
        raise ArgumentError(
            f"module_to_jax expects a torch.nn.Module, got {type(module).__name__}. For a plain "
            f"function of tensors use torchjax.to_jax."
        )
    if isinstance(module, torch.jit.ScriptModule):
        raise ArgumentError(_SCRIPTED.format(name=module.original_name))
    _refuse_lazy(module)
    options = {
        "vmap_method": vmap_method,
        "vmap_randomness": vmap_randomness,
        "grad_method": grad_method,
    }
    Options.checked(**options)  # validates the choices now, with to_jax's messages
    options["lowering"] = check_lowering(lowering)
    if not (isinstance(copy, bool) or (isinstance(copy, str) and copy == "move")):
        raise ArgumentError(
            f"module_to_jax: copy={copy!r} is not one of its choices: True (variables are "
            f"copies), 'move' (the module's tensors become variables, the module keeps tensors "
            f"without data) or False (variables share the module's memory)."
        )
    impl = _Apply(module, options, result_shape_dtypes)
    state = impl.state
    if isinstance(copy, str):
        variables = move_out(state.module, {"params": state.params, "buffers": state.buffers})
    else:
        variables = {
            "params": _to_jax_copy(state.params, bool(copy), "params"),
            "buffers": _to_jax_copy(state.buffers, bool(copy), "buffers"),
        }

    apply = ModuleFunction(impl)
    return apply, jax.tree.map(_as_made_by_jax, variables)


def _as_made_by_jax(a: jax.Array) -> jax.Array:
    """`a` uncommitted where it is on JAX's default device, as an array `jnp.asarray` makes
    is: DLPack commits what it imports, and a jitted step called with the committed
    variables and then with its own uncommitted outputs (optax's state is uncommitted)
    would compile twice. A module on another device keeps its variables committed there."""
    if a.committed and a.sharding.device_set == {jax.devices()[0]}:
        return uncommitted(a)
    return a


class ModuleFunction:
    """module_to_jax's ``apply``: the module as a pure function of its variables.

    A class rather than a closure so that it pickles by value with plain pickle (for
    multiprocessing, or a job sent to another machine): it pickles its module, as it is
    then, and unpickling runs module_to_jax on that again.
    """

    def __init__(self, impl: _Apply):
        self._impl = impl
        self.__name__ = self.__qualname__ = f"apply_{impl.name}"
        self.__doc__ = f"{impl.name} as a pure function: apply(variables, *args, **kwargs)."

    @traceback_boundary  # an error's traceback starts at the user's call
    def __call__(
        self, variables: Any, *args: Any, mutable: bool = False, rng: Any = None, **kwargs: Any
    ) -> Any:
        impl = self._impl
        try:
            params, buffers = variables["params"], variables["buffers"]
            valid = isinstance(variables, Mapping) and len(variables) == 2
        except (TypeError, KeyError, IndexError):
            valid = False
        if not valid:
            raise VariablesError(_NOT_VARIABLES.format(name=impl.name, got=_describe(variables)))
        if impl.lowering == "xla":
            return impl.lowered_call(params, buffers, args, kwargs, bool(mutable), rng)
        fn = impl.variant(bool(mutable), impl.state.training(), rng is not None)
        if rng is None:
            return fn(params, buffers, args, kwargs)
        try:
            seed = jax.random.randint(rng, (), 0, np.iinfo(np.int32).max, dtype=np.int32)
        except (TypeError, ValueError) as error:  # not one key: JAX's message names no argument
            got = _describe_rng(rng)
            raise ArgumentError(_BAD_RNG.format(name=impl.name, got=got, jax=error)) from error
        return fn(params, buffers, args, kwargs, seed)

    def __repr__(self) -> str:
        return f"<module_to_jax apply of {self._impl.name}>"

    def __reduce__(self) -> tuple:
        impl = self._impl
        compiled = impl.state.compiled  # (not `or`: a compiled module's len() may raise)
        module = impl.state.module if compiled is None else compiled
        options = {**impl.options, "lowering": impl.lowering}
        return _rebuilt, (module, options, impl.result_shape_dtypes)


_BAD_RNG = """\
apply_{name}(variables, ..., rng=...): rng must be one JAX PRNG key, got {got} ({jax}).
The key seeds torch's random draws (dropout) for this call; make one with
jax.random.key(seed) and vary it per step, e.g. rng=jax.random.fold_in(key, step); for
one key per example, jax.vmap the call over a batch of keys."""


def _describe_rng(rng: Any) -> str:
    """`3 (int)` / `a float32[3] array`, for the message above."""
    if hasattr(rng, "dtype") and hasattr(rng, "shape"):
        return f"a {rng.dtype}{list(rng.shape)} array"
    return f"{rng!r}"[:80] + f" ({type(rng).__name__})"


def _refuse_lazy(module: torch.nn.Module) -> None:
    """ArgumentError for a parameter or buffer a lazy module has not initialized. (A function
    of its own: a loop variable left holding a tensor would make copy="move" copy it.)"""
    for kind, named in (("parameter", module.named_parameters), ("buffer", module.named_buffers)):
        for path, t in named():
            if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
                raise ArgumentError(_LAZY.format(name=type(module).__name__, kind=kind, path=path))


_LAZY = """\
module_to_jax({name}): its {kind} {path!r} is not initialized yet: it belongs to a lazy
module (LazyLinear, LazyConv2d, ...), which finds its shapes on its first call. Call the
module once in torch on an example input first, then convert it:
    module(example_input)
    apply, variables = torchjax.module_to_jax(module)"""


def _rebuilt(module: torch.nn.Module, options: dict, result_shape_dtypes: Any) -> ModuleFunction:
    """An unpickled apply: module_to_jax's again, on the unpickled module."""
    return ModuleFunction(_Apply(module, options, result_shape_dtypes))
