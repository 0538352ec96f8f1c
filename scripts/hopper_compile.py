"""Compile every launch the kernel tables may pick for Hopper (sm_90), on any machine.

Triton builds a cubin without a GPU (its wheel carries ptxas), so a kernel its code generator
refuses fails here, before a GPU run. The Triton installed here may be newer than a GPU image's;
this catches what both refuse. Run it without TRITON_INTERPRET (the interpreter decorates the
helper functions differently at import):

    python scripts/hopper_compile.py [--jobs N]
    python scripts/hopper_compile.py --stats [--dump DIR]

The cases compile in ``--jobs`` processes (default: one a core; the compiler is single-threaded).
To check what the GPU image's Triton refuses (it is older than the one the tests install, and
each release accepts different things), put its wheel first on the path:

    python -m pip install --no-deps --target /tmp/triton-gpu triton==3.6.0
    PYTHONPATH=/tmp/triton-gpu python scripts/hopper_compile.py

The FP8 cases are compiled as the runtime specialises a launch on the model shapes: pointers and
N, K, the row strides divisible by 16 (``tt.divisibility``; without it the loads are not
vectorised and the K loop is not pipelined, which no launch on those shapes sees), the
activation-scale and weight-scale strides (ceil(K / 128)) not. ``--stats`` compiles the decode
launches of the 0.5B MLP-down and 8B shapes' tile, fused and not, and prints what their code is
made of (PTX and SASS instruction counts: the MMA, the async copies, ``div.rn.f32`` and its
expansion, local memory, registers, shared memory); ``--dump`` writes each one's TTGIR, PTX and
SASS.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from functools import cache
from typing import Any

FP8_ARGS = dict(
    a="*fp8e4nv", a_s="*fp32", b="*fp8e4nv", b_s="*fp32", c="*bf16", bias_ptr="*bf16", M="i32", N="i32",
    K="i32", stride_am="i32", stride_asm="i32", stride_bn="i32", stride_bsn="i32", stride_cm="i32",
    partials="*fp32", counters="*i32",
)  # fmt: skip


#: The FP8 kernel's arguments a launch on the model shapes sees divisible by 16 (K a multiple of
#: 128); a ragged K leaves K and the row strides of A and B out.
FP8_ALIGNED = ("a", "a_s", "b", "b_s", "c", "bias_ptr", "partials", "counters", "N", "K", "stride_am", "stride_bn",
               "stride_cm")  # fmt: skip
FP8_ALIGNED_RAGGED_K = tuple(n for n in FP8_ALIGNED if n not in ("K", "stride_am", "stride_bn"))


def compile_for_sm90(
    kernel: Any,
    signature: dict[str, str],
    constexprs: dict[str, Any],
    aligned: tuple[str, ...] = (),
    **options: Any,
) -> Any:
    """Compile ``kernel`` (an isoaudit lazy kernel) for sm_90 with these argument types, the
    ``aligned`` arguments specialised as divisible by 16 (as Triton's launcher specialises them);
    returns Triton's compiled kernel (``.asm``: ttgir, ptx, cubin)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = kernel.built()
    full = {**signature, **dict.fromkeys(constexprs, "constexpr")}
    fixed = {(fn.arg_names.index(name),): value for name, value in constexprs.items()}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    return triton.compile(
        ASTSource(fn=fn, signature=full, constexprs=fixed, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=options,
    )


def fp8_case(
    tile: Any, *, split_grid: bool, span: int, even: bool, fused: bool, quant_m: int | None = None
) -> tuple[Any, dict[str, str], dict[str, Any], tuple[str, ...], dict[str, Any]]:
    """(kernel, signature, constexprs, aligned, options) of one W8A8 launch: bf16 activation in
    where ``fused`` (its first ``quant_m`` rows quantized, default the tile's), else E4M3."""
    from isoaudit.kernels import fp8

    constexprs = dict(
        HAS_BIAS=True, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=fp8.GROUP, GROUP_M=tile.group_m,
        SPAN_BLOCKS=span, SPLIT_GRID=split_grid, LAG=tile.lag, EVEN_K=even, FUSED_QUANT=fused, A_FP8=fused,
        QUANT_M=quant_m or tile.block_m,
    )  # fmt: skip
    options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
    args = dict(FP8_ARGS, a="*bf16", a_s="*bf16") if fused else FP8_ARGS
    aligned = FP8_ALIGNED if even else FP8_ALIGNED_RAGGED_K
    return fp8._w8a8_kernel, args, constexprs, aligned, options


def fp8_cases() -> list[tuple[str, Any]]:
    """Every FP8 tile candidate, unsplit, split as programs and split summed in turn (ragged K),
    each on quantized operands and with the activation quantized inside the GEMM (bf16 in; and
    for the split grid of the 64-row tiles, the decode launches that quantize only 2 or 16 of the
    tile's rows); and the activation quantizer kernel."""
    from isoaudit.kernels import fp8, fp8_quant

    cases = []
    for tile in fp8.TILE_CANDIDATES:
        for variant, (split_grid, span, even) in {
            "plain": (False, 0, True),
            "split-grid": (True, 8, True),
            "split-in-turn ragged-K": (False, 8, False),
        }.items():
            quant = [None] + ([2, 16] if split_grid and tile.block_m == 64 else [])
            for fused, quant_m in [(False, None)] + [(True, q) for q in quant]:
                name = f"fp8 {tile} {variant}{' fused-quant' if fused else ''}"
                name += f" QUANT_M={quant_m}" if quant_m else ""
                cases.append((name, fp8_case(tile, split_grid=split_grid, span=span, even=even, fused=fused,
                                             quant_m=quant_m)))  # fmt: skip
    for rows in (1, 4):
        act = dict(x="*bf16", q="*fp8e4nv", s="*fp32", M="i32", K="i32", stride_xm="i32", stride_qm="i32",
                   stride_sm="i32")  # fmt: skip
        constexprs = dict(GROUP_K=fp8.GROUP, ROWS=rows, OUT_FP8=True)
        cases.append((f"fp8 act quant ROWS={rows}", (fp8_quant._act_quant_kernel, act, constexprs, (), {})))
    return cases


def fp8_grouped_cases() -> list[tuple[str, Any]]:
    """The FP8 grouped GEMM of MoE experts for every FP8 tile candidate, with the host's tile table
    and with the device table (and its scatter back to routing order), unsplit, split and ragged;
    and its gather-quantizer."""
    from isoaudit.kernels import fp8, fp8_grouped

    args = dict(
        a="*fp8e4nv", a_s="*fp32", b="*fp8e4nv", b_s="*fp32", c="*bf16", table="*i32", idx="*i32",
        n_groups="i32", N="i32", K="i32", stride_am="i32", stride_asm="i32", stride_be="i32",
        stride_bn="i32", stride_bse="i32", stride_bsn="i32", stride_cm="i32",
    )  # fmt: skip
    aligned = ("a", "a_s", "b", "b_s", "c", "table", "idx", "N", "stride_am", "stride_bn", "stride_cm")
    cases = []
    for tile in fp8.TILE_CANDIDATES:
        for table, (device, scatter) in {
            "host table": (False, False),
            "device table": (True, False),
            "device table scatter": (True, True),
        }.items():
            for variant, (span, even) in {
                "plain": (0, True),
                "split": (4, True),
                "ragged-K": (5, False),
            }.items():
                constexprs = dict(
                    BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=fp8.GROUP, SPAN_BLOCKS=span,
                    LAG=tile.lag, EVEN_K=even, DEVICE_TABLE=device, E_P2=64, SCATTER=scatter,
                )  # fmt: skip
                options = dict(num_warps=tile.num_warps, num_stages=tile.num_stages)
                kernel = fp8_grouped._fp8_grouped_kernel
                cases.append(
                    (f"fp8 grouped {tile} {table} {variant}", (kernel, args, constexprs, aligned, options))
                )
    gather = dict(x="*bf16", idx="*i32", q="*fp8e4nv", s="*fp32", S="i32", K="i32", stride_xm="i32",
                  stride_sm="i32")  # fmt: skip
    for rows in (1, 4):
        constexprs = dict(TOPK=8, GROUP_K=fp8.GROUP, ROWS=rows, OUT_FP8=True)
        cases.append(
            (
                f"fp8 grouped gather-quant ROWS={rows}",
                (fp8_grouped._gather_quant_kernel, gather, constexprs, (), {}),
            )
        )
    return cases


def fingerprint_cases() -> list[tuple[str, Any]]:
    """Both fingerprint kernels (one region, many regions), whole rows and column-chunked, for
    bf16, fp16 and fp32 rows, and the chunks' combine."""
    from isoaudit.kernels import fingerprint as fp

    shared = dict(
        w_ptr="*i64", p_ptr="*fp32", m_ptr="*i64", int_ptr="*i64", flt_ptr="*fp32", part_i="*i64",
        part_f="*fp32", n_rows="i32", hidden="i32",
    )  # fmt: skip
    one_tail = dict(stride_x="i32", stride_i="i32", stride_f="i32")
    many = dict(table_ptr="*i64", **shared, slot_i="i32", stride_i="i32", slot_f="i32", stride_f="i32")
    combine = dict(
        table_ptr="*i64", part_i="*i64", part_f="*fp32", int_ptr="*i64", flt_ptr="*fp32", n_rows="i32",
        chunks="i32", slot_i="i32", stride_i="i32", slot_f="i32", stride_f="i32",
    )  # fmt: skip
    cases = []
    options = dict(num_warps=fp.WARPS)
    for kind, view in ((0, "*i16"), (1, "*i16"), (2, "*i32"), (3, "*i16"), (4, "*i16")):
        for chunk in (0, fp.CHUNK_H):
            constexprs = dict(
                R=4, KIND=kind, BLOCK_R=fp.BLOCK_R, BLOCK_H=fp.BLOCK_H, SK=fp.SKETCH_DIM, CHUNK=chunk
            )
            one = dict(x_ptr=view, **shared, **one_tail)
            cases.append(
                (
                    f"fingerprint one region KIND={kind} CHUNK={chunk}",
                    (fp._fingerprint_kernel, one, constexprs, options),
                )
            )
            if kind > 2:  # bf16/fp16 read as fp32: the per-region kernel only
                continue
            for aligned_rows in (False, True):
                cases.append(
                    (
                        f"fingerprint regions KIND={kind} ALIGNED={aligned_rows} CHUNK={chunk}",
                        (
                            fp._fingerprint_regions_kernel,
                            many,
                            {**constexprs, "ALIGNED": aligned_rows},
                            options,
                        ),
                    )
                )
        for regions in (False, True):
            constexprs = dict(R=4, KIND=kind, BLOCK_R=fp.BLOCK_R, SK=fp.SKETCH_DIM, REGIONS=regions)
            cases.append(
                (
                    f"fingerprint combine KIND={kind} REGIONS={regions}",
                    (fp._combine_kernel, combine, constexprs, options),
                )
            )
    return cases


def distribution_cases() -> list[tuple[str, Any]]:
    """The one-pass distribution sketch (float64 exp and product) over float32 log-probabilities."""
    from isoaudit.kernels import distribution as dist

    signature = dict(
        lp_ptr="*fp32",
        bits_ptr="*i32",
        out_ptr="*fp64",
        n_rows="i32",
        vocab="i32",
        stride_lp="i32",
        scale="fp32",
    )
    constexprs = dict(BLOCK_R=dist.BLOCK_R, BLOCK_V=dist.BLOCK_V, SK=dist.SKETCH_DIM, CHUNK=dist.CHUNK_V)
    case = (dist._sketch_kernel, signature, constexprs, ("lp_ptr", "bits_ptr", "out_ptr", "stride_lp"), {})
    return [("distribution sketch", case)]


#: What ``--stats`` counts: (label, PTX or SASS, regular expression).
STATS = (
    ("wgmma", "ptx", r"wgmma\.mma_async"),
    ("mma.sync", "ptx", r"\bmma\.sync"),
    ("cp.async", "ptx", r"cp\.async\.(?:ca|cg)"),
    ("tma", "ptx", r"cp\.async\.bulk\.tensor"),
    ("div.rn.f32", "ptx", r"div\.rn\.f32"),
    ("ld/st.local", "ptx", r"(?:ld|st)\.local"),
    ("SASS", "sass", r"^\s+/\*[0-9a-f]{4,}\*/\s"),
    ("GMMA", "sass", r"[QH]GMMA\."),
    ("FCHK", "sass", r"\bFCHK\b"),
    ("MUFU.RCP", "sass", r"MUFU\.RCP\b"),
    ("CALL", "sass", r"\bCALL\."),
    ("BSSY", "sass", r"\bBSSY\b"),
    ("LDGSTS", "sass", r"\bLDGSTS\b"),
    ("LDS", "sass", r"\bLDS(?:M)?\b"),
    ("STS", "sass", r"\bSTS\b"),
    ("SHFL", "sass", r"\bSHFL\."),
    ("BAR", "sass", r"\bBAR\."),
)


def stats_cases() -> list[tuple[str, Any]]:
    """The decode launches of two weights, fused and not: 1152x896 (no split) and 4096x4096 (the
    weight's split as programs), each at M = 1 and M = 64 with the tile ``pick_tile`` gives."""
    from isoaudit.kernels import fp8

    cases = []
    for n, k in ((1152, 896), (4096, 4096)):
        span = fp8.weight_split(n, k) // fp8.GROUP
        for m in (1, 64):
            tile = fp8.pick_tile(m, n, k, 132)
            common = dict(split_grid=span > 0, span=span, even=k % fp8.GROUP == 0)
            label = f"{n}x{k} M={m} {tile.tag}"
            cases.append((f"{label} unfused", fp8_case(tile, fused=False, **common)))
            cases.append((f"{label} fused, {tile.block_m} rows", fp8_case(tile, fused=True, **common)))
            q = fp8.quant_rows(m, tile.block_m)
            if q != tile.block_m:
                cases.append((f"{label} fused, {q} rows", fp8_case(tile, fused=True, quant_m=q, **common)))
    return cases


def print_stats(dump: str | None) -> int:
    """Compile :func:`stats_cases` and print a table of their instruction counts."""
    import re
    import subprocess
    import tempfile

    import triton.backends.nvidia as nv

    cuobjdump = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
    rows = []
    for name, (kernel, signature, constexprs, aligned, options) in stats_cases():
        compiled = compile_for_sm90(kernel, signature, constexprs, aligned, **options)
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compiled.asm["cubin"])
            f.flush()
            sass = subprocess.run(
                [cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True
            ).stdout
            usage = subprocess.run(
                [cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
            ).stdout
        text = {"ptx": compiled.asm["ptx"], "sass": sass}
        counts = [len(re.findall(rx, text[src], re.M)) for _, src, rx in STATS]
        regs = re.search(r"REG:(\d+)", usage)
        stack = re.search(r"STACK:(\d+)", usage)
        rows.append((name, counts, regs.group(1) if regs else "?", stack.group(1) if stack else "?",
                     compiled.metadata.shared))  # fmt: skip
        if dump:
            os.makedirs(dump, exist_ok=True)
            base = os.path.join(dump, re.sub(r"[^A-Za-z0-9.]+", "_", name).strip("_"))
            for ext, body in (("ttgir", compiled.asm["ttgir"]), ("ptx", compiled.asm["ptx"]), ("sass", sass)):
                with open(f"{base}.{ext}", "w") as out:
                    out.write(body)
    width = max(len(r[0]) for r in rows)
    print(" " * width, *(f"{label:>11}" for label, _, _ in STATS), f"{'regs':>5} {'stack':>5} {'smem':>6}")
    for name, counts, regs, stack, smem in rows:
        print(f"{name:<{width}}", *(f"{c:>11}" for c in counts), f"{regs:>5} {stack:>5} {smem:>6}")
    return 0


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stats", action="store_true", help="instruction counts of the FP8 decode launches")
    ap.add_argument("--dump", default=None, help="with --stats: write each launch's TTGIR, PTX and SASS here")
    ap.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes (default: one a core)"
    )
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("hopper_compile: unset TRITON_INTERPRET (the interpreter cannot build cubins)")
    if args.stats:
        return print_stats(args.dump)
    failed = 0
    jobs = max(1, args.jobs)
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        for name, error in pool.map(compile_case, range(len(all_cases())), chunksize=4):
            if error is None:
                print(f"ok   {name}", flush=True)
            else:
                failed += 1
                print(f"FAIL {name}: {error}", flush=True)
    print(f"{failed} failed")
    return 1 if failed else 0


@cache
def all_cases() -> list[tuple[str, Any]]:
    """Every case :func:`main` compiles, in its order (each worker process makes its own list)."""
    return fp8_cases() + fp8_grouped_cases() + fingerprint_cases() + distribution_cases()


def compile_case(index: int) -> tuple[str, str | None]:
    """Compile case ``index`` of :func:`all_cases`: its name and None, or the compiler's last line."""
    name, case = all_cases()[index]
    kernel, signature, constexprs, *rest = case
    aligned, options = rest if len(rest) == 2 else ((), rest[0])
    try:
        compile_for_sm90(kernel, signature, constexprs, aligned, **options)
        return name, None
    except Exception as exc:  # noqa: BLE001 - every refusal is reported, then the exit code says so
        return name, str(exc).strip().splitlines()[-1][:400]


if __name__ == "__main__":
    sys.exit(main())
