"""The log-prob kernels (mp_grpo/kernels/logprob_*.py) compile for an H100 / H200 (sm_90) on a machine without a
GPU: Triton's real compiler (to PTX and, with the ptxas shipped in the triton wheel, to a cubin), not the
interpreter the CPU suite runs them in — the interpreter accepts code the compiler rejects (a global that is
not ``tl.constexpr`` did slip through it once). Every logits dtype, with and without entropy and a
sampling filter's threshold, the backward's narrowed in-place variant (fp32 logits, a bf16 / fp16 gradient over each
row's front: its barrier in the PTX), the threshold search's candidate and select kernels and its radix kernels, at the block
sizes ``kernels/launch_config.py`` picks on a GPU; the mass pass's loop has no layout conversion.

The compilation runs in a subprocess with ``TRITON_INTERPRET=0`` (this file is its script; see ``sm90.py``).
"""

from __future__ import annotations

import itertools

from tests.kernels.sm90 import Sm90Compiler, needs_nvidia_backend, run_compile_script


@needs_nvidia_backend
def test_logprob_kernels_compile_for_sm90() -> None:
    assert "compiled 116 kernels" in run_compile_script(__file__)


def _compile_all() -> None:
    from mp_grpo.kernels.logprob_backward import logprob_backward_kernel
    from mp_grpo.kernels.logprob_candidates import (
        logprob_candidate_select_kernel,
        logprob_candidates_kernel,
        logprob_group_max_kernel,
    )
    from mp_grpo.kernels.logprob_filter import (
        logprob_radix_hist_kernel,
        logprob_radix_search_kernel,
        logprob_radix_select_kernel,
    )
    from mp_grpo.kernels.logprob_merge import logprob_merge_kernel
    from mp_grpo.kernels.logprob_stats import logprob_stats_kernel

    compiler = Sm90Compiler()
    compile_kernel = compiler.compile
    block = 4096  # the threshold search's counting block (launch_config, V_local >= 4096)
    cases = [(dt, ent, False) for dt, ent in itertools.product(("*bf16", "*fp16", "*fp32"), (False, True))]
    cases += [(dt, True, True) for dt in ("*bf16", "*fp16", "*fp32")]  # with a sampling filter's threshold
    # What launch_config picks on a GPU: 4096 columns x 4 warps, and 8192 x 8 for long shards (V_local > 2**16).
    long_rows = Sm90Compiler(num_warps=8)
    for stats_block, stats_compiler in ((4096, compiler), (8192, long_rows)):
        for logits, with_entropy, with_threshold in cases:
            stats_compiler.compile(logprob_stats_kernel, dict(
                x_ptr=logits, target_ptr="*i64", stats_ptr="*fp32", threshold_ptr="*fp32", skip_ptr="*i8", n="i32",
                row_start="i32",
                N_total="i32", V_local="i32", vocab_start="i32", stride_x_row="i64", stride_stats_row="i32",
                inv_temperature="fp32",
            ), dict(HAS_ENTROPY=with_entropy, HAS_THRESHOLD=with_threshold, HAS_SKIP=with_threshold,
                    BLOCK_V=stats_block))
            # In place (the gradient in the logits' dtype), and for fp32 logits narrowed in place (the gradient in
            # the operands' bf16 / fp16 over the front of each row: ROW_LOOP, a barrier between loads and stores).
            variants = [(logits, False)] + ([("*bf16", True), ("*fp16", True)] if logits == "*fp32" else [])
            for grad, row_loop in variants:
                compiled = stats_compiler.compile(logprob_backward_kernel, dict(
                    x_ptr=logits, grad_x_ptr=grad, target_ptr="*i64", row_max_ptr="*fp32", log_sum_ptr="*fp32",
                    complement_ptr="*fp32", centered_ptr="*fp32", entropy_ptr="*fp32", grad_logprob_ptr="*fp32",
                    grad_entropy_ptr="*fp32", threshold_ptr="*fp32",
                    grad_scale_ptr="*fp32", V_local="i32",
                    vocab_start="i32", ignore_index="i32", stride_x_row="i64", stride_grad_x_row="i64",
                    inv_temperature="fp32",
                ), dict(HAS_ENTROPY_GRAD=with_entropy, HAS_THRESHOLD=with_threshold, HAS_GRAD_SCALE=with_entropy,
                         ROW_LOOP=row_loop, BLOCK_V=stats_block))
                if row_loop:  # no warp's store may overtake another warp's load of the same block
                    assert "bar.sync" in compiled.asm["ptx"], f"narrowed in-place backward without its barrier ({grad})"
    # The threshold search: every (dtype, pass kind) the host code launches, at the GPU block sizes.
    passes = [  # (MODE, DIGIT_BITS, HAS_PREFIX, HAS_ROW_MAX_OUT, BLOCK_V)
        (0, 8, False, True, 4096), (0, 8, False, False, 4096), (0, 8, True, False, 4096),  # top-k counts
        (1, 4, False, False, 1024), (1, 4, True, False, 1024),  # top-p masses
        (2, 8, True, False, 4096),  # top-p exact last byte
    ]
    for logits in ("*bf16", "*fp16", "*fp32"):
        key_bits = 32 if logits == "*fp32" else 16
        for mode, digit_bits, has_prefix, has_max, block_v in passes:
            compiled = compile_kernel(logprob_radix_hist_kernel, dict(
                x_ptr=logits, tau_ptr="*fp32", prefix_ptr="*i32", row_max_ptr="*fp32",
                hist_ptr="*i32" if mode == 0 else "*fp32", row_max_out_ptr="*fp32", skip_ptr="*i8", V_local="i32",
                stride_x_row="i64", stride_hist_row="i32", inv_temperature="fp32", shift="i32",
            ), dict(KEY_BITS=key_bits, DIGIT_BITS=digit_bits, MODE=mode, HAS_PREFIX=has_prefix,
                    HAS_ROW_MAX_OUT=has_max, HAS_SKIP=not has_max, BLOCK_V=block_v))
            if mode == 1:
                # The mass pass's loop must not convert layouts (through shared memory): a [BLOCK_V] load
                # compared as digit[:, None] did, twice a block, and ran at 25x one read on an H100.
                ttgir = compiled.asm["ttgir"]
                loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
                assert "convert_layout" not in loop, f"layout conversion in the mass pass's loop ({logits})"
        for is_top_p, digit_bits, first, last in [(False, 8, True, False), (False, 8, False, True),
                                                  (True, 4, True, False), (True, 8, False, True)]:
            compile_kernel(logprob_radix_select_kernel, dict(
                hist_ptr="*fp32" if is_top_p else "*i32", x_ptr=logits, prefix_ptr="*i32",
                budget_ptr="*fp32" if is_top_p else "*i32", above_ptr="*fp32", top_p_ptr="*fp32",
                tau_ptr="*fp32", skip_ptr="*i8", N="i32", stride_hist_row="i32",
            ), dict(KEY_BITS=key_bits, DIGIT_BITS=digit_bits, IS_TOP_P=is_top_p, IS_FIRST=first, IS_LAST=last,
                    HAS_SKIP=True))
    # TP = 1: the whole radix fallback of a row in one program.
    for logits in ("*bf16", "*fp16", "*fp32"):
        for has_k, has_p in ((True, False), (False, True), (True, True)):
            compile_kernel(logprob_radix_search_kernel, dict(
                x_ptr=logits, tau_ptr="*fp32", row_max_ptr="*fp32", top_k_ptr="*i32", top_p_ptr="*fp32",
                prefix_ptr="*i32", budget_ptr="*fp32", above_ptr="*fp32", count_hist_ptr="*i32", mass_hist_ptr="*fp32",
                skip_ptr="*i8", V_local="i32", stride_x_row="i64", inv_temperature="fp32",
            ), dict(KEY_BITS=32 if logits == "*fp32" else 16, HAS_TOP_K=has_k, HAS_TOP_P=has_p, COUNT_BLOCK_V=4096,
                    MASS_BLOCK_V=512))
    # The candidate search: the group-maxima read, the per-row candidate kernel (one warp), the select kernel (TP =
    # 1 / 2 / 8: its [TP, 512] tile in registers, one warp up to TP = 2) — every logits dtype, the GPU
    # configurations (groups of 128 columns at V_local = 151936, 32 at 18992). Aligned as the launcher specializes.
    one_warp = Sm90Compiler(num_warps=1)
    for logits in ("*bf16", "*fp16", "*fp32"):
        key_bits = 32 if logits == "*fp32" else 16
        for block, group, groups_pad, read_compiler in ((4096, 32, 1024, compiler), (8192, 128, 2048, long_rows)):
            for has_sum in (False, True):
                compiled = read_compiler.compile(logprob_group_max_kernel, dict(
                    x_ptr=logits, maxima_ptr=logits, head_ptr="*i32", V_local="i32", n_groups="i32",
                    stride_x_row="i64", stride_maxima_row="i32", stride_head_row="i32", inv_temperature="fp32",
                ), dict(GROUP=group, HAS_SUM=has_sum, BLOCK_V=block), aligned=("x_ptr", "V_local", "stride_x_row"))
                # The logits are read in 16-byte vectors, as by the statistics kernel.
                assert "ld.global.v4" in compiled.asm["ptx"], f"group-maxima read without 16-byte loads ({logits})"
            one_warp.compile(logprob_candidates_kernel, dict(
                x_ptr=logits, maxima_ptr=logits, index_ptr="*i32", head_ptr="*i32", cand_ptr=logits, V_local="i32",
                n_groups="i32", stride_x_row="i64", stride_maxima_row="i32", stride_index_row="i32",
                stride_head_row="i32", stride_cand_row="i32",
            ), dict(KEY_BITS=key_bits, GROUP=group, KEEP=128, GROUPS_CAP=256, CAP=512, GROUPS_PAD=groups_pad,
                    CHUNK=512 // group))
        for tp in (1, 2, 8):
            (one_warp if tp <= 2 else compiler).compile(logprob_candidate_select_kernel, dict(
                head_ptr="*i32", cand_ptr=logits, x_ptr=logits, target_ptr="*i64", top_k_ptr="*i32",
                top_p_ptr="*fp32", min_p_ptr="*fp32", tau_ptr="*fp32", row_max_ptr="*fp32", finished_ptr="*i8",
                stats_ptr="*fp32", row_start="i32", V_local="i32", vocab_start="i32", v_global="i32", tp="i32",
                rank="i32", stride_head_rank="i32", stride_head_row="i32", stride_cand_rank="i32",
                stride_cand_row="i32", stride_x_row="i64", stride_stats_row="i32", inv_temperature="fp32",
            ), dict(KEY_BITS=key_bits, GROUP=1, CAP=512, TP_PAD=tp, HAS_MIN_P=True, HAS_TOP_K=True, HAS_TOP_P=True,
                    HAS_ENTROPY=True, WRITE_STATS=True))
    for with_entropy in (False, True):
        compile_kernel(logprob_merge_kernel, dict(
            stats_ptr="*fp32", target_ptr="*i64", logprob_ptr="*fp32", entropy_ptr="*fp32", row_max_ptr="*fp32",
            log_sum_ptr="*fp32", complement_ptr="*fp32", centered_ptr="*fp32", errors_ptr="*i64", N="i32", TP="i32",
            V_global="i32", ignore_index="i32",
            stride_stats_rank="i32", stride_stats_row="i32", inv_temperature="fp32",
        ), dict(HAS_ENTROPY=with_entropy, BLOCK_N=256))
    print(f"compiled {compiler.count + long_rows.count + one_warp.count} kernels for sm_90")


if __name__ == "__main__":
    _compile_all()
