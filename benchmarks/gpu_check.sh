#!/usr/bin/env bash
# The GPU checks of issue 38, part 2, as one command on a CUDA machine. Two steps:
#   bash benchmarks/gpu_check.sh fetch   # here, with pip's registry: the wheels a bare GPU machine lacks
#   bash benchmarks/gpu_check.sh run     # there (OUT: where the logs go; default gpu_check_out/)
# `run` installs the fetched wheels (.whl/) into /tmp/site, names the GPU and driver, runs
# tests/test_cuda.py (every script trains on the GPU), then times ppo_atari.py against SB3 on
# Breakout (both on the GPU; eager, compiled, and 32 games) and the torch Pendulum with 4,096 games.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=(gymnasium==1.4.0 farama-notifications==0.0.6 ale-py==0.12.1 pettingzoo==1.27.0 mpe2==1.1.1
        pygame-ce stable-baselines3==2.9.2)

case "${1:-}" in
fetch)
    grep -qx "/.whl/" .git/info/exclude || echo "/.whl/" >>.git/info/exclude
    for wheel in "${WHEELS[@]}"; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
            --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 -d .whl "$wheel" || exit 1
    done
    du -sh .whl ;;
run)
    OUT="${OUT:-gpu_check_out}"
    mkdir -p "$OUT"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" \
        | tee -a "$OUT/gpu.txt"
    python3 -m pytest -q -p no:cacheprovider -n 4 tests/test_cuda.py 2>&1 | tee "$OUT/tests.log"
    python3 benchmarks/atari_throughput.py --steps 40960 --sb3-device cuda \
        --ours "eager:--no-compile" --ours "compiled:--compile" \
        --ours "32 games:--compile --num-envs 32" --json "$OUT/atari.json" 2>&1 | tee "$OUT/atari.log"
    python3 benchmarks/continuous_engines.py --num-envs 64 4096 --device cuda 2>&1 \
        | tee "$OUT/pendulum.log" ;;
*)
    echo "usage: bash benchmarks/gpu_check.sh fetch|run" >&2
    exit 2 ;;
esac
