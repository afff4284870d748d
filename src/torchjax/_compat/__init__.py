# Every private JAX, jaxlib and torch name torchjax uses, and nowhere else.
#
# torchjax stands on internals of both frameworks: JAX's primitive machinery and its
# partial-evaluation rules, jaxlib's DLPack entry points, torch's functorch levels, fake
# tensors and version counters. Releases change them without notice, so each is looked up
# here, by feature detection rather than by version number:
#   * _jax.py: the JAX and jaxlib half (imports jax only; PytreePrimitive needs nothing else);
#   * _torch.py: the torch half, and the DLPack calls between torch and jaxlib;
#   * _messages.py: the phrases of torch's own error messages that tell torch's machinery
#     failing (a fake-tensor limit, torch.func refusing) from the user's code failing;
#   * _registry.py: how a name is looked up, recorded and checked.
# Where a public API does the same job, a missing private name falls back to it and costs
# speed, not function; where none does, importing torchjax raises an ImportError that names
# it. tests/test_compat.py checks every name against the installed versions, so an upgrade
# that removes one fails there by name. The supported versions are in docs/install.md.
