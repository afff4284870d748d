# The ATen ops whose lowering disagrees with torch beyond the sweep's tolerances, or fails
# under a transform torch supports: they run as torch callbacks under lowering="xla".
# `make conformance` (tools/conformance.py) keeps this list: it fails where a lowered op
# mismatches and is missing here, and where a listed op would now pass. Each entry says where
# it disagrees (docs/conformance.md has the errors).
from __future__ import annotations

CALLBACK_OPS: frozenset[str] = frozenset(
    {
        # torch reads only the lower triangle of L; the lowering uses all of it: wrong values
        # for a non-triangular input, and a wrong jvp (float64 cholesky_inverse: 25/25).
        "aten.cholesky_inverse.default",
        # Special functions whose JAX implementation differs from torch's beyond tolerance
        # (values near poles, or derivatives). (Torch's Bessel functions and orthogonal
        # polynomials have no derivative: their outputs get a stop_gradient, as torch gives.)
        "aten.polygamma.default",
        "aten.digamma.default",
        # Linear algebra: derivatives that differ from torch's (eigh's, pinv's at
        # rank-deficient or Hermitian inputs, cholesky_ex's and ldl_factor_ex's info
        # outputs), a householder_product without derivative rules.
        "aten._linalg_eigh.default",
        "aten.linalg_pinv.atol_rtol_tensor",
        "aten.linalg_cholesky_ex.default",
        "aten.linalg_ldl_factor_ex.default",
        "aten.linalg_householder_product.default",
        # Reductions and scatters: values or gradients that differ from torch's.
        "aten.max_pool2d_with_indices_backward.default",
        "aten.scatter_reduce.two",
        "aten.as_strided_scatter.default",
        "aten.logcumsumexp.default",
    }
)
