#!/bin/bash
# Copied to .gpu/a/ and .gpu/a2/ by scripts/gpu/prepare.sh. Device calls 1 and 2, `bash .gpu/a/stash.sh` (carry
# .gpu/a) and `bash .gpu/a2/stash.sh` (carry .gpu/a2), in either order: keep chunk A (vLLM's _C extension in two
# parts, since the tree and the whole of it pass 64 MiB, and torchtitan's wheels) in /tmp/stash until the call that
# sources .gpu/b/install.sh, which must follow within about 30 s (the machine stays warm that long).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p /tmp/stash
cp -r "$here"/. /tmp/stash/
so=/tmp/stash/_C_stable_libtorch.abi3.so.xz
if [ -f "$so.part0" ] && [ -f "$so.part1" ]; then
  cat "$so.part0" "$so.part1" > "$so" && rm "$so.part0" "$so.part1"
  date +%s > /tmp/stash/MARK_A
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  echo "stashed chunk A: $(du -sh /tmp/stash | cut -f1)"
else
  echo "stashed $(basename "$here") (chunk A's other part next: .gpu/a/stash.sh and .gpu/a2/stash.sh)"
fi
