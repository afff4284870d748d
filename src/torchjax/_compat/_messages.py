# What torch's (and jaxlib's) own error messages say, where no exception type says it.
#
# torchjax must tell a failure of torch's machinery (a fake tensor without data, torch.func
# refusing a function, a storage that refuses writes) from the user's own exception, which
# stays theirs: only the former gets torchjax's advice. Where torch raises a plain
# RuntimeError, the only way to tell is the message. Every phrase torchjax matches lives
# here, and tests/test_torch_messages.py provokes each one from torch itself, on every
# version the matrix runs: a release that rewords a message fails there, by phrase.
from __future__ import annotations

import re

import torch

from torchjax._compat._registry import ABSENT, resolve

# -- fake runs: the fake machinery's limits (a real run may succeed) ------------------------
# The exception types torch uses for them, whichever this torch defines.
FAKE_LIMIT_ERRORS: tuple[type, ...] = tuple(
    t
    for t in (
        resolve(f"torch._subclasses.fake_tensor.{name}")
        for name in (
            "DataDependentOutputException",
            "DynamicOutputShapeException",
            "UnsupportedOperatorException",
            "UnsupportedFakeTensorException",
            "FakeTensorDeviceMismatchError",
            "MetadataMismatchError",
        )
    )
    if t is not ABSENT
) + tuple(
    t
    for t in (resolve("torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode"),)
    if t is not ABSENT
)
# A fake run that stopped where the function read a value (`.item()`, argument validation
# such as torch.distributions'): its output types need not depend on the values, so a real
# run's may serve other calls of the same signature (UserFunction.real_types). Not a
# data-dependent output shape (nonzero, boolean masks): those differ from call to call.
_VALUE_READ = resolve("torch._subclasses.fake_tensor.DataDependentOutputException")


def read_a_value(error: BaseException | None) -> bool:
    """Whether a fake run's failure is the function reading a value (see above)."""
    return _VALUE_READ is not ABSENT and isinstance(error, _VALUE_READ)


# And the phrases of the plain RuntimeErrors it raises (lower case).
FAKE_LIMIT_PHRASES = (
    "data is not allocated",  # a real tensor's data read in a fake run (tensor_split's index)
    "not supported for tensor subclasses",  # .numpy(), np.asarray() of a fake tensor
    "not available for 'meta' device type",  # a fake tensor's storage read
    "no fake impl registered",  # a torch.library.custom_op without register_fake
    NESTED_SIZES := "nestedtensorimpl doesn't support sizes",  # the nested fast path, faked
    # copy.deepcopy of a real tensor in a fake run (torch-harmonics copies cached tensors):
    # the fake copy refuses the real storage.
    'attempted to set the storage of a tensor on device "meta"',
)


def is_nested_fast_path(error: BaseException) -> bool:
    """A fake run through torch's nested-tensor fast path (nn.TransformerEncoder in eval
    mode with a padding mask), which fake tensors cannot follow."""
    return NESTED_SIZES in str(error).lower()


def custom_op_without_fake_kernel(error: BaseException) -> str | None:
    """The custom operator a fake run could not run (it has no fake kernel), or None."""
    unsupported = resolve("torch._subclasses.fake_tensor.UnsupportedOperatorException")
    if unsupported is not ABSENT and isinstance(error, unsupported):
        op = str(error.args[0]) if error.args else ""  # "namespace.name.overload"
        parts = op.split(".")
        if len(parts) >= 2 and parts[0] not in ("aten", "prims"):
            return f"{parts[0]}::{parts[1]}"  # as torch.library spells it
    text = str(error)
    if "no fake impl registered" in text.lower():
        start, end = text.find("CustomOpDef("), text.find(")>")
        if start >= 0 and end > start:
            return text[start + len("CustomOpDef(") : end]
        return "the custom operator"
    return None


def is_fake_limit(error: BaseException) -> bool:
    """Whether a fake run failed for the fake machinery's reason (data-dependent shapes or
    control flow, kernels without fake support), not because the function itself raised."""
    if isinstance(error, FAKE_LIMIT_ERRORS):
        return True
    text = f"{type(error).__name__} {error}".lower()
    return any(p in text for p in FAKE_LIMIT_PHRASES)


# -- torch.func and torch.autograd refusing (lower case) ------------------------------------
AUTODIFF_PHRASES = (
    "forward ad",  # an op without a forward-mode formula: "Trying to use forward AD with ..."
    "forward mode",  # a custom Function without jvp: "... to use it with forward mode AD."
    "jvp function",  # the same message
    "derivative for",  # "the derivative for '_cdist_backward' is not implemented."
    "functorch",  # "... autograd.Function with functorch transforms ..."
    "setup_context",  # the same message: an old-style autograd.Function
    "does not require grad and does not have a grad_fn",
    "not differentiable",  # "The QR decomposition is not differentiable when ..."
    "appears to not have been used in the graph",
    "support saved tensor hooks",  # torch.func under torch.utils.checkpoint, save_on_cpu
    "checkpoint is incompatible with .grad()",  # reentrant checkpoint refusing autograd.grad
)
NEEDS_SETUP_CONTEXT = "setup_context"
# An op refusing a differentiated input: "The function 'native_batch_norm' is not
# differentiable with respect to argument 'running_mean'."
NOT_DIFFERENTIABLE_INPUT = "is not differentiable with respect to argument"


def not_differentiable_input(error: BaseException) -> bool:
    return NOT_DIFFERENTIABLE_INPUT in str(error)


def is_autodiff_failure(error: BaseException) -> bool:
    """Whether torch.func or torch.autograd, not the function, failed to differentiate."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(p in text for p in AUTODIFF_PHRASES)


def lacks_forward_derivative(error: BaseException) -> bool:
    """Whether an op or a custom Function has no forward-mode derivative."""
    return isinstance(error, NotImplementedError) and "forward" in str(error).lower()


def needs_setup_context(error: BaseException) -> bool:
    """Whether an old-style autograd.Function met a torch.func transform."""
    return NEEDS_SETUP_CONTEXT in str(error)


# torch.func refusing a function that runs torch.autograd itself (x.requires_grad_()).
AUTOGRAD_INSIDE = "inside of a function being transformed by a functorch transform"


def runs_autograd_itself(error: BaseException) -> bool:
    """Whether torch.func refused a function because it runs torch.autograd itself."""
    return AUTOGRAD_INSIDE in str(error)


# torch.func refusing to run under saved-tensor hooks (the function uses torch.func itself).
SAVED_TENSOR_HOOKS = "saved tensor hooks"


def refuses_saved_tensor_hooks(error: BaseException) -> bool:
    return SAVED_TENSOR_HOOKS in str(error)


# torch.utils.checkpoint(use_reentrant=True) refusing torch.autograd.grad, which every
# torchjax derivative uses: "When use_reentrant=True, torch.utils.checkpoint is
# incompatible with .grad() or passing an `inputs` parameter to .backward()."
REENTRANT_CHECKPOINT = "use_reentrant=True, torch.utils.checkpoint is incompatible"


def is_reentrant_checkpoint(error: BaseException) -> bool:
    return REENTRANT_CHECKPOINT in str(error)


# -- torch.func.vmap refusing (lower case) -----------------------------------------------
VMAP_PHRASES = (
    "vmap",  # "vmap: It looks like you're calling .item() ...", data-dependent control flow
    "batching rule",  # "Batching rule not implemented for aten::column_stack ..."
)
MISSING_BATCHING_RULE = "batching rule not implemented"
RANDOMNESS = "randomness"  # "vmap: called random operation while in randomness error mode"


def is_vmap_failure(error: BaseException) -> bool:
    """Whether torch.func.vmap, not the function, failed to batch."""
    text = f"{type(error).__name__}: {error}".lower()
    return any(p in text for p in VMAP_PHRASES)


def lacks_batching_rule(error: BaseException) -> bool:
    return MISSING_BATCHING_RULE in str(error).lower()


def refuses_randomness(error: BaseException) -> bool:
    return RANDOMNESS in str(error)


# -- the user's function failing where torchjax can say why ---------------------------------
# A torch op that wants int64 indices given int32 ones (JAX's integers while x64 is off).
WANTS_INT64_PHRASES = (
    "expected a long tensor for index",  # take, put, index_copy
    "target dtype to be long",  # nll_loss, cross_entropy
    "should be type int64",  # max_unpool's indices
    "only applicable to index tensor of type longtensor",  # one_hot
)
# And the few that want int32 (LU pivots): a call handed int64 copies of int32 inputs
# (x64 off, _x64.widen_int32) that fails so runs again on the int32 tensors themselves.
WANTS_INT32_PHRASES = (
    "should be a tensor of scalar type torch.int32",  # lu_solve's pivots
    "tensor of torch.int32 dtype",  # lu_unpack's pivots
)
# A torch op given a Python value where it takes a tensor.
EXPECTS_TENSOR = "must be Tensor, not"
# A torch op given tensors of dtypes it does not combine (an integer array where a float
# weight waits: JAX's int32 data into nn.Linear). The message names the dtypes, in one of
# three spellings (below).
DTYPE_MISMATCH_PHRASES = (
    "have the same dtype",  # addmm: "mat1 and mat2 must ...", mm: "expected m1 and m2 to ..."
    "expected scalar type",  # "expected scalar type Float but found Double" (bmm, lstm)
    "should be the same",  # conv: "Input type (torch.LongTensor) and weight type ..."
    "expected both vectors to have same dtype",  # dot
    "not implemented for",  # an op with no kernel for the dtype: "... for 'Long'"
    "can't be cast to the desired output type",  # an in-place op: int tensor += float
    "to have one of the following scalar types",  # embedding given float ids
    "does not match weight dtype",  # RNN: "RNN input dtype (torch.float64) does not ..."
)
# torch's four spellings of a dtype in messages: a scalar type name ('Long'), a dtype
# (torch.int64), a legacy tensor type (torch.LongTensor) and, after "but got:", C++'s
# ("long int != float").
_SCALAR_TYPE_NAMES = {
    "Bool": "bool",
    "Byte": "uint8",
    "Char": "int8",
    "Short": "int16",
    "Int": "int32",
    "Long": "int64",
    "Half": "float16",
    "BFloat16": "bfloat16",
    "Float": "float32",
    "Double": "float64",
    "ComplexFloat": "complex64",
    "ComplexDouble": "complex128",
}
_CPP_TYPE_NAMES = {
    "bool": "bool",
    "unsigned char": "uint8",
    "signed char": "int8",
    "short int": "int16",
    "int": "int32",
    "long int": "int64",
    "c10::Half": "float16",
    "c10::BFloat16": "bfloat16",
    "float": "float32",
    "double": "float64",
}
_CPP_PAIR = re.compile(r"but got: ([\w: ]+?) != ([\w: ]+?)(?:$|[.,;\n])")
_CPP_IN_PARENS = re.compile(r"type \(([\w: ]+)\)")  # conv: "Input type (double) and ..."
_DTYPE_WORD = re.compile(
    r"\btorch\.([a-z]+[0-9]*)\b|\b(?:torch\.(?:cuda\.)?)?([A-Z][A-Za-z0-9]*?)(?:Tensor)?\b"
)


def wants_int64(error: BaseException) -> bool:
    text = str(error).lower()
    return any(p in text for p in WANTS_INT64_PHRASES)


def wants_int32(error: BaseException) -> bool:
    text = str(error).lower()
    return any(p in text for p in WANTS_INT32_PHRASES)


def mismatched_dtypes(error: BaseException) -> list[str]:
    """The dtypes (torch's names: 'int64', 'float32') that a dtype-mismatch message of
    torch's names, in order; empty for any other message."""
    text = str(error)
    if not any(p in text.lower() for p in DTYPE_MISMATCH_PHRASES):
        return []
    found: list[str] = []
    for pair in _CPP_PAIR.findall(text):
        found += [_CPP_TYPE_NAMES[t] for t in pair if t in _CPP_TYPE_NAMES]
    found += [_CPP_TYPE_NAMES[t] for t in _CPP_IN_PARENS.findall(text) if t in _CPP_TYPE_NAMES]
    for dtype_name, type_name in _DTYPE_WORD.findall(text):
        name = dtype_name if dtype_name else _SCALAR_TYPE_NAMES.get(type_name, "")
        if name and name not in found and _is_dtype_name(name):
            found.append(name)
    return found


def _is_dtype_name(name: str) -> bool:
    return isinstance(getattr(torch, name, None), torch.dtype)


def expects_tensor(error: BaseException) -> bool:
    return isinstance(error, TypeError) and EXPECTS_TENSOR in str(error)


# -- the in-place guard ---------------------------------------------------------------------
# torch's refusal to hand out a writable pointer to a storage marked throw-on-mutable-data-
# ptr (every input's, during a call).
WRITE_REFUSED = "Cannot access data pointer of Tensor"


def is_write_refusal(error: BaseException | None) -> bool:
    """Whether `error` (or one it was raised from) is a protected storage refusing a
    writable pointer: an attempted write, or a reader that asked for write access."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, RuntimeError) and WRITE_REFUSED in str(error):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


# -- jaxlib ---------------------------------------------------------------------------------
# nanobind's message for a call that matches none of a function's signatures.
NO_MATCHING_SIGNATURE = "incompatible function arguments"


def matches_no_signature(error: BaseException) -> bool:
    return isinstance(error, TypeError) and NO_MATCHING_SIGNATURE in str(error)


# -- lowering="xla": what the capture and its decomposition refuse ------------------------
# torch's refusals of an input requiring grad (torch.export runs the function with its
# floating inputs requiring grad): the capture then runs without.
GRAD_REFUSAL_PHRASES = (
    "is not differentiable with respect to argument",  # nll_loss's weight
    "a leaf Variable that requires grad is being used in an in-place operation",
    "does not support automatic differentiation",  # silu of a complex input
    "is not implemented",  # "the derivative for 'igamma: input' is not implemented"
)


def refuses_grad(error: BaseException) -> bool:
    return any(phrase in str(error) for phrase in GRAD_REFUSAL_PHRASES)


# torch's refusals of a view of a tensor whose strides do not allow it: eager, and as its
# decompositions and fake tensors say it.
VIEW_REFUSAL_PHRASES = ("view size is not compatible", "Cannot view a tensor with shape")


def refuses_view(error: BaseException) -> bool:
    return any(phrase in str(error) for phrase in VIEW_REFUSAL_PHRASES)
