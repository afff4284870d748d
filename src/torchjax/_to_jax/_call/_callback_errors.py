# How an exception raised while torch runs under jax.jit reaches the user.
#
# XLA reports an exception from a host callback as text inside a JaxRuntimeError. jaxlib
# (nanobind) writes that text from the exception's innermost traceback frame outwards,
# through every caller (frame.f_back): the user's script, jax's dispatch, torchjax's call
# machinery, the user's function, torch; then `type(e).__name__: str(e)`. It keeps neither
# the exception object nor its notes, and JAX has no way to hand the callback's exception
# to the caller (jax-ml/jax#26102 is open; its docs say exceptions in callbacks are not
# supported). The frames torchjax's call machinery adds are not in the user's eager
# traceback (JAX's traceback filter hides them there), and under jit they pushed torch's
# reason 20-30 lines down.
#
# So the outermost callback frame raises a stand-in: raised there, its text has just that
# one torchjax frame, then (as the stand-in's class name, which jaxlib prints where a
# traceback prints the frames and the type) the frames of the user's function and of
# torch, and last the original type, torch's message as it was and torchjax's notes under
# it. The user's own exception object is not changed.
from __future__ import annotations

import os

from torchjax._compat._jax import JAX_SOURCE_DIR

# torchjax's own source: its frames are hidden, and an exception raised in one is
# torchjax's, never the user's function's (_callables/_base.py).
_HERE = os.path.abspath(__file__)  # torchjax/_to_jax/_call/_callback_errors.py
TORCHJAX_DIR = os.path.dirname(os.path.dirname(os.path.dirname(_HERE))) + os.sep
_HIDDEN = (TORCHJAX_DIR, JAX_SOURCE_DIR)  # jax's own frames are hidden eagerly too


class ReportedError(Exception):
    """The stand-in for an exception raised in a host callback (see the banner). Its class
    is made per exception, named by the frames and the original type."""


def as_reported(error: BaseException) -> BaseException:
    """What the outermost host callback frame raises for `error` (`raise ... from None`).

    A stand-in made further in (a nested callback frame) is raised again as it is, its
    traceback dropped so that only the raising frame shows.
    """
    if isinstance(error, ReportedError):
        return error.with_traceback(None)
    notes = getattr(error, "__notes__", None)
    try:
        text = str(error)
    except Exception:  # a user's __str__ that fails: say what jaxlib would have
        text = f"<{type(error).__name__} whose str() raised>"
    message = "\n".join([text, *notes]) if isinstance(notes, list) else text
    frames = shown_frames(error.__traceback__)
    if not frames and error.__cause__ is not None:  # torchjax's error for torch's: where that was
        frames = shown_frames(error.__cause__.__traceback__)
    name = frames + type(error).__name__
    stand_in = type(name, (ReportedError,), {"__module__": "builtins"})
    return stand_in(message)


def shown_frames(tb) -> str:
    """The frames of traceback `tb` that an eager traceback shows, one line each as jaxlib
    writes them: the user's and torch's, not torchjax's or jax's."""
    lines = []
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(_HIDDEN):
            lines.append(f'  File "{code.co_filename}", line {tb.tb_lineno}, in {code.co_name}\n')
        tb = tb.tb_next
    return "".join(lines)
