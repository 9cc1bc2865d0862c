#!/bin/bash
# Copied to .gpu/c/ by scripts/gpu/prepare.sh. An MoE device call (carry .gpu/c), after the stash of chunk A: puts
# vLLM's _moe_C library (the fused-MoE kernels' helper ops) into the installed tree, or into /tmp/stash for
# install.sh; checked against its sha256.
set -eu
mkdir -p /tmp/stash
cp .gpu/c/_moe_C_stable_libtorch.abi3.so.xz .gpu/c/_moe_C_stable_libtorch.abi3.so.sha256 /tmp/stash/
python3 - <<'PY'
import hashlib, lzma, os
for dest in ("/tmp/site/vllm", "/tmp/stash"):
    if os.path.isdir(dest):
        so = os.path.join(dest, "_moe_C_stable_libtorch.abi3.so")
        with lzma.open("/tmp/stash/_moe_C_stable_libtorch.abi3.so.xz") as f, open(so, "wb") as g:
            g.write(f.read())
        want = open("/tmp/stash/_moe_C_stable_libtorch.abi3.so.sha256").read().split()[0]
        assert hashlib.sha256(open(so, "rb").read()).hexdigest() == want, "MOE_C_CORRUPT"
        print("moe_C at", so)
PY
