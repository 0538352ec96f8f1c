"""Compile every launch the kernel tables may pick for Hopper (sm_90), on any machine.

Triton builds a cubin without a GPU (its wheel carries ptxas), so a kernel its code generator
refuses fails here, before a GPU run. The Triton installed here may be newer than a GPU image's;
this catches what both refuse. Run it without TRITON_INTERPRET (the interpreter decorates the
helper functions differently at import):

    python scripts/hopper_compile.py
"""

from __future__ import annotations

import os
import sys
from typing import Any

FP8_ARGS = dict(
    a="*fp8e4nv", a_s="*fp32", b="*fp8e4nv", b_s="*fp32", c="*bf16", bias_ptr="*bf16", M="i32", N="i32",
    K="i32", stride_am="i32", stride_asm="i32", stride_bn="i32", stride_bsn="i32", stride_cm="i32",
    partials="*fp32", counters="*i32",
)  # fmt: skip


def compile_for_sm90(
    kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], **options: Any
) -> None:
    """Compile ``kernel`` (an isoaudit lazy kernel) for sm_90 with these argument types."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.built()
    full = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    fixed = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    triton.compile(
        ASTSource(fn=fn, signature=full, constexprs=fixed), target=GPUTarget("cuda", 90, 32), options=options
    )


def fp8_cases() -> list[tuple[str, Any]]:
    """Every FP8 tile candidate, unsplit, split as programs and split summed in turn (ragged K),
    each on quantized operands and with the activation quantized inside the GEMM (bf16 in); and
    the activation quantizer kernel."""
    from isoaudit.kernels import fp8, fp8_quant

    cases = []
    for tile in fp8.TILE_CANDIDATES:
        for variant, (split_grid, span, even) in {
            "plain": (False, 0, True),
            "split-grid": (True, 8, True),
            "split-in-turn ragged-K": (False, 8, False),
        }.items():
            for fused in (False, True):
                constexprs = dict(
                    HAS_BIAS=True, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=fp8.GROUP,
                    GROUP_M=tile.group_m, SPAN_BLOCKS=span, SPLIT_GRID=split_grid, LAG=tile.lag, EVEN_K=even,
                    FUSED_QUANT=fused, A_FP8=fused,
                )  # fmt: skip
                options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
                args = dict(FP8_ARGS, a="*bf16", a_s="*bf16") if fused else FP8_ARGS
                name = f"fp8 {tile} {variant}{' fused-quant' if fused else ''}"
                cases.append((name, (fp8._w8a8_kernel, args, constexprs, options)))
    for rows in (1, 4):
        act = dict(x="*bf16", q="*fp8e4nv", s="*fp32", M="i32", K="i32", stride_xm="i32", stride_qm="i32",
                   stride_sm="i32")  # fmt: skip
        constexprs = dict(GROUP_K=fp8.GROUP, ROWS=rows, OUT_FP8=True)
        cases.append((f"fp8 act quant ROWS={rows}", (fp8_quant._act_quant_kernel, act, constexprs, {})))
    return cases


def fingerprint_cases() -> list[tuple[str, Any]]:
    """Both fingerprint kernels (one region, many regions) for bf16, fp16 and fp32 rows."""
    from isoaudit.kernels import fingerprint as fp

    shared = dict(
        w_ptr="*i64", p_ptr="*fp32", m_ptr="*i64", int_ptr="*i64", flt_ptr="*fp32", n_rows="i32", hidden="i32"
    )
    one_tail = dict(stride_x="i32", stride_i="i32", stride_f="i32")
    many = dict(table_ptr="*i64", **shared, slot_i="i32", stride_i="i32", slot_f="i32", stride_f="i32")
    cases = []
    for kind, view in ((0, "*i16"), (1, "*i16"), (2, "*i32")):
        constexprs = dict(R=4, KIND=kind, BLOCK_R=fp.BLOCK_R, BLOCK_H=fp.BLOCK_H, SK=fp.SKETCH_DIM)
        options = dict(num_warps=fp.WARPS)
        one = dict(x_ptr=view, **shared, **one_tail)
        cases.append(
            (f"fingerprint one region KIND={kind}", (fp._fingerprint_kernel, one, constexprs, options))
        )
        cases.append(
            (f"fingerprint regions KIND={kind}", (fp._fingerprint_regions_kernel, many, constexprs, options))
        )
    return cases


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("hopper_compile: unset TRITON_INTERPRET (the interpreter cannot build cubins)")
    failed = 0
    for name, (kernel, signature, constexprs, options) in fp8_cases() + fingerprint_cases():
        try:
            compile_for_sm90(kernel, signature, constexprs, **options)
            print(f"ok   {name}", flush=True)
        except Exception as exc:  # noqa: BLE001 - every refusal is reported, then the exit code says so
            failed += 1
            print(f"FAIL {name}: {str(exc).strip().splitlines()[-1][:400]}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
