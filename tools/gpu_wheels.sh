#!/usr/bin/env bash
# Bundle what the GPU check needs on a machine that reaches no package index (issue 24 item 6), into gpu_bundle/
# (git-ignored; the device tool carries it with `carry: ["gpu_bundle"]`):
#   gpu_bundle/wheels/    fla-core, flash-linear-attention (fla's Triton KDA kernels) and einops (fla-core's only
#                         requirement); the device already has torch 2.11 + CUDA, triton 3.6, jax 0.11.2 (CUDA),
#                         transformers 5.17, h5py, safetensors, flax, pytest (ml_dtypes comes with jax, tqdm with
#                         transformers). All three are pure-Python wheels (py3-none-any): any Python version fits.
#   gpu_bundle/official/  the official modeling file (sha256-checked by parity/torch_ref/official.py when used)
# Versions are the lock's (requirements/cpu.lock). Then, on the device, from the repository root:
#   python -m pip install -q --no-index --no-deps --target gpu_bundle/site gpu_bundle/wheels/*.whl &&
#   PYTHONPATH=$PWD/gpu_bundle/site LING3_OFFICIAL_MODELING=$PWD/gpu_bundle/official/modeling_bailing_moe_v3.py \
#     timeout 560 python tools/gpu_check.py --out /tmp/gc --jobs 6 --budget-s 480; \
#   cp -r /tmp/gc/gpu_check.json /tmp/gc/gpu_check.md /tmp/gc/gpu_check_points.json /tmp/gc/logs "$OUT"/
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python -m pip}
mkdir -p gpu_bundle/wheels gpu_bundle/official
$PIP download --no-deps --only-binary=:all: -d gpu_bundle/wheels \
    fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2
official=${LING3_OFFICIAL_MODELING:-$HOME/.cache/ling3-parity/official/modeling_bailing_moe_v3.py}
cp "$official" gpu_bundle/official/modeling_bailing_moe_v3.py
ls -l gpu_bundle/wheels gpu_bundle/official
