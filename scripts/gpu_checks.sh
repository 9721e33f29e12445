#!/usr/bin/env bash
# Everything that needs GPUs, in one go: the tensor-parallel benchmarks at every TP size the machine
# allows, the GPTModel gradient-equality tests, and the main job on GPUs.
#
#   bash scripts/gpu_checks.sh benches OUT_DIR     # bench_logprob / bench_fused at TP = 1, 2, 4, 8 (as GPUs allow)
#   bash scripts/gpu_checks.sh megatron OUT_DIR    # GPTModel layouts vs. one GPU (logits and fused paths) + the main job
#   bash scripts/gpu_checks.sh loss OUT_DIR        # bench_loss (one GPU) + the compiled / fused loss vs. eager on CUDA
#   bash scripts/gpu_checks.sh learn OUT_DIR       # forward-only log-probs on GPTModel + the learning job on one GPU
#   bash scripts/gpu_checks.sh te OUT_DIR          # the GPU test suite with Transformer Engine, then without it
#   bash scripts/gpu_checks.sh te-with OUT_DIR     #   … its first half alone (te-without: its second), for shorter calls
#   bash scripts/gpu_checks.sh bench-te OUT_DIR    # bench_step on TE's layer spec, one GPU: step.{json,md,png} (~6 min)
#   bash scripts/gpu_checks.sh te-multi OUT_DIR    # ≥ 2 GPUs: SP, CP = 2 (and TP = 2 × CP = 2 on 4) under TE, MoE, TP = 2 bench
#   bash scripts/gpu_checks.sh loss-rows OUT_DIR   # one GPU: the output layer on the loss rows (bench_loss_rows, ~5 min),
#                                                  # a step with a 50 %-masked micro-batch (bench_step, TE's spec if it imports; ~4 min)
#
# Needs megatron-core, omegaconf, hypothesis (the test suite's conftest loads its profiles) and liger-kernel (the
# single-GPU baselines) importable. The te* cases need Transformer Engine under $TE_SITE (default /root/te/site,
# where ../shared/tools/te_gpu_parts.sh installs it); they put it on PYTHONPATH themselves (NVTE_FRAMEWORK=pytorch)
# and take it off for the runs without it.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
what=${1:?benches or megatron}
out=${2:?output directory}
mkdir -p "$out"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus"
cd "$(dirname "$0")/.."
te_site=${TE_SITE:-/root/te/site}
without_te=$(printf '%s' "${PYTHONPATH:-}" | tr ':' '\n' | grep -vxF "$te_site" | paste -sd: -)
with_te="${without_te:+$without_te:}$te_site"
need_te() {
  if ! PYTHONPATH="$with_te" NVTE_FRAMEWORK=pytorch python3 -c \
      "import transformer_engine.pytorch, transformer_engine as t; print('transformer_engine', t.__version__, 'from', t.__file__)"; then
    echo "Transformer Engine does not import from $te_site (bash ../shared/tools/te_gpu_parts.sh; TE_SITE=...)"; exit 1
  fi
}
gpu_suite() {  # gpu_suite LABEL PYTHONPATH: the GPU test suite, its log in $out, its counts printed
  local start=$SECONDS
  PYTHONPATH="$2" NVTE_FRAMEWORK=pytorch python3 -m pytest tests/gpu -q -rs -p no:cacheprovider > "$out/gpu_suite_$1.log" 2>&1
  local status=$?
  grep -E "^(FAILED|ERROR)" "$out/gpu_suite_$1.log" | head -20
  echo "GPU suite $1: $(tail -1 "$out/gpu_suite_$1.log") (exit $status, $((SECONDS - start)) s)"
}
case "$what" in
  benches)
    for tp in 1 2 4 8; do
      [ "$tp" -le "$gpus" ] || continue
      torchrun --standalone --nproc_per_node "$tp" scripts/bench_logprob.py --out "$out" 2>&1 | grep -v -i warn | tail -8
      [ "$tp" -ge 2 ] && torchrun --standalone --nproc_per_node "$tp" scripts/bench_fused.py --tp "$tp" --out "$out" 2>&1 | grep -v -i warn | tail -8
    done
    ;;
  megatron)
    python3 -m pytest tests/gpu/test_megatron_gpt.py tests/gpu/test_megatron_fused_output.py -v -s -p no:cacheprovider 2>&1 \
      | tee "$out/gpu_tests.log" | grep -E "PASS|FAIL|SKIP|passed|failed|Error" | tail -40
    for path in logits fused; do
      torchrun --standalone --nproc_per_node 2 scripts/grpo_step.py --config gpu parallel.tensor_model_parallel_size=2 train.steps=6 \
        model.output_path=$path 2>&1 | tee "$out/grpo_step_$path.log" | grep -v -i warn | tail -12
    done
    ;;
  learn)
    python3 -m pytest tests/gpu/test_forward_only.py -v -s -p no:cacheprovider 2>&1 | tee "$out/forward_only.log" \
      | grep -E "PASS|FAIL|SKIP|passed|failed|Error|forward_logprobs" | tail -20
    torchrun --standalone --nproc_per_node 1 -m mp_grpo.train --config gpu output.progress_bar=false \
      output.dir="$out/grpo_gpu" 2>&1 | tee "$out/grpo_gpu.log" | grep -v -i warn | tail -70
    ;;
  loss)
    python3 scripts/bench_loss.py --out "$out" 2>&1 | grep -v -i warn | tail -30
    python3 -m pytest tests/gpu/test_loss_compile.py -q -p no:cacheprovider 2>&1 | tail -5
    ;;
  loss-rows)
    python3 scripts/bench_loss_rows.py --out "$out" 2>&1 | grep -v -i warn | tail -30
    spec=local; path_for_spec="$without_te"
    if PYTHONPATH="$with_te" NVTE_FRAMEWORK=pytorch python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
      spec=te; path_for_spec="$with_te"
    fi
    PYTHONPATH="$path_for_spec" NVTE_FRAMEWORK=pytorch python3 scripts/bench_step.py --spec "$spec" --shape 1.5b \
      --seq 2048 --recompute selective --paths floor logits fused --no-search --step-configs 1.5b@2048 \
      --loss-fraction 0.5 --out "$out/loss50" 2>&1 | grep -v -i warn | tail -30
    ;;
  te|te-with|te-without)
    [ "$what" = te-without ] || { need_te; gpu_suite with_te "$with_te"; }
    [ "$what" = te-with ] || gpu_suite without_te "$without_te"
    ;;
  bench-te)
    need_te
    # one H200, estimated (the JSON's meta.phase_s has the run's own): start, build and check ~1 min, the training
    # and forward-only passes in 20 interleaved rounds ~1 min, the training pass's search ~45 s and the forward-only
    # one's (floor and fused paths: the logits paths' forward-only search at 2^19 tokens takes minutes) ~20 s, the
    # snapshots ~30 s, the whole steps in 10 rounds ~1 min; no new part starts after 300 s (the same command resumes).
    # Every token but each row's first carries loss (--loss-fraction 1): the loss paths' output layer runs on the
    # rows the all-token floor's matmuls run on (the loss rows alone: the loss-rows case, 50 %)
    PYTHONPATH="$with_te" NVTE_FRAMEWORK=pytorch python3 scripts/bench_step.py --spec te --shape 1.5b --seq 2048 \
      --recompute selective --paths floor common logits fused logits_fp32 fused_fp32 fp32_head_tf32 fp32_head \
      --search-paths train:common train:logits train:logits_fp32 train:fp32_head_tf32 train:fp32_head floor fused \
      fused_fp32 --step-configs 1.5b@2048 --loss-fraction 1 --time-budget 300 --memory-snapshot "$out/step_memory" \
      --out "$out" 2>&1 \
      | grep -v -i warn | tail -60
    ;;
  te-multi)
    need_te
    [ "$gpus" -ge 2 ] || { echo "te-multi needs 2 GPUs or more"; exit 1; }
    PYTHONPATH="$with_te" NVTE_FRAMEWORK=pytorch python3 -m pytest tests/gpu/test_megatron_gpt.py \
      tests/gpu/test_megatron_te.py tests/gpu/test_megatron_moe.py tests/gpu/test_bench_step.py -v -s -p no:cacheprovider \
      2>&1 | tee "$out/gpu_multi_te.log" | grep -E "PASS|FAIL|SKIP|passed|failed|Error|relative L2" | tail -60
    PYTHONPATH="$with_te" NVTE_FRAMEWORK=pytorch torchrun --standalone --nproc_per_node 2 scripts/bench_step.py --spec te \
      --shape 1.5b --seq 2048 --recompute selective --paths floor common logits fused logits_fp32 fused_fp32 \
      --time-budget 420 --out "$out" 2>&1 | grep -v -i warn | tail -40
    ;;
  *)
    echo "unknown case: $what"; exit 2
    ;;
esac
