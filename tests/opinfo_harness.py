# Conformance harness: torch's own operator database (OpInfo `op_db`) driven through
# `torchjax.to_jax`, with torch itself as the oracle. For one op and one transform, `run`
# wraps the op's sample call in `to_jax`, applies the JAX transform, applies the matching
# torch transform to the op called directly (`torch.func`, `torch.autograd.grad`), and
# classifies the pair:
#
#   pass      both ran and agree within tolerance
#   mismatch  both ran, the numbers (or shapes, dtypes, output counts) differ
#   error     torch's oracle ran, torchjax raised
#   skip      the oracle itself failed, or the pair does not apply (random or uninitialized
#             outputs, in-place ops, non-tensor outputs, no floating input for a derivative,
#             an input too large for a second-order transform)
#
# References never come from torchjax: only the op called on torch tensors and torch's own
# transforms.
#
# A profile (PROFILES) fixes the dtype regime of a run: JAX's x64 mode, the samples' dtype
# and the default tolerances. "float64" (x64 on, float64 samples) checks the numbers as
# closely as torch can; "float32" (x64 off, float32 samples) is what most users run: 64-bit
# values reach JAX as 32-bit ones (int64 indices as int32 arrays), and a torch output of a
# 64-bit dtype is expected back as JAX's 32-bit counterpart. Select one with
# `with profile("float32"):` or `run(..., profile="float32")`. Not a test module (no `test_`
# prefix): tests/test_conformance.py and tools/conformance.py import it.
#
# `run(..., lowering="xla")` wraps the op with `to_jax(..., lowering="xla")` instead: the op
# is torch.export'ed and each ATen node becomes JAX ops, so the numbers are JAX's, compared
# within XLA_TOLERANCES (per dtype) rather than the callback path's few ulps. Its result also
# says which ATen ops were lowered and which ran as callbacks (and why), and one more class:
#
#   uncapturable  torch.export cannot capture the op (LoweringError: data-dependent control
#                 flow or output shapes), so lowering="xla" does not apply
#
# A mismatch names its culprits (the lowered ATen ops that, run as callbacks instead, make
# the sample pass); where the graph holds ops listed as callbacks (_xla/_routes.py),
# `unneeded` names those that agree with torch when lowered after all (stale entries).
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import itertools
import re
import signal
import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
import torch.utils._pytree as torch_pytree
from torch.testing._internal.common_device_type import toleranceOverride
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.opinfo.core import DecorateInfo, OpInfo
from torch.utils._python_dispatch import TorchDispatchMode

import torchjax
from torchjax.errors import LoweringError, ShapeInferenceError

TRANSFORMS = ("eager", "jit", "vmap", "vjp", "jvp", "hessian", "jacrev_jacrev", "vmap_grad")
PASS, MISMATCH, ERROR, SKIP = "pass", "mismatch", "error", "skip"

# Pairs whose torch reference is itself wrong: skipped, under both lowerings (the callback
# path gives torch's answer, right or wrong). Each is shown wrong by
# tests/test_conformance.py::test_the_wrong_torch_references_are_still_wrong, which fails
# once torch fixes it.
_CHUNKED_JVP = (
    "torch.func.jvp through torch's chunked linear_cross_entropy op differs from central "
    "differences and from its own reverse mode (torch 2.13)"
)
WRONG_REFERENCES: dict[tuple[str, str], str] = {
    ("nn.functional.linear_cross_entropy.chunked", "jvp"): _CHUNKED_JVP,
    ("nn.functional.linear_cross_entropy.chunked_none", "jvp"): _CHUNKED_JVP,
}
UNCAPTURABLE = "uncapturable"  # lowering="xla" only: torch.export cannot capture the op
LOWERINGS = ("callback", "xla")
# The transforms lowering="xla" runs under: each of JAX's own rules once (the lowered ops
# are JAX's, so the compositions test JAX, not torchjax), and its fallback nodes' rules.
XLA_TRANSFORMS = ("eager", "jit", "vmap", "vjp", "jvp")

# In order of preference: the first one the op supports on CPU is the samples' dtype.
SAMPLE_DTYPES = (torch.float64, torch.float32, torch.int64, torch.bool, torch.complex128)
# With x64 off: no float64 (it would reach JAX as float32 anyway). int64 stays: integer
# samples are int64 for torch's oracle, as torch's own samplers make them, and reach JAX as
# int32 arrays, what a user with x64 off has.
SAMPLE_DTYPES_FLOAT32 = (torch.float32, torch.int64, torch.bool, torch.complex64)
RTOL = 1e-6
ATOL = 1e-6
# float32 and complex64 samples, and every sample under the float32 profile. torchjax calls
# the same torch kernels as the oracle, so only the JAX-side glue (the weighted sums of the
# derivative transforms, vmap's batching) can round differently: a few float32 ulps.
RTOL_FLOAT32 = ATOL_FLOAT32 = 1e-5
_LOW_PRECISION = (torch.float32, torch.complex64)
# lowering="xla": (rtol, atol) by the samples' dtype, every profile. The lowered ops are
# JAX's implementations (XLA's transcendental approximations, other summation orders, JAX's
# own derivative rules), not torch's kernels: some ulps of the results' scale, more than the
# callback path's glue. Integer and bool samples take float32's (their floating results are
# torch's default dtype); integer and bool outputs compare exactly. An OpInfo's own
# toleranceOverride for the dtype loosens these further, as on the callback path.
XLA_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4),
    torch.complex64: (1e-4, 1e-4),
    torch.int64: (1e-4, 1e-4),
    torch.bool: (1e-4, 1e-4),
}
MAX_SAMPLES = 6  # applicable non-empty samples kept per op
EMPTY_SAMPLES = 2  # and samples with an empty tensor
SCANNED_SAMPLES = 64  # samples looked at per op
TINY = 4  # elements: samples whose differentiated (else vmapped) tensor is smaller go last
BATCH = 2  # size of the new leading axis for vmap and vmap_grad
SECOND_ORDER_MAX_INPUT = 200  # elements of the differentiated input, hessian / jacrev_jacrev
SECOND_ORDER_MAX_RESULT = 250_000  # elements of a jacrev_jacrev result

# torch dtypes that numpy lacks, and the ml_dtypes types JAX uses for them.
_ML_DTYPES = {
    torch.bfloat16: ml_dtypes.bfloat16,
    torch.float8_e4m3fn: ml_dtypes.float8_e4m3fn,
    torch.float8_e4m3fnuz: ml_dtypes.float8_e4m3fnuz,
    torch.float8_e5m2: ml_dtypes.float8_e5m2,
    torch.float8_e5m2fnuz: ml_dtypes.float8_e5m2fnuz,
}

# Outputs read from uninitialized memory: equal inputs need not give equal outputs.
_UNINITIALIZED = ("empty", "new_empty", "empty_like", "empty_strided", "empty_permuted")


@dataclasses.dataclass(frozen=True)
class Result:
    """One (op, transform) pair: `status` is one of PASS, MISMATCH, ERROR, SKIP."""

    op: str
    transform: str
    status: str
    message: str = ""
    max_abs_err: float | None = None
    seconds: float = 0.0
    profile: str = ""
    lowering: str = "callback"
    # lowering="xla" only, over the samples run: the ATen ops lowered to JAX ops, those run
    # as callbacks ("op: why"), the mismatch's culprits, and the listed callbacks in the
    # graph that agree with torch when lowered (`unneeded`) or do not (`needed`).
    lowered: tuple[str, ...] = ()
    callbacks: tuple[str, ...] = ()
    culprits: tuple[str, ...] = ()
    unneeded: tuple[str, ...] = ()
    needed: dict[str, float | None] = dataclasses.field(default_factory=dict)  # op: max error


def op_name(op: OpInfo) -> str:
    """The op's name with its variant, as torch's own test ids write it (`div.trunc_rounding`)."""
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


@functools.cache
def ops_by_name() -> dict[str, OpInfo]:
    return {op_name(op): op for op in op_db}


def all_ops() -> list[OpInfo]:
    return list(op_db)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A dtype regime for a run: JAX's x64 mode, the samples' dtype (the first of
    `sample_dtypes` the op supports on CPU) and the default tolerances."""

    name: str
    x64: bool
    sample_dtypes: tuple[torch.dtype, ...]
    rtol: float
    atol: float
    description: str


PROFILES = {
    "float64": Profile(
        "float64",
        x64=True,
        sample_dtypes=SAMPLE_DTYPES,
        rtol=RTOL,
        atol=ATOL,
        description="JAX x64 on; float64 samples (else float32, int64, bool, complex128, "
        "the first the op supports); rtol = atol = 1e-6 (1e-5 for float32 samples)",
    ),
    "float32": Profile(
        "float32",
        x64=False,
        sample_dtypes=SAMPLE_DTYPES_FLOAT32,
        rtol=RTOL_FLOAT32,
        atol=ATOL_FLOAT32,
        description="JAX x64 off; float32 samples (else int64, bool, complex64): int64 "
        "inputs reach JAX as int32, and a 64-bit torch output must come back as JAX's "
        "32-bit counterpart (int64 as int32, float64 as float32); rtol = atol = 1e-5",
    ),
}
_PROFILE: contextvars.ContextVar[Profile] = contextvars.ContextVar(
    "opinfo_profile", default=PROFILES["float64"]
)


def current_profile() -> Profile:
    """The profile `run` uses when not given one: the innermost `profile(...)`, else float64."""
    return _PROFILE.get()


def _get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; expected one of {tuple(PROFILES)}")
    return PROFILES[name]


@contextlib.contextmanager
def profile(name: str) -> Iterator[Profile]:
    """The named profile for the duration: `run`'s default, and its x64 mode set in JAX
    (the previous profile and x64 setting are restored afterwards)."""
    p = _get_profile(name)
    token = _PROFILE.set(p)
    try:
        with jax.enable_x64(p.x64):
            yield p
    finally:
        _PROFILE.reset(token)


@contextlib.contextmanager
def x64() -> Iterator[None]:
    """The float64 profile (float64 in JAX) for the duration; `profile("float64")`."""
    with profile("float64"):
        yield


# --------------------------------------------------------------------------- the sample


class _NotApplicable(Exception):
    """The pair is a skip; the message says why."""


class _Timeout(BaseException):
    # BaseException so that no `except Exception` between the alarm and us swallows it.
    pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    head = text[0] if text else ""
    if head.endswith("Traceback (most recent call last):"):
        # Raised inside a JAX host callback: the traceback's own exception line says why.
        inner = [line for line in text if re.match(r"[\w.]+(Error|Exception): ", line)]
        if inner:
            head = head.removesuffix("Traceback (most recent call last):") + inner[-1]
    return f"{type(e).__name__}: {head}"[:300]


def _tolerances(
    op: OpInfo, dtype: torch.dtype, prof: Profile, lowering: str = "callback"
) -> tuple[float, float]:
    """(rtol, atol): the profile's defaults (float32's for float32 and complex64 samples;
    XLA_TOLERANCES' for lowering="xla"), loosened by any toleranceOverride of the OpInfo for
    the samples' dtype."""
    rtol, atol = prof.rtol, prof.atol
    if dtype in _LOW_PRECISION:
        rtol, atol = max(rtol, RTOL_FLOAT32), max(atol, ATOL_FLOAT32)
    if lowering == "xla":
        rtol, atol = XLA_TOLERANCES.get(dtype, XLA_TOLERANCES[torch.float32])
    for info in op.decorators:
        decorators = info.decorators if isinstance(info, DecorateInfo) else [info]
        if isinstance(info, DecorateInfo) and info.device_type not in (None, "cpu"):
            continue
        for d in decorators:
            if isinstance(d, toleranceOverride) and dtype in d.d:
                rtol = max(rtol, d.d[dtype].rtol)
                atol = max(atol, d.d[dtype].atol)
    return rtol, atol


def _sample_dtype(op: OpInfo, prof: Profile) -> torch.dtype:
    supported = op.supported_dtypes("cpu")
    for dtype in prof.sample_dtypes:
        if dtype in supported:
            return dtype
    raise _NotApplicable(f"supports none of {', '.join(map(str, prof.sample_dtypes))}")


def _normalize(out: Any) -> Any:
    """The op's output as to_jax can return it: torch.return_types become plain tuples."""
    if isinstance(out, torch.Tensor):
        if out.layout != torch.strided or out.is_quantized or out.is_meta:
            raise _NotApplicable(f"output with layout {out.layout}")
        return out
    if out is None or isinstance(out, bool | int | float):
        return out
    if isinstance(out, tuple | list):  # torch.return_types.* are tuple subclasses
        return tuple(_normalize(o) for o in out)
    raise _NotApplicable(f"non-tensor output {type(out).__name__}")


def _leaves(out: Any) -> list[Any]:
    if isinstance(out, tuple):
        return [leaf for o in out for leaf in _leaves(o)]
    return [] if out is None else [out]


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().resolve_conj().resolve_neg().cpu()
        if x._is_zerotensor():  # torch.func's lazy zero (no storage): the zeros it stands for
            x = torch.zeros(x.shape, dtype=x.dtype)
        if x.dtype in _ML_DTYPES:  # no numpy dtype: reinterpret the bits as ml_dtypes' type
            bits = torch.int16 if x.dtype.itemsize == 2 else torch.uint8
            return x.contiguous().view(bits).numpy().view(_ML_DTYPES[x.dtype])
        return x.numpy()
    return np.asarray(x)


def _to_jax_array(t: torch.Tensor) -> jax.Array:
    return jnp.asarray(_to_numpy(t))


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.rand(t.shape, generator=gen, dtype=t.dtype) * 2 - 1


class _Case:
    """One sample of one op, as a function of the sample's tensors (everything else fixed)."""

    def __init__(
        self, op: OpInfo, sample: Any, dtype: torch.dtype, seed: int, prof: Profile
    ) -> None:
        self.op = op
        self.dtype = dtype
        self.profile = prof
        self.sample = sample
        leaves, self.spec = torch_pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.leaves = leaves
        self.tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        for i in self.tensor_pos:
            if leaves[i].layout != torch.strided:
                raise _NotApplicable(f"input with layout {leaves[i].layout}")
        self.tensors = [leaves[i].detach().clone() for i in self.tensor_pos]
        floating = [k for k, t in enumerate(self.tensors) if t.is_floating_point()]
        self.diff = floating[0] if floating else None  # differentiated tensor
        self.primary = self.diff if floating else (0 if self.tensors else None)  # vmapped tensor
        self.seed = seed

    def call(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The op on these tensors (in place of the sample's), output normalized."""
        leaves = list(self.leaves)
        for i, t in zip(self.tensor_pos, tensors, strict=True):
            leaves[i] = t
        inp, args, kwargs = torch_pytree.tree_unflatten(leaves, self.spec)
        out = self.op.op(inp, *args, **kwargs)
        out = self.sample.output_process_fn_grad(out)
        return _normalize(out)

    def size(self) -> int:
        """Elements of the differentiated (else the vmapped) tensor."""
        k = self.diff if self.diff is not None else self.primary
        return 0 if k is None else self.tensors[k].numel()

    def replaced(self, k: int, x: Any, tensors: Sequence[Any]) -> list[Any]:
        new = list(tensors)
        new[k] = x
        return new

    def batched(self, k: int, gen: torch.Generator) -> torch.Tensor:
        """Tensor k and a nearby value stacked on a new leading axis (same sign pattern)."""
        t = self.tensors[k]
        if t.dtype == torch.bool:
            other = ~t
        elif t.is_floating_point() or t.is_complex():
            other = t * (1 + 0.05 * _random_like(t.real if t.is_complex() else t, gen))
        else:
            other = t  # integers are often indices: a changed value may be out of range
        return torch.stack([t] + [other] * (BATCH - 1))


# --------------------------------------------------------------------------- comparison


def _compare(actual: Sequence[Any], expected: Sequence[Any], rtol: float, atol: float) -> Result:
    """A PASS or MISMATCH record (op and transform left empty).

    Each actual dtype must be the expected one as JAX canonicalizes it under the current x64
    mode (with x64 off, torch's int64 comes back as int32, float64 as float32, complex128 as
    complex64; with x64 on, exactly torch's dtype); the values are compared after casting
    the expected ones to it."""
    if len(actual) != len(expected):
        return Result("", "", MISMATCH, f"{len(actual)} outputs, torch gives {len(expected)}")
    worst = 0.0
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        a, e = np.asarray(a), _to_numpy(e)
        if a.shape != e.shape:
            return Result("", "", MISMATCH, f"output {i}: shape {a.shape}, torch gives {e.shape}")
        want = jax.dtypes.canonicalize_dtype(e.dtype)
        if a.dtype != want:
            also = "" if want == e.dtype else f" ({want} with x64 off)"
            message = f"output {i}: dtype {a.dtype}, torch gives {e.dtype}{also}"
            return Result("", "", MISMATCH, message)
        if e.dtype != a.dtype:
            e = e.astype(a.dtype)
        if a.size == 0:
            continue
        if a.dtype.kind == "V":  # bfloat16, float8: compare the values as float64
            a, e = a.astype(np.float64), e.astype(np.float64)
        if a.dtype.kind in "biu":
            bad = a != e
            err = float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64))))
        else:
            same_special = (np.isnan(a) & np.isnan(e)) | (np.isinf(a) & (a == e))
            with np.errstate(invalid="ignore", over="ignore"):
                diff = np.where(same_special, 0.0, np.abs(a - e))
                diff = np.where(np.isnan(diff), np.inf, diff)
                bad = diff > atol + rtol * np.where(np.isfinite(e), np.abs(e), 0)
            err = float(np.max(diff))
        worst = max(worst, err)
        if np.any(bad):
            n = int(np.sum(bad))
            return Result(
                "", "", MISMATCH, f"output {i}: {n}/{a.size} elements differ", max_abs_err=err
            )
    return Result("", "", PASS, max_abs_err=worst)


# --------------------------------------------------------------------------- the transforms


def _float_idx(expected_out: Any) -> list[int]:
    return [
        i
        for i, x in enumerate(_leaves(expected_out))
        if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]


def _run_pair(case: _Case, transform: str, wrap: Callable) -> tuple[Callable, Callable]:
    """(oracle, candidate): thunks returning flat lists of leaves to compare."""
    T = case.tensors
    A = [_to_jax_array(t) for t in T]
    gen = torch.Generator().manual_seed(case.seed)  # the same draws whatever ran before
    out0 = case.call(T)  # the op called directly: structure and which outputs are floating
    fj = wrap()

    if transform == "eager":
        return (lambda: _leaves(case.call(T))), (lambda: jax.tree.leaves(fj(*A)))
    if transform == "jit":
        return (lambda: _leaves(case.call(T))), (lambda: jax.tree.leaves(jax.jit(fj)(*A)))
    if transform == "vmap":
        if case.primary is None:
            raise _NotApplicable("no tensor input")
        p = case.primary
        xb = case.batched(p, gen)

        def oracle():
            return _leaves(torch.func.vmap(lambda x: case.call(case.replaced(p, x, T)))(xb))

        def candidate():
            f = lambda x: fj(*case.replaced(p, x, A))
            return jax.tree.leaves(jax.vmap(f)(_to_jax_array(xb)))

        return oracle, candidate

    # Derivative transforms: w.r.t. tensor `case.diff`, of the floating outputs only.
    if case.diff is None:
        raise _NotApplicable("no floating tensor input")
    d = case.diff
    fidx = _float_idx(out0)
    if not fidx:
        raise _NotApplicable("no floating tensor output")
    if any(x.is_complex() for x in _leaves(out0) if isinstance(x, torch.Tensor)):
        raise _NotApplicable("complex output")
    x0 = T[d]
    leaves0 = _leaves(out0)
    weights = [_random_like(leaves0[i], gen) for i in fidx]
    weights_j = [_to_jax_array(w) for w in weights]
    tangent = _random_like(x0, gen)

    def g_t(x):  # torch: the floating outputs as a function of the differentiated input
        leaves = _leaves(case.call(case.replaced(d, x, T)))
        return tuple(leaves[i] for i in fidx)

    def s_t(x):  # torch: random-weighted sum of the floating outputs
        return sum((w * o).sum() for w, o in zip(weights, g_t(x), strict=True))

    def g_j(x):
        leaves = jax.tree.leaves(fj(*case.replaced(d, x, A)))
        return tuple(leaves[i] for i in fidx)

    def s_j(x):
        return sum(jnp.sum(w * o) for w, o in zip(weights_j, g_j(x), strict=True))

    xj = _to_jax_array(x0)
    if transform == "vjp":

        def oracle():
            x = x0.clone().requires_grad_(True)
            with torch.enable_grad():
                outs = g_t(x)
                pairs = [(o, w) for o, w in zip(outs, weights, strict=True) if o.requires_grad]
                if not pairs:  # no output depends on x differentiably: the gradient is zero
                    return [torch.zeros_like(x0)]
                (g,) = torch.autograd.grad(
                    [o for o, _ in pairs], x, [w for _, w in pairs], allow_unused=True
                )
            return [torch.zeros_like(x0) if g is None else g]

        return oracle, lambda: [jax.grad(s_j)(xj)]
    if transform == "jvp":

        def oracle():
            out, tan = torch.func.jvp(g_t, (x0,), (tangent,))
            return list(out) + list(tan)

        def candidate():
            out, tan = jax.jvp(g_j, (xj,), (_to_jax_array(tangent),))
            return list(out) + list(tan)

        return oracle, candidate
    if transform in ("hessian", "jacrev_jacrev"):
        n = x0.numel()
        if n > SECOND_ORDER_MAX_INPUT:
            raise _NotApplicable(f"input of {n} elements is too large for {transform}")
        if transform == "hessian":
            return (
                lambda: [torch.func.hessian(s_t)(x0)],
                lambda: [jax.hessian(s_j)(xj)],
            )
        size = sum(leaves0[i].numel() for i in fidx) * n * n
        if size > SECOND_ORDER_MAX_RESULT:
            raise _NotApplicable(f"result of {size} elements is too large for {transform}")
        return (
            lambda: list(torch.func.jacrev(torch.func.jacrev(g_t))(x0)),
            lambda: jax.tree.leaves(jax.jacrev(jax.jacrev(g_j))(xj)),
        )
    if transform == "vmap_grad":
        # Every floating input batched and differentiated (a batching rule can be wrong for
        # one input only: select_scatter's was for `src`, its second); where torch.func
        # cannot differentiate them all, the first alone.
        floating = [k for k, t in enumerate(T) if t.is_floating_point()]
        batched = {k: case.batched(k, gen) for k in floating}
        # Kept on the case: a second pair (made to declare the output types) must use the
        # inputs the oracle used.
        chosen = case.__dict__.setdefault("vmap_grad_inputs", [floating])

        def s_all_t(*xs):
            new = list(T)
            for k, x in zip(chosen[0], xs, strict=True):
                new[k] = x
            leaves = _leaves(case.call(new))
            return sum((w * leaves[i]).sum() for w, i in zip(weights, fidx, strict=True))

        def s_all_j(*xs):
            new = list(A)
            for k, x in zip(chosen[0], xs, strict=True):
                new[k] = x
            leaves = jax.tree.leaves(fj(*new))
            return sum(jnp.sum(w * leaves[i]) for w, i in zip(weights_j, fidx, strict=True))

        def oracle():
            try:
                return _vmap_grad_t(s_all_t, [batched[k] for k in chosen[0]])
            except Exception:
                if len(chosen[0]) == 1:
                    raise
                chosen[0] = [d]
                return _vmap_grad_t(s_all_t, [batched[d]])

        def candidate():
            xs = [_to_jax_array(batched[k]) for k in chosen[0]]
            argnums = tuple(range(len(xs)))
            return list(jax.vmap(jax.grad(s_all_j, argnums=argnums))(*xs))

        return oracle, candidate
    raise ValueError(f"unknown transform {transform!r}; expected one of {TRANSFORMS}")


def _vmap_grad_t(fn: Callable, xs: list) -> list:
    argnums = tuple(range(len(xs)))
    return list(torch.func.vmap(torch.func.grad(fn, argnums=argnums))(*xs))


# --------------------------------------------------------------------------- the runner


@contextlib.contextmanager
def _time_limit(seconds: float | None) -> Iterator[None]:
    if not seconds:
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"over the time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _outputs_equal(a: Any, b: Any) -> bool:
    """Equal up to the last bits (multithreaded LAPACK need not be bitwise reproducible)."""
    la, lb = [_to_numpy(x) for x in _leaves(a)], [_to_numpy(x) for x in _leaves(b)]
    return len(la) == len(lb) and all(
        x.shape == y.shape
        and x.dtype == y.dtype
        and (
            np.allclose(
                x, y, rtol=max(1e-12, 64 * float(np.finfo(x.dtype).eps)), atol=0, equal_nan=True
            )
            if x.dtype.kind in "fc"
            else np.array_equal(x, y)
        )
        for x, y in zip(la, lb, strict=True)
    )


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a, b) or (
        a.is_floating_point()
        and torch.equal(a.isnan(), b.isnan())
        and torch.equal(a.nan_to_num(), b.nan_to_num())
    )


class _Observed(TorchDispatchMode):
    """Notes the first aten op tagged as drawing random numbers (OpInfo runs samplers under
    a fixed seed, so their outputs alone do not show that they are random), and the first
    that its schema says writes into one of `inputs` (even if it writes the same values)."""

    def __init__(self, inputs: Sequence[torch.Tensor]) -> None:
        super().__init__()
        self.random: str | None = None
        self.writes: str | None = None
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.random is None and torch.Tag.nondeterministic_seeded in func.tags:
            self.random = func.name()
        if self.writes is None:
            written = [
                a.name for a in func._schema.arguments if a.alias_info and a.alias_info.is_write
            ]
            values = dict(zip([a.name for a in func._schema.arguments], args, strict=False)) | (
                kwargs or {}
            )
            for name in written:
                t = values.get(name)
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.inputs:
                    self.writes = func.name()
        return func(*args, **(kwargs or {}))


_CASES: dict[tuple[str, str], tuple[list[_Case], str]] = {}  # by (profile, op)


def forget(name: str) -> None:
    """Drop the op's cached samples, in every profile (the full sweep keeps memory bounded
    this way)."""
    for key in [k for k in _CASES if k[1] == name]:
        del _CASES[key]


def _cases(name: str, prof: Profile) -> tuple[list[_Case], str]:
    key = (prof.name, name)
    if key not in _CASES:
        _CASES[key] = _find_cases(name, prof)
    return _CASES[key]


def _find_cases(name: str, prof: Profile) -> tuple[list[_Case], str]:
    """Up to MAX_SAMPLES applicable samples, or ([], why none applies).

    The first applicable ones among the op's first SCANNED_SAMPLES, in op_db's order except
    that tiny ones come after the others; then at most EMPTY_SAMPLES with an empty tensor:
    they test edge cases but say little about values, and torch.func's jacobians reject them.
    """
    op = ops_by_name()[name]
    if op.name.endswith("_") and not op.name.endswith("__"):  # not __radd__ and the like
        return [], "in-place op"
    if any(op.name == u or op.name.endswith("." + u) for u in _UNINITIALIZED):
        return [], "uninitialized output"
    try:
        dtype = _sample_dtype(op, prof)
        # small_inputs_only: what torch's own slow gradcheck asks for (20x20 becomes 5x5),
        # unless the sampler passes unknown options on to the op (signal.windows.*).
        first = next(iter(op.sample_inputs("cpu", dtype, small_inputs_only=True)), None)
        options = (
            {} if first and "small_inputs_only" in first.kwargs else {"small_inputs_only": True}
        )
        torch.manual_seed(0)
        samples = op.sample_inputs("cpu", dtype, requires_grad=False, **options)
        cases, empties, why = [], [], "no samples"
        for sample in itertools.islice(samples, SCANNED_SAMPLES):
            if len(cases) == MAX_SAMPLES:
                break
            empty = any(
                isinstance(x, torch.Tensor) and x.numel() == 0
                for x in torch_pytree.tree_leaves((sample.input, sample.args, sample.kwargs))
            )
            if empty and len(empties) == EMPTY_SAMPLES:
                continue
            try:
                case = _Case(op, sample, dtype, seed=zlib.crc32(name.encode()), prof=prof)
                versions = [t._version for t in case.tensors]
                before = [t.clone() for t in case.tensors]
                torch.manual_seed(0)
                with _Observed(case.tensors) as observed:
                    out_a = case.call(case.tensors)
                # By the version counters, and by value: batch_norm's kernels write the
                # running statistics without bumping their versions (torch's schema does
                # not mark them mutable), and torchjax's guard refuses that write.
                if (
                    observed.writes
                    or [t._version for t in case.tensors] != versions
                    or not all(
                        _same_values(a, b) for a, b in zip(before, case.tensors, strict=True)
                    )
                ):
                    why = "mutates its input"
                    continue
                if observed.random:
                    why = f"random op ({observed.random})"
                    continue
                torch.manual_seed(1)
                if not _outputs_equal(out_a, case.call(case.tensors)):
                    why = "nondeterministic output"
                    continue
                (empties if empty else cases).append(case)
            except _NotApplicable as e:
                why = str(e)
            except Exception as e:
                why = f"oracle: {_first_line(e)}"
        # Tiny samples after the others: a 1x1 matrix or a 0-d tensor can hide what a 5x5
        # one shows.
        cases.sort(key=lambda c: c.size() < TINY)
        return cases + empties, why
    except _NotApplicable as e:
        return [], str(e)
    except Exception as e:
        return [], f"sample_inputs: {_first_line(e)}"


def _run_case(case: _Case, transform: str, time_limit: float | None) -> Result:
    rtol, atol = _tolerances(case.op, case.dtype, case.profile)
    declared: list[Any] = []

    def wrap() -> Callable:
        fn = lambda *tensors: case.call(tensors)
        if not declared:
            return torchjax.to_jax(fn)
        return torchjax.to_jax(fn, result_shape_dtypes=declared[0])

    try:
        with _time_limit(time_limit):
            oracle, candidate = _run_pair(case, transform, wrap)
            expected = oracle()
    except _NotApplicable as e:
        return Result("", "", SKIP, str(e))
    except (Exception, _Timeout) as e:
        return Result("", "", SKIP, f"oracle: {_first_line(e)}")
    try:
        with _time_limit(time_limit):
            try:
                actual = candidate()
            except ShapeInferenceError:
                # Data-dependent output shapes: declare them, as the error tells users to.
                out0 = case.call(case.tensors)
                declared.append(
                    jax.tree.map(
                        lambda x: jax.ShapeDtypeStruct(np.shape(x), _to_numpy(x).dtype),
                        out0,
                        is_leaf=lambda x: isinstance(x, torch.Tensor),
                    )
                )
                oracle, candidate = _run_pair(case, transform, wrap)
                actual = candidate()
    except (Exception, _Timeout) as e:
        if "do not fit" in str(e) and _out_of_32_bits(expected):
            # x64 off: JAX has no type for these values, and torchjax says so (ConversionError
            # naming jax_enable_x64) instead of wrapping them around. Checked on torch's own.
            return Result("", "", SKIP, "output values that no 32-bit type holds (x64 off)")
        return Result("", "", ERROR, _first_line(e))
    return _compare(actual, expected, rtol, atol)


# ------------------------------------------------------------------ lowering="xla"

MAX_CULPRIT_TRIALS = 8  # lowered ATen ops tried one at a time as callbacks, per mismatch


def listed_callback_ops() -> frozenset[str]:
    """The ATen ops _xla/_routes.py runs as callbacks under lowering="xla" because their
    lowering disagrees with torch."""
    from torchjax._to_jax._xla._routes import listed_callbacks

    return listed_callbacks()


@contextlib.contextmanager
def _callback_ops(ops: frozenset[str]) -> Iterator[None]:
    """`ops` in place of the listed callbacks while a program is lowered (the route rules
    read _routes.POLICIES at each node they route, the first time each signature runs)."""
    from torchjax._to_jax._xla import _routes

    saved = _routes.POLICIES
    kept = {op: p for op, p in saved.items() if p.kind != _routes.CALLBACK}
    listed = {op: _routes.OpPolicy(op, _routes.CALLBACK, "listed by the sweep") for op in ops}
    _routes.POLICIES = {**kept, **listed}
    try:
        yield
    finally:
        _routes.POLICIES = saved


def _routes(fj: Callable) -> tuple[set[str], set[str]]:
    """(ATen ops lowered, "op: why" of those run as callbacks) in every program fj lowered:
    the routes lowering_report reads, without a second torch.export."""
    lowered, callbacks = set(), set()
    for program, _, _ in fj.lowered.programs.values():
        for route in program.routes.values():
            if route.lowered:
                lowered.add(route.op)
            else:
                callbacks.add(f"{route.op}: {route.why}")
    return lowered, callbacks


def _run_case_xla(case: _Case, transform: str, time_limit: float | None) -> Result:
    rtol, atol = _tolerances(case.op, case.dtype, case.profile, "xla")
    listed = listed_callback_ops()
    # One to_jax (one torch.export per signature) per sample and callback list, shared by
    # the transforms: they all call it at the sample's own shapes.
    fns = case.__dict__.setdefault("xla_fns", {})

    def fn(ops: frozenset[str]) -> Callable:
        if ops not in fns:
            fns[ops] = torchjax.to_jax(lambda *tensors: case.call(tensors), lowering="xla")
        return fns[ops]

    try:
        with _time_limit(time_limit):
            oracle, _ = _run_pair(case, transform, lambda: fn(listed))
            expected = oracle()
    except _NotApplicable as e:
        return Result("", "", SKIP, str(e), lowering="xla")
    except (Exception, _Timeout) as e:
        return Result("", "", SKIP, f"oracle: {_first_line(e)}", lowering="xla")

    def check(ops: frozenset[str]) -> Result:
        """The candidate with `ops` run as callbacks, compared with torch's."""
        fj = fn(ops)
        _, candidate = _run_pair(case, transform, lambda: fj)
        with _callback_ops(ops):
            return _compare(candidate(), expected, rtol, atol)

    try:
        with _time_limit(time_limit):
            result = check(listed)
    except (LoweringError, ShapeInferenceError) as e:
        # Not capturable as one graph of ATen ops: its control flow or an output's shape
        # depends on the values. lowering="xla" does not apply; the callback path does.
        return Result("", "", UNCAPTURABLE, _first_line(e), lowering="xla")
    except _NotApplicable as e:
        # Raised by the op's own call under torch.export: an output that is a number on
        # real tensors is a symbolic one there (`item`'s SymFloat), a value of the data.
        message = f"under torch.export: {e}"
        return Result("", "", UNCAPTURABLE, message, lowering="xla")
    except (Exception, _Timeout) as e:
        if "do not fit" in str(e) and _out_of_32_bits(expected):
            message = "output values that no 32-bit type holds (x64 off)"
            return Result("", "", SKIP, message, lowering="xla")
        result = Result("", "", ERROR, _first_line(e))
    lowered, callbacks = _routes(fn(listed))
    in_graph = sorted(op for op in listed if any(c.startswith(op + ":") for c in callbacks))
    culprits: list[str] = []
    unneeded: list[str] = []
    needed: dict[str, float | None] = {}
    try:
        with _time_limit(time_limit):
            if result.status == MISMATCH:  # which lowering is wrong: each op in turn a callback
                for op in sorted(lowered)[:MAX_CULPRIT_TRIALS]:
                    if _passes(check, listed | {op}):
                        culprits.append(op)
            elif result.status == PASS:  # is each listed op still needed here?
                for op in in_graph:
                    lowered_too = _checked(check, listed - {op})
                    if lowered_too.status == PASS:
                        unneeded.append(op)
                    else:
                        needed[op] = lowered_too.max_abs_err
    except _Timeout as e:
        # the worker restarts on _Timeout in the message (the state it interrupted)
        result = dataclasses.replace(result, message=f"{result.message}; {_first_line(e)}")
    return dataclasses.replace(
        result,
        lowering="xla",
        lowered=tuple(sorted(lowered)),
        callbacks=tuple(sorted(callbacks)),
        culprits=tuple(culprits),
        unneeded=tuple(unneeded),
        needed=needed,
    )


def _checked(check: Callable[[frozenset[str]], Result], ops: frozenset[str]) -> Result:
    try:
        return check(ops)
    except Exception as e:
        return Result("", "", ERROR, _first_line(e))


def _passes(check: Callable[[frozenset[str]], Result], ops: frozenset[str]) -> bool:
    return _checked(check, ops).status == PASS


def _out_of_32_bits(expected: Sequence[Any]) -> bool:
    """Whether torch's outputs hold 64-bit integers outside their 32-bit type's range."""
    for x in expected:
        if isinstance(x, torch.Tensor) and x.dtype in (torch.int64, torch.uint64) and x.numel():
            info = np.iinfo(np.int32 if x.dtype == torch.int64 else np.uint32)
            values = x.to(torch.float64) if x.dtype == torch.uint64 else x
            if values.min() < info.min or values.max() > info.max:
                return True
    return False


def run(
    name: str,
    transform: str,
    *,
    n_samples: int = 1,
    time_limit: float | None = None,
    profile: str | None = None,
    lowering: str = "callback",
) -> Result:
    """Classify one (op, transform) pair over the op's first `n_samples` samples.

    Args:
      name: the op's name with variant, as `op_name` gives it (`"linalg.det"`,
        `"div.trunc_rounding"`).
      transform: one of TRANSFORMS (of XLA_TRANSFORMS for lowering="xla").
      n_samples: how many samples must run (not skip) before the pair counts as passed.
        Samples are tried in the order `_find_cases` gives, so one that cannot apply
        (say, too large for a hessian) gives way to the next; the worst outcome counts
        (error, then mismatch, then uncapturable, then pass, then skip).
      time_limit: seconds for each of the oracle and torchjax, per sample (None: no limit).
      profile: a name in PROFILES; None: the current one (`with profile(...)`, else
        float64). The run sets the profile's x64 mode in JAX itself.
      lowering: "callback" (to_jax's default) or "xla" (`to_jax(..., lowering="xla")`,
        compared within XLA_TOLERANCES, its routes recorded).

    Returns:
      A Result, its `profile` field the profile's name and `lowering` the lowering's.

    Example:
      >>> run("sin", "hessian", profile="float32").status
      'pass'
      >>> run("sin", "vjp", lowering="xla").lowered  # JAX differentiates JAX's sin
      ('aten.sin.default',)
    """
    allowed = XLA_TRANSFORMS if lowering == "xla" else TRANSFORMS
    if lowering not in LOWERINGS:
        raise ValueError(f"unknown lowering {lowering!r}; expected one of {LOWERINGS}")
    if transform not in allowed:
        raise ValueError(f"unknown transform {transform!r}; expected one of {allowed}")
    prof = current_profile() if profile is None else _get_profile(profile)
    start = time.perf_counter()
    results = []
    with warnings.catch_warnings(), jax.enable_x64(prof.x64):
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
        cases, why = _cases(name, prof)
        if (name, transform) in WRONG_REFERENCES:
            wrong = WRONG_REFERENCES[name, transform]
            cases, why = [], f"torch's own {transform} is wrong: {wrong}"
        for case in cases:
            if lowering == "xla":
                results.append(_run_case_xla(case, transform, time_limit))
            else:
                results.append(_run_case(case, transform, time_limit))
            # (uncapturable: the op's graph depends on values, whatever the sample)
            if results[-1].status in (ERROR, MISMATCH, UNCAPTURABLE):
                break
            if sum(r.status == PASS for r in results) == n_samples:
                break
    result = Result("", "", SKIP, why)
    for status in (ERROR, MISMATCH, UNCAPTURABLE, PASS, SKIP):
        found = [r for r in results if r.status == status]
        if found:
            errs = [r.max_abs_err for r in found if r.max_abs_err is not None]
            result = dataclasses.replace(found[0], max_abs_err=max(errs) if errs else None)
            break
    needed: dict[str, float | None] = {}
    for r in results:
        for op, err in r.needed.items():
            errs = [e for e in (needed.get(op), err) if e is not None]
            needed[op] = max(errs) if errs else None
    seconds = time.perf_counter() - start
    return dataclasses.replace(
        result,
        op=name,
        transform=transform,
        seconds=seconds,
        profile=prof.name,
        lowering=lowering,
        lowered=tuple(sorted({op for r in results for op in r.lowered})),
        callbacks=tuple(sorted({c for r in results for c in r.callbacks})),
        culprits=tuple(sorted({op for r in results for op in r.culprits})),
        unneeded=tuple(sorted({op for r in results for op in r.unneeded} - needed.keys())),
        needed=needed,
    )
