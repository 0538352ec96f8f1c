"""``tl.dot`` under Triton's interpreter, with each output element computed alone.

The interpreter evaluates ``tl.dot`` with numpy's ``matmul``, that is OpenBLAS's sgemm, whose
rounding of an output element depends on where its row and column sit in the block and on the CPU
(the Haswell and Zen kernels OpenBLAS picks on an AMD EPYC round a row differently by its place in
the block; the SkylakeX kernel happens not to). On a GPU an MMA row's bits depend on that row alone,
which is what the kernel tests check ("a row's bits do not depend on the rows launched with it").
Here every element is its products formed exactly in float64, summed in float64 over chunks of K in
ascending order (within a chunk, numpy's reduction of one contiguous row, whose order depends on the
chunk's length only), then rounded once to the accumulator's dtype: the same bits at any place in
any block, on every machine.
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
    a64 = a_data.astype(np.float64)[..., :, None, :]  # [..., M, 1, K]
    b64 = np.swapaxes(b_data.astype(np.float64), -1, -2)[..., None, :, :]  # [..., 1, N, K]
    total = np.zeros((*a_data.shape[:-1], b_data.shape[-1]), dtype=np.float64)
    for k in range(0, a_data.shape[-1], _K_CHUNK):  # each element's own products, a chunk at a time
        products = a64[..., k : k + _K_CHUNK] * b64[..., k : k + _K_CHUNK]  # a new C-ordered array
        total += products.sum(axis=-1)  # the same order for every element: a contiguous row each
    out = total.astype(d.data.dtype) + d.data
    return interpreter.TensorHandle(out, d.dtype.scalar)


#: K products summed per pass: bounds the [M, N, chunk] float64 temporary (32 MiB at 128x128).
_K_CHUNK = 256

_original: Any = None


def install() -> None:
    """Make the interpreter's ``tl.dot`` the element-wise one above (idempotent)."""
    global _original
    from triton.runtime import interpreter

    if _original is None:
        _original = interpreter.InterpreterBuilder.create_dot
        interpreter.InterpreterBuilder.create_dot = _dot
