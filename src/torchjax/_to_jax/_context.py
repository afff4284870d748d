# Every piece of a call's ambient state, in one file: what torchjax keeps beside a call's
# arguments, per thread or per process. The modules that use a piece keep the logic
# around it; the state itself is here, so that a reader sees at once what outlives a call
# (tests/test_layers.py checks that no other module of _to_jax/ or _module_to_jax/ defines
# a thread-local, a lock or a store).
#
# state              scope    what it holds (used by)
# FAKE_RUN_LOCK      process  one fake run at a time: FakeTensorMode is process-wide in places;
#                             re-entrant, a wrapped function may call another (_fake/_run.py)
# fake_runs          thread   `depth`: fake runs around this thread's code; an eager call in
#                             one runs for real (_fake/_run.py, _torch_call/_impl.py, _hot.py)
# failed_fake_run    thread   `error`, `owners`: the last failed fake run and the class of
#                             `self` in each of its frames, kept before the frames drop their
#                             locals (_fake/_run.py)
# autograd_inside    thread   `depth`: derived calls differentiate with torch.autograd and
#                             batch by a loop: the function runs autograd itself (_call/_plan.py)
# WARNED_COPIES      process  functions warned once that they run on copies (_call/_plan.py)
# holding            thread   `depth`: derived calls open; `held`: module state kept for their
#                             backward until the outermost ends (_torch_ops/_residual.py)
# OUTPUT_BUFFERS     thread   XLA's output buffers offered to a VJP or a kept forward
#                             (_torch_call/_lowering.py, _callables/)
# GRAPHS             process  kept graphs by handle, bounded in count and bytes (_callables/)
# FORWARD_AD         process  torch.func.jvp one thread at a time: torch's forward-mode levels
#                             are process-wide (_callables/_autodiff.py)
# WARMED             process  user functions a ForwardResiduals has run once (_callables/_kept.py)
# DTYPES_OK          process  input dtypes known to convert to torch (_torch_call/)
# SEEDED             process  seeded module calls take turns: torch's global generator
#                             (_module_to_jax/)
# PARAMETRIZE_LOCK   process  one module call at a time owns parametrize's shared keys
#                             (_module_to_jax/)
# LOWERING_LOCK      process  lowering="xla": the op table's one import, one torch.export at a
#                             time (torch.export's tracing state is process-wide) (_xla/)
from __future__ import annotations

import collections
import itertools
import threading
import weakref
from typing import Any

from torchjax._log import logger

FAKE_RUN_LOCK = threading.RLock()


class _Depth(threading.local):
    depth = 0


fake_runs = _Depth()
failed_fake_run = threading.local()
autograd_inside = _Depth()
WARNED_COPIES: weakref.WeakSet = weakref.WeakSet()


class _Holding(threading.local):
    def __init__(self) -> None:
        self.depth = 0
        self.held: list = []


holding = _Holding()


class OutputBuffers(threading.local):
    """XLA's output buffers of the jitted call running on this thread, for a call that can
    write its outputs there itself (set by the lowering for a VJP or a kept forward)."""

    buffers: list | None = None

    def take(self) -> list | None:
        """The buffers, once: the first to ask gets them (a call nested in the VJP, none)."""
        buffers, self.buffers = self.buffers, None
        return buffers


OUTPUT_BUFFERS = OutputBuffers()


class GraphStore:
    """Kept graphs (_torch_ops/_residual.py's KeptGraph, which has `nbytes`) by handle, a
    positive int32, bounded in count and bytes (the oldest go first); thread-safe."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count, self.max_bytes = max_count, max_bytes
        self._graphs: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._next = itertools.count(1)

    def put(self, graph: Any) -> int:
        """Keep `graph`; its handle, or 0 where the bounds leave no room for it."""
        with self._lock:
            handle = next(self._next) % (2**31 - 1) + 1
            self._graphs[handle] = graph
            self._bytes += graph.nbytes
            while self._graphs and (
                len(self._graphs) > self.max_count or self._bytes > self.max_bytes
            ):
                old_handle, old = self._graphs.popitem(last=False)
                self._bytes -= old.nbytes
                logger.debug(
                    "kept graph %d evicted (more than %d graphs or %d bytes kept): its VJP "
                    "will run the forward again",
                    old_handle,
                    self.max_count,
                    self.max_bytes,
                )
            return handle if handle in self._graphs else 0

    def take(self, handle: int) -> Any:
        """The graph kept under `handle`, removed from the store; None if it is gone."""
        with self._lock:
            graph = self._graphs.pop(handle, None)
            if graph is not None:
                self._bytes -= graph.nbytes
            return graph

    def __len__(self) -> int:
        return len(self._graphs)


# Kept graphs whose VJP never runs (XLA dropped it, an exception came in between, a forward-
# only use) must not accumulate: the oldest are evicted, and their VJPs recompute.
MAX_GRAPHS = 256
MAX_GRAPH_BYTES = 2 * 2**30
GRAPHS = GraphStore(MAX_GRAPHS, MAX_GRAPH_BYTES)

FORWARD_AD = threading.RLock()
WARMED: weakref.WeakSet = weakref.WeakSet()
DTYPES_OK: set = set()
SEEDED = threading.RLock()
PARAMETRIZE_LOCK = threading.RLock()
LOWERING_LOCK = threading.RLock()
