#!/bin/bash
# Copied to .gpu/a/ by scripts/gpu/prepare.sh. Device call 1 (carry .gpu/a): keep chunk A in /tmp/stash until call 2, which
# must follow within about 30 s (the machine stays warm that long).
set -eu
mkdir -p /tmp/stash
cp -r .gpu/a/. /tmp/stash/
date +%s > /tmp/stash/MARK_A
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "stashed chunk A: $(du -sh /tmp/stash | cut -f1)"
