"""Interpreter compatibility for the Triton check files (a no-op unless TRITON_INTERPRET=1).

Triton <= 3.6's interpreter converts a scalar (a one-element array there) to a Python int with
`int(array)`, which numpy >= 2.4 refuses for arrays of one dimension, so every kernel loop
`for t0 in range(start, end, ...)` with tensor bounds failed in the interpreter ("only
0-dimensional arrays can be converted to Python scalars"). Later Triton squeezes first; this
does the same, and only when the installed interpreter is found broken, so it changes nothing
where it works. Compiled (GPU) kernels never go through this path.
"""

from __future__ import annotations

import operator
import os
from types import SimpleNamespace


def _fix_interpreter_index() -> None:
    import numpy as np
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None:
        return

    class Probe:
        pass

    scope = interpreter._LangPatchScope()
    patch(Probe, scope)
    probe = Probe()
    probe.handle = SimpleNamespace(data=np.zeros(1, np.int32))
    try:
        operator.index(probe)
        return
    except (TypeError, DeprecationWarning):
        pass

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_index()
