"""Triton's interpreter without a patch it repeats: the interpreter children call `patch()` first.

Each call of a @triton.jit helper from inside a kernel (`InterpretedFunction.__call__`) patches
triton.language again for the helper's module (`_patch_lang`: inspect.getmembers over five modules),
thousands of times a test on kernels built from many helpers: under cProfile, 24% of the layer-combine
fold child's time; timed without the profiler, that child took 26.9 s before and 20.0 s with `patch()`.
Nothing undoes those patches except a launch's own restore, which puts back only what that launch
patched, and every launch patches its kernel's modules again; so one patch per helper (its first call)
leaves each launch running under the same patches. Where triton's interpreter has another shape this
does nothing.
"""

from __future__ import annotations


def patch() -> None:
    """Make `InterpretedFunction.__call__` patch the language on a helper's first call only."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    device_function = getattr(interpreter, "InterpretedFunction", None)
    if device_function is None or not hasattr(device_function, "rewrite"):
        return  # another interpreter: left as it is
    if getattr(device_function, "_patched_once", False):
        return  # (patched already in this process)
    call_and_patch = device_function.__call__
    patched: set = set()

    def call(self, *args, **kwargs):
        if self.fn not in patched:
            patched.add(self.fn)
            return call_and_patch(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as exc:
            raise interpreter.InterpreterError(repr(exc)) from exc

    device_function.__call__ = call
    device_function._patched_once = True
