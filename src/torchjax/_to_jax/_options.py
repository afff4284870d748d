# The policies a user chooses in to_jax (and module_to_jax): typed, checked, and carried
# by every call derived from the wrapped function.
from __future__ import annotations

import dataclasses
from typing import Literal, get_args

from torchjax._errors import ArgumentError

VmapMethod = Literal["torch.func", "torch", "sequential", "expand_dims", "broadcast_all"]
VmapRandomness = Literal["error", "different", "same"]
GradMethod = Literal["torch.func", "autograd"]
Lowering = Literal["callback", "xla"]

VMAP_METHODS: tuple[str, ...] = get_args(VmapMethod)
VMAP_RANDOMNESS: tuple[str, ...] = get_args(VmapRandomness)
GRAD_METHODS: tuple[str, ...] = get_args(GradMethod)
LOWERINGS: tuple[str, ...] = get_args(Lowering)


def check_lowering(lowering: str) -> str:
    """`lowering`, checked: one of LOWERINGS."""
    if lowering not in LOWERINGS:
        raise ArgumentError(
            f"lowering={lowering!r} is not one of {', '.join(map(repr, LOWERINGS))}: "
            f"'callback' runs the function as torch code, 'xla' turns its ops into JAX ops."
        )
    return lowering


@dataclasses.dataclass(frozen=True)
class Options:
    """Policies chosen in to_jax; they travel with every call derived from the function.

    ``vmap_method="torch.func"`` (batch with torch.func.vmap) is also spelled ``"torch"``,
    its earlier name; both mean the same and are stored as ``"torch.func"``.
    """

    vmap_method: str = "torch.func"
    vmap_randomness: str = "error"
    grad_method: str = "torch.func"

    @staticmethod
    def checked(vmap_method: str, vmap_randomness: str, grad_method: str) -> Options:
        for name, value, choices in (
            ("vmap_method", vmap_method, VMAP_METHODS),
            ("vmap_randomness", vmap_randomness, VMAP_RANDOMNESS),
            ("grad_method", grad_method, GRAD_METHODS),
        ):
            if value not in choices:
                raise ArgumentError(
                    f"to_jax: {name}={value!r} is not one of {', '.join(map(repr, choices))}."
                )
        if vmap_method == "torch":
            vmap_method = "torch.func"
        return Options(vmap_method, vmap_randomness, grad_method)
