"""``tl.dot`` under Triton's interpreter, with each output element computed alone.

The interpreter evaluates ``tl.dot`` with numpy's ``matmul``, that is OpenBLAS's sgemm, whose
rounding of an output element depends on where its row and column sit in the block and on the CPU
(the Haswell and Zen kernels OpenBLAS picks on an AMD EPYC round a row differently by its place in
the block; the SkylakeX kernel happens not to). On a GPU an MMA row's bits depend on that row alone,
which is what the kernel tests check ("a row's bits do not depend on the rows launched with it").
Here every element is its products formed exactly in float64 and added in ascending K, then
rounded once to the accumulator's dtype: the same bits at any place in any block, on every machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
    from triton.runtime import interpreter

    if not np.issubdtype(d.data.dtype, np.floating):  # integer dots are exact in any order
        return _original(self, a, b, d, input_precision, max_num_imprecise_acc)
    a_data, b_data = a.data, b.data
    if (a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating()) or (
        b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating()
    ):  # fp8 operands as the interpreter reads them: widened to fp16 first
        a_data = interpreter._convert_float(a_data, a.dtype, interpreter.tl.float16, None).view(np.float16)
        b_data = interpreter._convert_float(b_data, b.dtype, interpreter.tl.float16, None).view(np.float16)
    a64, b64 = a_data.astype(np.float64), b_data.astype(np.float64)
    total = np.zeros((*a64.shape[:-1], b64.shape[-1]), dtype=np.float64)
    for k in range(a64.shape[-1]):
        total += a64[..., :, k, None] * b64[..., None, k, :]
    out = total.astype(d.data.dtype) + d.data
    return interpreter.TensorHandle(out, d.dtype.scalar)


_original: Any = None


def install() -> None:
    """Make the interpreter's ``tl.dot`` the element-wise one above (idempotent)."""
    global _original
    from triton.runtime import interpreter

    if _original is None:
        _original = interpreter.InterpreterBuilder.create_dot
        interpreter.InterpreterBuilder.create_dot = _dot
