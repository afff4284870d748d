# The ATen ops whose lowering disagrees with torch beyond the sweep's tolerances: they run
# as torch callbacks under lowering="xla". `make conformance` (tools/conformance.py) keeps
# this list: it fails where a lowered op mismatches and is missing here, and where a listed
# op would now pass.
from __future__ import annotations

CALLBACK_OPS: frozenset[str] = frozenset()
