#!/usr/bin/env bash
# Every GPU-only check of the open issues, in stages that each fit one 10-minute call on the lent H100.
#
#   bash benchmarks/gpu_session.sh STAGE [OUT]       # OUT defaults to $OUT, else runs/gpu
#
# Stages (in the order to run them; each tees its output to OUT/STAGE.log and writes JSON where it can):
#   tests     CUDA-only tests (CUDA-graph train step, graphed Whisper decoding, Flex/SDPA on the GPU)
#   dt        benchmarks/dt_throughput.py            bar: omni compile+graph >= 2.5x HF compiled (#7)
#   whisper   benchmarks/whisper_throughput.py       bars: train >= 1.3x HF compiled, decode >= 25k tok/s (#6)
#   packing   benchmarks/multimodal_packing.py       bar: packed Flex >= 1.5x padded SDPA useful tok/s (#5)
#   vit       benchmarks/vit_throughput.py (omni only, SDPA backend priorities) + cuda_checks.py (#4)
#   pendulum  recipes/decision_transformer.py on Pendulum-v1, DT only, default 10k steps (#7 quality)
# Python packages the device lacks (webdataset, soundfile, gymnasium, minari, ...) must be on PYTHONPATH
# already (see the device tool's README: carried wheels installed with pip --target).
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:?usage: gpu_session.sh STAGE [OUT]}
out=${2:-${OUT:-runs/gpu}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/$stage.log"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/$stage.log"

run() {  # one command, its output appended to the stage log; a failure does not stop the later ones
    echo "\$ $*" | tee -a "$out/$stage.log"
    "$@" 2>&1 | tee -a "$out/$stage.log"
}

case "$stage" in
tests)
    run python -m pytest -q tests/test_cuda_graphs.py tests/test_whisper_decode_graph.py tests/test_trunk.py
    ;;
dt)
    run python benchmarks/dt_throughput.py --out "$out/dt_throughput.json"
    ;;
whisper)
    run python benchmarks/whisper_throughput.py --only train --out "$out/whisper_train.json"
    run python benchmarks/whisper_throughput.py --only decode --out "$out/whisper_decode.json"
    ;;
packing)
    run python benchmarks/multimodal_packing.py --out "$out/multimodal_packing.json"
    ;;
vit)
    run python benchmarks/cuda_checks.py
    run python benchmarks/vit_throughput.py --only omni --sdpa cudnn,flash,efficient --profile
    run python benchmarks/vit_throughput.py --only omni,timm --modes compile
    ;;
pendulum)
    run python recipes/decision_transformer.py --env Pendulum-v1 --out "$out/dt-pendulum" \
        --set "methods=['dt']" "target_fractions=[1.0,0.75,0.5,0.25,0.0]" progress=False log_every=1000
    ;;
*)
    echo "unknown stage $stage (tests, dt, whisper, packing, vit, pendulum)" >&2
    exit 2
    ;;
esac
