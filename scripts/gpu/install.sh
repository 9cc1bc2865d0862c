#!/bin/bash
# Copied to .gpu/b/ by scripts/gpu/prepare.sh. Device call 2 (carry .gpu/b), right after call 1 on the same warm machine:
#     source .gpu/b/install.sh && python3 -m your.module ...
# Installs vLLM 0.26.0 and torchtitan into /tmp/site (3 s; skipped if already
# there) and exports the environment they need on that machine.
if [ ! -f /tmp/site/vllm/_C_stable_libtorch.abi3.so ]; then
  if [ ! -f /tmp/stash/MARK_A ]; then
    echo "STASH_GONE: the machine went cold after call 1; repeat both calls" >&2; return 3 2>/dev/null || exit 3
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/b/wheels/*.whl /tmp/stash/titan/*.whl || { echo "PIP_FAILED" >&2; return 4 2>/dev/null || exit 4; }
  python3 - <<'PY' || { echo "EXTRACT_FAILED" >&2; return 5 2>/dev/null || exit 5; }
import hashlib, lzma, shutil, tarfile
tarfile.open(".gpu/b/vllm_rest.tar.xz").extractall("/tmp/site")
so = "/tmp/site/vllm/_C_stable_libtorch.abi3.so"
with lzma.open("/tmp/stash/_C_stable_libtorch.abi3.so.xz") as f, open(so, "wb") as g:
    shutil.copyfileobj(f, g, 1 << 24)
want = open("/tmp/stash/_C_stable_libtorch.abi3.so.sha256").read().split()[0]
assert hashlib.sha256(open(so, "rb").read()).hexdigest() == want, "vLLM _C checksum mismatch"
PY
fi
if [ -f /tmp/stash/_moe_C_stable_libtorch.abi3.so ] && [ ! -f /tmp/site/vllm/_moe_C_stable_libtorch.abi3.so ]; then
  cp /tmp/stash/_moe_C_stable_libtorch.abi3.so /tmp/site/vllm/  # chunk C (MoE), stashed by .gpu/c/stash_c.sh
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_USE_FLASHINFER_SAMPLER=0   # flashinfer is not shipped
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())"
