# What torch computes: every torch callable a torch_call binds, the user's function and
# those derived from it, one family per file behind TorchCallable (_base.py), the contract
# the rules and the call plan read.
#
# Each rule of torch_call_p that transforms a call binds the same primitive again with a
# callable derived from the one it received, so the rules compose: jax.vmap(jax.grad(f))
# is a BatchedFunction of a VjpFunction, jax.hessian(f) a JvpFunction of a VjpFunction,
# vmap(vmap(f)) a BatchedFunction of a BatchedFunction: one torch call however deep.
#
# | callable (file) | computes | made by |
# |---|---|---|
# | UserFunction(f) (_user.py) | f(*args, **kwargs), in the caller's grad mode | to_jax |
# | BatchedFunction(g, in_dims) (_batched.py) | torch.func.vmap(g) over g's tensor leaves |
# |   | (per_example: a loop, for torch.autograd derivatives) | _batching.py |
# | LeadingAxisFunction(g, size) (_batched.py) | g itself, on inputs with a leading batch |
# |   | axis; only its types differ (vmap_method "expand_dims"/"broadcast_all") | _batching.py |
# | JvpFunction(g, wrt, out_mask, with_primals=True) (_autodiff.py) | g's outputs and the |
# |   | tangents of its inexact outputs, from one torch.func.jvp | _jvp.py |
# | JvpFunction(g, wrt, out_mask) | the tangents alone: linear in the tangents | the splits |
# |   | of _partial_eval.py and _batching.py |
# | JvpFunction(..., with_residuals=True) | the same, called with a KeptForward's |
# |   | residuals (replays its random draws) | linearization |
# | VjpFunction(g, wrt, out_mask) (_autodiff.py) | cotangents of g's `wrt` leaves |
# |   | (torch.func.vjp; torch.autograd.grad where nothing differentiates it again) |
# |   | | _transpose.py |
# | VjpFunction(..., with_residuals=True) | the same through the graph the forward kept |
# |   | (recomputing, with its draws, where the graph is gone) | _transpose.py |
# | VjpFunction(..., ct_batch=levels) | the same for a batch of cotangents: one forward, |
# |   | the pullback vmapped | _batching.py (jacrev) |
# | VjpFunction(..., with_tangents=True) | the pullbacks of cotangents and of their |
# |   | tangents, from one forward (the JVP of a VJP in its cotangents) | _jvp.py |
# | KeptForward(g, wrt, out_mask) (_kept.py) | g's outputs, keeping the autograd graph for |
# |   | the VJP; returns the graph's handle and the RNG state as residuals | linearization |
# | ForwardResiduals(forward) (_kept.py) | the forward's residuals alone | _dce.py |
# | BatchedKeptForward, BatchedKeptVjp (_batched_kept.py) | per-example gradients from |
# |   | one batched forward that keeps its graph | _batching.py |
# | ZerosLike(shape, dtype) (_base.py) | not a callable: a static leaf standing for zeros |
# |   | (a linear input's point in a generic transpose) | _transpose.py |
#
# Derived callables are frozen dataclasses, so equal transformations give equal params and
# hit the same caches. Their output types follow from their inner function's (out_types,
# given `types_of`): only the user's function is ever fake-run, once per signature. What
# they share in torch lives in _torch_ops/: _autograd.py (pullbacks, tape nodes), _vmap.py
# (torch.func.vmap's steps), _residual.py (kept graphs, random state).
