#!/usr/bin/env bash
# Everything that needs GPUs, in one go: the tensor-parallel benchmarks at every TP size the machine
# allows, the GPTModel gradient-equality tests, and the main job on GPUs.
#
#   bash scripts/gpu_checks.sh benches OUT_DIR     # bench_logprob / bench_fused at TP = 1, 2, 4, 8 (as GPUs allow)
#   bash scripts/gpu_checks.sh megatron OUT_DIR    # GPTModel layouts vs. one GPU (logits and fused paths) + the main job
#   bash scripts/gpu_checks.sh loss OUT_DIR        # bench_loss (one GPU) + the compiled / fused loss vs. eager on CUDA
#   bash scripts/gpu_checks.sh learn OUT_DIR       # forward-only log-probs on GPTModel + the learning job on one GPU
#
# Needs megatron-core, omegaconf, hypothesis (the test suite's conftest loads its profiles) and liger-kernel (the
# single-GPU baselines) importable.
# NVLink multicast stays off (NCCL_NVLS_ENABLE=0).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
what=${1:?benches or megatron}
out=${2:?output directory}
mkdir -p "$out"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $gpus"
cd "$(dirname "$0")/.."
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
esac
