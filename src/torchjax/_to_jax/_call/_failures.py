# A failed call of a plan: notes on the user's own exception where torchjax knows more of
# the cause (int32 indices, an argument's dtype, Python numbers where torch takes tensors, a
# GPU out of memory), and the warning of a function that now runs on copies of its inputs.
from __future__ import annotations

from typing import Any

import jax
import torch

from torchjax import _x64
from torchjax._compat._messages import expects_tensor, mismatched_dtypes, wants_int64
from torchjax._primitive._params import ARRAY, leaf_paths
from torchjax._to_jax._call._cuda import gpu_oom_note


def explain(plan: Any, error: Exception, tensors: list) -> None:
    """Notes on the user's own exception, where torchjax knows more of the cause."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        note = gpu_oom_note(jax.devices())
        if note is not None:
            error.add_note(note)
    if wants_int64(error) and not jax.config.jax_enable_x64 and not _x64.WIDEN_INT32:
        if any(t.dtype == torch.int32 for t in tensors):
            error.add_note(INT32_NOTE)
    if plan.fn is plan.fn.root and tensors:
        note = _dtype_note(plan, error, tensors)
        if note is not None:
            error.add_note(note)
    if expects_tensor(error) and plan.fn is plan.fn.root and plan.has_statics:
        paths = leaf_paths(plan.in_tree)
        numbers = [
            plan.fn.arg_path(paths[i])
            for i, leaf in enumerate(plan.template)
            if leaf is not ARRAY and isinstance(leaf, bool | int | float | complex)
        ]
        if numbers:
            error.add_note(NUMBER_NOTE.format(paths=", ".join(numbers[:6])))


def _dtype_note(plan: Any, error: Exception, tensors: list) -> str | None:
    """DTYPE_NOTE where torch's message names a dtype an argument reached torch with
    and another that no argument had (what the torch code wanted), else None."""
    named = mismatched_dtypes(error)
    if len(tensors) != len(plan.positions) or not named:
        return None
    widened = (
        _x64.WIDEN_INT32 and not jax.config.jax_enable_x64 and not plan.fn.facts.get("keeps_int32")
    )
    reached = []
    for t in tensors:
        widen = widened and t.dtype is torch.int32
        reached.append(("int64" if widen else str(t.dtype).removeprefix("torch."), widen))
    wanted = [d for d in named if d not in {r for r, _ in reached}]
    got = [(k, r, w) for k, (r, w) in enumerate(reached) if r in named]
    if not wanted or not got:
        return None
    parts = []
    for k, dtype, widen in got[:4]:
        how = " (from JAX's int32: with x64 off, integer inputs reach torch as int64)"
        parts.append(f"{plan.input_path(k)} as {dtype}{how if widen else ''}")
    first = plan.input_path(got[0][0])
    return DTYPE_NOTE.format(
        got="; ".join(parts), wanted=" or ".join(wanted), first=first, dtype=wanted[0]
    )


INT32_NOTE = (
    "(torchjax: JAX's x64 mode is off, so JAX's integer arrays are int32, and this torch "
    "op wants int64 indices. TORCHJAX_WIDEN_INT32=0 is set, which hands torch the int32 "
    "arrays as they are: unset it (int32 inputs then reach torch as int64), cast them "
    "inside the function, `index.long()`, or turn x64 on: "
    "jax.config.update('jax_enable_x64', True).)"
)
DTYPE_NOTE = (
    "(torchjax: torch got {got}, where the torch code wanted {wanted}. Pass arrays of the "
    "dtype it wants: convert before the call, e.g. `{first}.astype(jnp.{dtype})`.)"
)
NUMBER_NOTE = (
    "(torchjax: {paths} reached the function as Python numbers, as they were passed: to_jax "
    "hands torch JAX arrays as tensors and every other leaf as it is (a list or dict of "
    "numbers stays one). Pass a JAX array where the function takes a tensor, e.g. "
    "jnp.asarray(values).)"
)


ON_COPIES = """\
{name} asked one of its inputs for a writable pointer without writing to it{at} (.numpy(),
data_ptr(), np.asarray(t), a compiled or extension kernel, a Triton launch). The in-place
guard refuses writable pointers to the caller's arrays, so this call ran again on copies of
its inputs, and later calls of this signature run on copies too: one copy per input per
call. In your own code, read addresses with tensor.const_data_ptr() instead of data_ptr(),
and copy explicitly what must become numpy (t.clone().numpy()), to stay zero-copy. Where
torch's own code asks (some kernels do: a bidirectional LSTM's, a weight_norm
parametrization's, torch.compile'd code), nothing in yours can avoid the copies, and the
warning may be silenced:
    warnings.filterwarnings("ignore", category=torchjax.errors.CopyWarning)"""


def innermost_line(error: BaseException) -> str:
    """The last Python line the error passed through ("rnn.py:1124 in forward"): where
    the pointer was asked for, or the call into the kernel that asked."""
    tb = error.__traceback__
    if tb is None:
        return ""
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno} in {code.co_name}"
