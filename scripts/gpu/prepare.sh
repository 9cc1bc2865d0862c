#!/bin/bash
# Build the transfer chunks that put vLLM 0.26.0 (+ torchtitan) on the GPU
# machine of the `device` tool (Python 3.12, torch 2.11.0+cu130, no network).
# The project's copy of ../shared/gpu/prepare.sh (same recipe, tested on H100
# and H200); run it from the project root, on a machine with PyPI access:
#     bash scripts/gpu/prepare.sh        # about 4-5 minutes
# It writes, in the checkout (ignored through .git/info/exclude: /.gpu/):
#   .gpu/a/  vLLM's _C extension, xz-compressed, its first half + torchtitan wheels + stash.sh  (~30 MB)
#   .gpu/a2/ its second half + stash.sh (~28 MB; the tree travels with each chunk, and with the whole of it
#            it passed 64 MiB)
#   .gpu/b/  the rest of a slimmed vLLM tree + dependency wheels + install.sh     (~30 MB)
#   .gpu/c/  vLLM's _moe_C library (fused-MoE kernels' moe_align_block_size, moe_sum), xz + stash_c.sh (MoE runs)
# Each chunk stays under the device tool's 64 MiB per call. docs/gpu.md says
# which device calls use them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
WORK=${WORK:-/tmp/gpu_prep}
OUTA=$REPO/.gpu/a
OUTA2=$REPO/.gpu/a2
OUTB=$REPO/.gpu/b
OUTC=$REPO/.gpu/c
mkdir -p "$WORK" "$OUTA/titan" "$OUTA2" "$OUTB/wheels" "$OUTC"
grep -qx '/.gpu/' "$REPO/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >> "$REPO/.git/info/exclude"

PLATS=""
for n in 28 27 26 24 17 31 34 35 5; do PLATS="$PLATS --platform manylinux_2_${n}_x86_64"; done
PD="python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATS --platform manylinux2014_x86_64 --platform manylinux1_x86_64"

# 1. the vLLM wheel: pins torch==2.11.0, CUDA 13 build, about 304 MB
if [ -z "${VLLM_WHEEL:-}" ]; then
  $PD -d "$WORK/dl" vllm==0.26.0
  VLLM_WHEEL=$(ls "$WORK"/dl/vllm-0.26.0-*.whl)
fi

# 2. slim it: drop what a bf16 dense model on Hopper never loads
#    (FA2 kernels, MoE kernels, the Rust frontend, DeepGEMM for FP8, SM100 headers)
rm -rf "$WORK/site" && mkdir -p "$WORK/site"
(cd "$WORK/site" && python3 -m zipfile -e "$VLLM_WHEEL" .)
# MoE (scripts/gpu/moe.sh): the fused-MoE Triton path calls _moe_C's ops; its own chunk, since A and B are full.
xz -9e -T0 -c "$WORK/site/vllm/_moe_C_stable_libtorch.abi3.so" > "$OUTC/_moe_C_stable_libtorch.abi3.so.xz"
(cd "$WORK/site/vllm" && sha256sum _moe_C_stable_libtorch.abi3.so) > "$OUTC/_moe_C_stable_libtorch.abi3.so.sha256"
cp "$HERE/stash_c.sh" "$OUTC/stash_c.sh"
for d in vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/_moe_C_stable_libtorch.abi3.so vllm/vllm-rs \
         vllm/third_party/deep_gemm vllm/third_party/fmha_sm100; do rm -rf "$WORK/site/$d"; done
rm -f "$OUTA"/titan/*.whl "$OUTB"/wheels/*.whl
xz -9e -T0 -c "$WORK/site/vllm/_C_stable_libtorch.abi3.so" > "$WORK/_C.xz"
half=$(( ($(stat -c %s "$WORK/_C.xz") + 1) / 2 ))  # stash.sh joins the halves on the device
head -c "$half" "$WORK/_C.xz" > "$OUTA/_C_stable_libtorch.abi3.so.xz.part0"
tail -c +$((half + 1)) "$WORK/_C.xz" > "$OUTA2/_C_stable_libtorch.abi3.so.xz.part1"
rm -f "$OUTA/_C_stable_libtorch.abi3.so.xz"  # the whole file of earlier versions
(cd "$WORK/site/vllm" && sha256sum _C_stable_libtorch.abi3.so) > "$OUTA/_C_stable_libtorch.abi3.so.sha256"
(cd "$WORK/site" && tar --exclude=vllm/_C_stable_libtorch.abi3.so -cf - vllm vllm-0.26.0.dist-info) \
  | xz -9e -T0 > "$OUTB/vllm_rest.tar.xz"

# 3. what vLLM imports on the EngineArgs/LLMEngine path and the device image lacks
$PD -d "$OUTB/wheels" \
  pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 \
  fastapi==0.136.3 starlette==1.10.0 \
  openai==2.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 openai-harmony==0.0.8 \
  cbor2==6.2.1 pyzmq==27.3.0 msgspec==0.22.0 pybase64==1.5.1 cachetools==8.0.0 \
  llguidance==1.7.6 xgrammar==0.2.7 apache-tvm-ffi==0.1.10 partial-json-parser==0.2.1.1.post7 \
  setproctitle==1.3.8 blake3==1.0.11

# 4. torchtitan and what our trainer/generator import from it. Everything else
#    torchtitan_rl imports (tqdm, tensorboard, matplotlib, safetensors,
#    tokenizers) is in the device image. vLLM's IPC weight-transfer engine
#    imports `ray` at module level; scripts/gpu/stubs/ray (in the repo, it
#    travels with the tree) stands in for it in the sync benchmark.
$PD -d "$OUTA/titan" torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 \
  typeguard==4.6.0 torchdata==0.11.0 \
  math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2  # grpo/rewards.py imports math_verify in every run

cp "$HERE/stash.sh" "$OUTA/stash.sh"
cp "$HERE/stash.sh" "$OUTA2/stash.sh"
cp "$HERE/install.sh" "$OUTB/install.sh"
du -sh "$OUTA" "$OUTA2" "$OUTB" "$OUTC"
