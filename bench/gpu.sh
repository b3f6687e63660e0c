#!/usr/bin/env bash
# The GPU suite on a machine that reaches no package registry (`make bench-gpu`).
#
# The GPU image has jax with its CUDA plugin, flax, optax, orbax-checkpoint and
# tokenizers; the rest of mjax's dependencies travel as wheels in .whl/, made
# beforehand on a machine with registry access by `make gpu-wheels`. They are
# installed into a private folder, so nothing of the image is replaced.
# Arguments go to bench/gpu_suite.py (e.g. --sections mfu --mfu_rows 1p3b).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SITE=${MJAX_GPU_SITE:-/tmp/mjax-site}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" .whl/*.whl || { echo "bench-gpu: installing .whl/*.whl failed" >&2; exit 2; }
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
missing=$($PY - <<'PY'
import importlib.util
need = ['jax', 'flax', 'optax', 'orbax.checkpoint', 'grain', 'gin', 'tokenizers', 'tensorboardX', 'tqdm']
print(' '.join(n for n in need if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
  echo "bench-gpu: missing Python packages: $missing. Run 'make gpu-wheels' on a machine with" \
       "registry access and bring .whl/ along (it is git-ignored: carry it)." >&2
  exit 2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec $PY bench/gpu_suite.py "$@"
