"""The log-prob kernels (mp_grpo/kernels/logprob_*.py) compile for an H100 / H200 (sm_90) on a machine without a
GPU: Triton's real compiler (to PTX and, with the ptxas shipped in the triton wheel, to a cubin), not the
interpreter the CPU suite runs them in — the interpreter accepts code the compiler rejects (a global that is
not ``tl.constexpr`` did slip through it once). Every logits dtype, with and without entropy and a
sampling filter's threshold, and the top-p search kernel, at the block
sizes ``kernels/launch_config.py`` picks on a GPU.

The compilation runs in a subprocess with ``TRITON_INTERPRET=0`` (this file is its script; see ``sm90.py``).
"""

from __future__ import annotations

import itertools

from tests.kernels.sm90 import Sm90Compiler, needs_nvidia_backend, run_compile_script


@needs_nvidia_backend
def test_logprob_kernels_compile_for_sm90() -> None:
    assert "compiled 23 kernels" in run_compile_script(__file__)


def _compile_all() -> None:
    from mp_grpo.kernels.logprob_backward import logprob_backward_kernel
    from mp_grpo.kernels.logprob_filter import logprob_filter_bins_kernel
    from mp_grpo.kernels.logprob_merge import logprob_merge_kernel
    from mp_grpo.kernels.logprob_stats import logprob_stats_kernel

    compiler = Sm90Compiler()
    compile_kernel = compiler.compile
    block = 4096  # what launch_config picks on a GPU for V_local >= 4096
    cases = [(dt, ent, False) for dt, ent in itertools.product(("*bf16", "*fp16", "*fp32"), (False, True))]
    cases += [(dt, True, True) for dt in ("*bf16", "*fp16", "*fp32")]  # with a sampling filter's threshold
    for logits, with_entropy, with_threshold in cases:
        compile_kernel(logprob_stats_kernel, dict(
            x_ptr=logits, target_ptr="*i64", stats_ptr="*fp32", threshold_ptr="*fp32", n="i32", row_start="i32", N_total="i32",
            V_local="i32", vocab_start="i32", stride_x_row="i64", stride_stats_row="i32", inv_temperature="fp32",
        ), dict(HAS_ENTROPY=with_entropy, HAS_THRESHOLD=with_threshold, BLOCK_V=block))
        compile_kernel(logprob_backward_kernel, dict(
            x_ptr=logits, grad_x_ptr=logits, target_ptr="*i64", row_max_ptr="*fp32", log_sum_ptr="*fp32",
            entropy_ptr="*fp32", grad_logprob_ptr="*fp32", grad_entropy_ptr="*fp32", threshold_ptr="*fp32",
            V_local="i32",
            vocab_start="i32", ignore_index="i32", stride_x_row="i64", stride_grad_x_row="i64",
            inv_temperature="fp32",
        ), dict(HAS_ENTROPY_GRAD=with_entropy, HAS_THRESHOLD=with_threshold, BLOCK_V=block))
    for logits in ("*bf16", "*fp16", "*fp32"):
        compile_kernel(logprob_filter_bins_kernel, dict(
            x_ptr=logits, threshold_ptr="*fp32", row_max_ptr="*fp32", key_lo_ptr="*i64", bins_ptr="*fp32",
            V_local="i32", stride_x_row="i64", stride_bins_row="i32", inv_temperature="fp32", shift="i32",
        ), dict(BINS=16, BLOCK_V=1024))
    for with_entropy in (False, True):
        compile_kernel(logprob_merge_kernel, dict(
            stats_ptr="*fp32", target_ptr="*i64", logprob_ptr="*fp32", entropy_ptr="*fp32", row_max_ptr="*fp32",
            log_sum_ptr="*fp32", errors_ptr="*i32", N="i32", TP="i32", V_global="i32", ignore_index="i32",
            stride_stats_rank="i32", stride_stats_row="i32",
        ), dict(HAS_ENTROPY=with_entropy, BLOCK_N=256))
    print(f"compiled {compiler.count} kernels for sm_90")


if __name__ == "__main__":
    _compile_all()
