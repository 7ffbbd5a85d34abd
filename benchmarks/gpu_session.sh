#!/usr/bin/env bash
# The GPU checks of a session lent one CUDA machine (see benchmarks/README.md, "GPU runs"):
# calibration, one tensor-parallel rank's layer timed against the cost model (layer_gpu.py),
# activation memory per layer (activations_gpu.py), real models against eager (real_models_gpu.py),
# bandwidth by tensor size (bandwidth_gpu.py), a profile of the single-GPU cases
# (step_profile_gpu.py), then fidelity_gpu.py. Result files are
# copied to OUT after each step: a device machine's tree is re-synced from the caller's on the
# next call, so results left in the tree are lost.
# Run from the repository root on that machine; OUT names where results go (default /tmp/gpu-out).
# Python packages the machine's image lacks travel as wheels in .whl/ (highspy, jsonschema and
# its dependencies); the image's own torch is used, whatever its version.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
python3 -c "import torch, autopar; print('torch', torch.__version__, 'autopar', autopar.__version__, torch.cuda.get_device_name(0))"
# CALIBRATED=FILE reuses a cluster file calibrated on this kind of GPU before (saves ~2.5 minutes)
if [ -n "${CALIBRATED:-}" ]; then cp "$CALIBRATED" "$OUT/cluster-gpu.json"
else timeout 150 python3 -m autopar.cli calibrate --quick --out "$OUT/cluster-gpu.json" 2>&1 | tail -40; fi
cal=(); [ -f "$OUT/cluster-gpu.json" ] && cal=(--calibrated "$OUT/cluster-gpu.json")
timeout "${LAYER_TIMEOUT:-150}" python3 -m benchmarks.layer_gpu 2>&1 | tee "$OUT/layer_gpu.log" | cut -c1-300
cp benchmarks/results/layer_gpu-gpu-*.json "$OUT/" 2>/dev/null
timeout "${ACTIVATIONS_TIMEOUT:-150}" python3 -m benchmarks.activations_gpu 2>&1 | tee "$OUT/activations_gpu.log"
timeout "${REAL_MODELS_TIMEOUT:-300}" python3 -m benchmarks.real_models_gpu --budget-s 220 2>&1 | tee "$OUT/real_models_gpu.log" | grep -v "^{"
timeout 60 python3 -m benchmarks.bandwidth_gpu 2>&1 | tee "$OUT/bandwidth_gpu.log" | tail -3
timeout "${PROFILE_TIMEOUT:-120}" python3 -m benchmarks.step_profile_gpu 2>&1 | tee "$OUT/step_profile_gpu.log" | cut -c1-300
timeout "${FIDELITY_TIMEOUT:-330}" python3 -m benchmarks.fidelity_gpu "${cal[@]}" "$@" 2>&1 | tee "$OUT/fidelity_gpu.log"
cp benchmarks/results/*-gpu-*.json "$OUT/" 2>/dev/null
cp benchmarks/README.md "$OUT/README.bench.md" 2>/dev/null
ls -la "$OUT"
