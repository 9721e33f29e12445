#!/usr/bin/env bash
# What the GPU machine needs for scripts/megatron_lm_rl/run.py beside Transformer Engine (../shared/tools/te_gpu_parts.sh),
# in one folder to carry: .mlm_carry/ (git-ignored; 17 MiB at d98e8a6, under the 64 MiB a command may carry).
#
#   MP_GRPO_MEGATRON_LM_SRC=<Megatron-LM tree> bash scripts/megatron_lm_rl/carry.sh
#
# - wheels/: the Python 3.12 manylinux wheels of wheels.txt (pip download --no-deps: the list is the closure);
# - megatron-lm.tgz: megatron/ and the entry files of the tree (train_rl.py, gpt_builders.py, model_provider.py, …)
#   and its COMMIT file when it has one;
# - install.sh: on the GPU machine, `bash .mlm_carry/install.sh` installs the wheels into /root/mlm/site and unpacks
#   the tree into /root/mlm/megatron-lm; then PYTHONPATH=$PYTHONPATH:/root/mlm/site MP_GRPO_MEGATRON_LM_SRC=/root/mlm/megatron-lm.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=${MP_GRPO_MEGATRON_LM_SRC:?set MP_GRPO_MEGATRON_LM_SRC to a Megatron-LM tree}
out=.mlm_carry
rm -rf "$out" && mkdir -p "$out/wheels"
exclude=$(git rev-parse --git-path info/exclude); mkdir -p "$(dirname "$exclude")"
grep -qx "/$out/" "$exclude" 2>/dev/null || echo "/$out/" >> "$exclude"
P="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
    -d "$out/wheels" -r "$here/wheels.txt"
entries=(megatron train_rl.py gpt_builders.py hybrid_builders.py mamba_builders.py model_provider.py)
[ -f "$src/COMMIT" ] && entries+=(COMMIT)
tar czf "$out/megatron-lm.tgz" -C "$src" --exclude='__pycache__' "${entries[@]}"
cat > "$out/install.sh" <<'INSTALL'
set -e
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /root/mlm/megatron-lm
python3 -m pip install -q --no-index --no-deps --no-compile --target /root/mlm/site "$here"/wheels/*.whl 2>&1 | grep -v WARN || true
tar xzf "$here/megatron-lm.tgz" -C /root/mlm/megatron-lm
echo "installed: $(ls "$here"/wheels | wc -l) wheels into /root/mlm/site, Megatron-LM $(cat /root/mlm/megatron-lm/COMMIT 2>/dev/null) in /root/mlm/megatron-lm"
INSTALL
du -sh "$out" "$out"/wheels "$out"/megatron-lm.tgz
