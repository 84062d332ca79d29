"""Sets TRITON_INTERPRET=1 on a machine without CUDA before any test module here imports a
Triton kernel (``triton.jit`` reads it once, when the kernel is defined); see
triton_interpreter.py."""

import tests.workers.triton_interpreter  # noqa: F401
