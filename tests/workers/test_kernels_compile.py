"""Every Triton kernel compiles for the H100/H200 (sm_90) down to a cubin, on this CPU: the
interpreter the other kernel tests use never runs Triton's compiler
(tools/kernels/compile_check.py)."""

import os
import subprocess
import sys

KERNELS = ("_gemv_kernel", "_qkv_rotary_kernel", "_rms_norm_kernel",
           "_attention_input_kernel", "_silu_and_mul_kernel", "_store_kv_kernel",
           "_extend_kernel", "_decode_split_kernel", "_decode_reduce_kernel",
           "_chunk_max_kernel", "_row_max_kernel", "_push_all_reduce_kernel",
           "_slot_block_kernel")


def test_every_kernel_compiles_for_sm_90():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "tools.kernels.compile_check"], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    compiled = result.stdout.splitlines()
    assert compiled[-1].endswith("kernel variants compiled for sm_90")
    for kernel in KERNELS:
        variants = [line for line in compiled if line.startswith(kernel + " ")]
        assert variants, f"{kernel} was not compiled"
    # a quantized cache's store, attention-input and attention kernels, int8 and e4m3
    for kernel in ("_store_kv_kernel", "_attention_input_kernel", "_extend_kernel",
                   "_decode_split_kernel"):
        for element in ("*i8", "*fp8e4nv"):
            assert any(line.startswith(kernel + " ") and element in line
                       and "'QUANTIZED': True" in line for line in compiled), (kernel, element)
    assert any(line.startswith("_attention_input_kernel ") and "*fp8e4nv" in line
               and "'CENTERED': True" in line for line in compiled)  # fp8's centered keys
    assert any(line.startswith("_attention_input_kernel ") and "*i8" in line
               and "'ROTATE': True" in line for line in compiled)  # int8's rotated keys
    gemv = [line for line in compiled if line.startswith("_gemv_kernel ")]
    for dtype in ("*bf16", "*fp16", "*fp32"):  # the activation dtypes
        assert any(dtype in line for line in gemv), f"no {dtype} one-token projection"


def test_refuses_to_run_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-m", "tools.kernels.compile_check"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert "run it without TRITON_INTERPRET=1" in result.stderr
