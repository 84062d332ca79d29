"""Runs Triton kernels on the CPU. Importing this module on a machine without CUDA sets
TRITON_INTERPRET=1; ``triton.jit`` reads it when a kernel is defined, so tests/conftest.py
imports this module before any test module imports a kernel. Test modules then import the
module-scoped autouse fixture ``interpreter_fixes``::

    from tests.workers.triton_interpreter import interpreter_fixes  # noqa: F401

On a CUDA machine nothing is set (GPU tests must get compiled kernels) and the interpreter
tests skip themselves.
"""

import contextlib
import os

import torch

if not torch.cuda.is_available():
    # a missing triton fails these tests below (no skip)
    os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402


@contextlib.contextmanager
def patched_interpreter():
    """Three bugs of Triton 3.6's interpreter that the GPU compiler does not have, patched
    while the context lasts:

    - it calls int() on a scalar held as a 1-element array, which numpy >= 2.4 refuses, so
      ``range(start, end)`` over loaded bounds fails (triton-lang/triton#9171, fixed by #9172);
    - it stores bfloat16 as uint16 and ``tl.dot`` multiplies those bit patterns
      (triton-lang/triton#11584): convert bfloat16 operands to float32 first;
    - its float32 -> float8 e4m3 conversion adds the rounding bit to the mantissa without
      carrying into the exponent (7.9 becomes 4.0, not 8.0) and breaks no ties to even:
      convert float8 e4m3 both ways through torch, which rounds as the GPU's cvt.rn does.
    """
    original_patch_tensor = interpreter._patch_lang_tensor
    original_dot = interpreter.InterpreterBuilder.create_dot
    original_fp_to_fp = interpreter.InterpreterBuilder.create_fp_to_fp

    def patch_lang_tensor(tensor, scope):
        original_patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def as_float32(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = as_float32(a), as_float32(b)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        pair = (src.dtype.scalar, dst_type.scalar)
        if pair == (tl.float32, tl.float8e4nv):
            data = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32))
            data = data.to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        elif pair == (tl.float8e4nv, tl.float32):
            data = torch.from_numpy(np.ascontiguousarray(src.data).view(np.uint8))
            data = data.view(torch.float8_e4m3fn).to(torch.float32).numpy()
        else:
            return original_fp_to_fp(self, src, dst_type, rounding_mode)
        return interpreter.TensorHandle(data, dst_type.scalar)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(interpreter, "_patch_lang_tensor", patch_lang_tensor)
        patch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
        patch.setattr(interpreter.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)
        yield


@pytest.fixture(autouse=True, scope="module")
def interpreter_fixes():
    """The importing module's tests run under ``patched_interpreter`` (skipped with CUDA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("interpreter tests run on a machine without CUDA")
    with patched_interpreter():
        yield
