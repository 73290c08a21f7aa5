#!/usr/bin/env bash
# Bundle what the GPU check needs on a machine that reaches no package index (issue 24 item 6), into gpu_bundle/
# (git-ignored; the device tool carries it with `carry: ["gpu_bundle"]`):
#   gpu_bundle/wheels/    fla-core and flash-linear-attention (fla's Triton KDA kernels), pure-Python wheels
#                         (py3-none-any). Everything else the check imports is in the device image (torch 2.11 + CUDA
#                         13, triton 3.6, jax 0.11.2 with CUDA, transformers 5.17, h5py, safetensors, flax, pytest,
#                         pytest-xdist, ml-dtypes, tqdm, and einops: fla-core's only requirement; KINDS.md's list).
#   gpu_bundle/official/  the official modeling file (sha256-checked by parity/torch_ref/official.py when used)
# Versions are the lock's (requirements/cpu.lock). The device command (run tool, carry ["gpu_bundle"], timeout_s 600;
# from the repository root; at most 8 files come back from $OUT, hence the tarball of logs and reports):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
#     gpu_bundle/wheels/*.whl && export PYTHONPATH=/tmp/site || exit; export PYTHONUNBUFFERED=1 \
#     LING3_OFFICIAL_MODELING=$PWD/gpu_bundle/official/modeling_bailing_moe_v3.py; \
#   timeout 560 python3 tools/gpu_check.py --out /tmp/gc --jobs 6 --budget-s 480 2>&1 | tee $OUT/gpu_check.log; \
#   cp /tmp/gc/gpu_check.json /tmp/gc/gpu_check.md /tmp/gc/gpu_check_points.json $OUT/; \
#   tar czf $OUT/logs.tgz -C /tmp/gc logs reports
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python -m pip}
mkdir -p gpu_bundle/wheels gpu_bundle/official
rm -f gpu_bundle/wheels/*.whl  # one version of each: two stop the install there
$PIP download --no-deps --only-binary=:all: -d gpu_bundle/wheels fla-core==0.6.0 flash-linear-attention==0.6.0
official=${LING3_OFFICIAL_MODELING:-$HOME/.cache/ling3-parity/official/modeling_bailing_moe_v3.py}
cp "$official" gpu_bundle/official/modeling_bailing_moe_v3.py
ls -l gpu_bundle/wheels gpu_bundle/official
