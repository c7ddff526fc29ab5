"""Run ops/triton_paged.py's kernels under Triton's CPU interpreter in this process (tests only)."""
import os


def use_interpreter() -> None:
    """TRITON_INTERPRET=1 (read when the kernels are first built, ops/triton_paged._kernels), and
    Triton 3.6's interpreter made to index a loaded scalar by its one element: it calls int() on a
    1-element array, which numpy 2 refuses."""
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter, "_verl_mcore_patched", False):
        return
    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._verl_mcore_patched = True
