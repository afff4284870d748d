# Names `vulture` (make lint) reports as unused that are used, each with where from: vulture
# reads this file as code that uses them. A new finding is dead code to delete, or an entry
# here with its reason. (make lint also ignores functions registered by decorator,
# register_fake's and defjvp's, and torch.Tensor.__repr__'s keyword tensor_contents.)
# ruff: noqa: B018
from torchjax._primitive import _core
from torchjax._to_jax._torch_call import _placed
from torchjax._to_jax._xla import _program, _report, _routes
from torchjax._to_torch import _to_torch, _to_torch_module

# Called by JAX or torch through their protocols, not by name in this package:
_core.TorchCallPrimitive.multiple_results  # jax.core.Primitive's attribute, read by JAX
_placed.placed_call_p.multiple_results  # the same
_program._Keys.get_and_rotate_prng_key  # torchax's random lowerings call it on their env
_to_torch._JaxFunction.setup_context  # torch.autograd.Function's protocol
_to_torch_module.JaxModule.extra_repr  # torch.nn.Module's repr protocol
# Public or test-facing API:
_report.LoweringReport.fully_lowered  # torchjax.LoweringReport's documented property
_to_torch_module.JaxModule.param_tree  # to_torch_module's documented method
_routes.listed_callbacks  # the conformance sweep's list (tests/opinfo_harness.py)
