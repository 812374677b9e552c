#!/usr/bin/env bash
# The prepared GPU check (issue #25): every CUDA-only test, then short side-by-side benchmark rows, each peer in
# the same process on the same weights, in ONE device call of at most 8 minutes on one H100 / H200.
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--only PART,...] [--budget SECONDS]   # on the GPU machine
#   bash benchmarks/gpu_check.sh --dry-run --out DIR     # every part at toy sizes on the CPU (tests/test_gpu_check.py)
#   bash benchmarks/gpu_check.sh --fetch-wheels          # HERE, before the call: the wheels the device lacks -> .whl/
#
# The device call (device tool `run`; see /work/.library/device/README.md), with the wheels carried along:
#   run(command="bash benchmarks/gpu_check.sh", carry=[".whl"], timeout_s=540)
# then copy the section it prints (also $OUT/results_section.md) into benchmarks/results.md. With the machine's
# start that is ~10 of the 15 device minutes: a second call reruns only what failed or timed out, e.g.
#   run(command="bash benchmarks/gpu_check.sh --only whisper,interop --budget 200", carry=[".whl"], timeout_s=260)
#
# Parts, in order, with their time budgets on the GPU (seconds; each part runs under `timeout`, so one hang costs
# only its own budget, and a part never gets more than what is left of --budget, default 470 s):
#   cuda-tests   90  pytest: CUDA-graph train step (fp32, compiled bf16), graphed Whisper decoding (eager/compiled/
#                    bf16, and with SuppressTokens / SuppressAtStart / TimestampRules)
#   fsdp2        25  omni.train under FSDP2 on the one GPU (rank 0 of 1: the wrapping, DTensor parameters, steps)
#   cuda-checks  35  benchmarks/cuda_checks.py: packed Flex vs dense SDPA (fwd+grads, fp32/bf16), compiled model with
#                    a BlockMask, KV cache, BlockMask build cost, packed Flex vs padded SDPA attention
#   train-check  40  tests/_train_gpu_check.py: Trainer on packed batches (Flex), bf16, fused AdamW, exact resume,
#                    eager and torch.compile
#   vit          70  benchmarks/vit_throughput.py: ViT-B/16 train, omni vs timm, both torch.compile (goal >= 1.3x)
#   whisper      75  benchmarks/whisper_throughput.py: Whisper-base train omni vs HF compiled (goal >= 1.6x); greedy
#                    decoding b16 x 128, GraphedGreedyDecoder(compile=True) (goal >= 50,000 tok/s) and eager
#   dt           35  benchmarks/dt_throughput.py: official-size DT, omni compile + whole-step graph vs HF compiled
#                    (goal >= 8x)
#   packing      45  benchmarks/multimodal_packing.py: packed Flex vs pad-to-max SDPA (goal >= 3x), fp32 check first
#   interop      55  benchmarks/interop_speed.py vit whisper: converted timm ViT-B/16 and Whisper-base vs their
#                    peers, compiled both sides (issue #18: >= 1.2x, >= 1.5x)
# (No newer benchmark has a GPU mode yet: long inputs and draft decoding get a part here when they do.)
#
# Output: DIR (default $OUT, else runs/gpu-check) holds three files, rewritten as parts finish (a call that times
# out keeps every finished part; the device tool brings back at most 8 files): gpu_check.json (every part's exit
# status, seconds, budget and results), gpu_check.log (all output) and, at the end, results_section.md (the dated
# Markdown section for benchmarks/results.md: exact command, device, torch version, one table). Scratch files go
# to a temporary folder.
#
# Wheels. The device image has torch, transformers, timm, accelerate, safetensors, tokenizers, tiktoken, numpy,
# pillow, tensorboard, pytest (KINDS.md's list) but not everything omni imports. `--fetch-wheels` (here, where pip
# reaches a registry) downloads, into .whl/ (ignored through .git/info/exclude), manylinux x86-64 CPython 3.12
# wheels of the packages in WHEELS below at the versions installed here, without dependencies, and builds wheels of
# the source-only ones in BUILT_WHEELS (the import is never run there: omni reads openai-whisper's files). The call then
# names ".whl" in carry (it counts towards the 64 MiB a call may carry), and this script installs them first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site
# A missing import shows up in the dry run here only if the venv lacks it too, so after adding an import to a
# part, check it against KINDS.md's package list and add its distribution to WHEELS.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="rapidfuzz"  # binary wheels: imported by omni (omni.speech, omni.evaluation); absent from the device image
# pure-Python packages published as source only, built into wheels here: openai-whisper holds the Whisper
# vocabulary files (omni.tokenizers.ranks.whisper_asset) that the converted Whisper-base (interop) reads
BUILT_WHEELS="openai-whisper"

dry=0 out=${OUT:-runs/gpu-check} only="" budget="" fetch=0
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry=1 ;;
        --out) out=${2:?--out needs a folder}; shift ;;
        --only) only=${2:?--only needs parts}; shift ;;
        --budget) budget=${2:?--budget needs seconds}; shift ;;
        --fetch-wheels) fetch=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --out DIR, --only PARTS, --budget S, --fetch-wheels)" >&2
           exit 2 ;;
    esac
    shift
done
# The dry run gives every part 3x its GPU budget (a loaded 2-core machine is slow to import and start): it checks
# that the parts run, not how fast.
scale=1; [ "$dry" = 1 ] && scale=3
budget=${budget:-$((470 * scale))}
PARTS="cuda-tests fsdp2 cuda-checks train-check vit whisper dt packing interop"
if ! [[ "$budget" =~ ^[0-9]+$ ]]; then
    echo "gpu_check.sh: --budget must be whole seconds, got '$budget'" >&2; exit 2
fi
for p in ${only//,/ }; do
    if [[ " $PARTS " != *" $p "* ]]; then
        echo "gpu_check.sh: --only: unknown part '$p' (parts: ${PARTS// /, })" >&2; exit 2
    fi
done
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python

if [ "$fetch" = 1 ]; then
    mkdir -p .git/info && touch .git/info/exclude
    grep -qxF /.whl/ .git/info/exclude || echo /.whl/ >> .git/info/exclude  # the wheels never get committed
    for name in $WHEELS; do
        version=$($PY -c "import importlib.metadata as m; print(m.version('$name'))") || exit 2
        $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d .whl "$name==$version" || exit 1
    done
    for name in $BUILT_WHEELS; do
        version=$($PY -c "import importlib.metadata as m; print(m.version('$name'))") || exit 2
        $PY -m pip wheel -q --no-deps --no-build-isolation -w .whl "$name==$version" || exit 1
    done
    ls -l .whl
    exit 0
fi
if [ "$dry" = 0 ] && [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then  # on the device (cp312 wheels)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

mkdir -p "$out"
work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
report=$out/gpu_check.json log=$out/gpu_check.log
rm -f "$report" "$out/results_section.md"
: > "$log"
export PYTHONUNBUFFERED=1
start=$(date +%s)
command="bash benchmarks/gpu_check.sh"
[ "$dry" = 1 ] && command+=" --dry-run"
[ -n "$only" ] && command+=" --only $only"
if [ "$dry" = 1 ]; then
    device="CPU ($(nproc) cores, dry run)"
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
else
    device=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
    device=${device:-no nvidia-smi}
fi
torch_version=$($PY -c "import importlib.metadata as m; print(m.version('torch'))" 2>> "$log") \
    || torch_version="not installed"
meta=(--meta "date=$(date -u '+%Y-%m-%d %H:%M UTC')" --meta "device=$device" --meta "torch=$torch_version"
      --meta "command=$command" --meta "dry_run=$dry")
echo "gpu_check: $device, torch $torch_version, dry run $dry, out $out" | tee -a "$log"

wanted() { [ -z "$only" ] || [[ ",$only," == *",$1,"* ]]; }

# part NAME BUDGET RESULT-FLAGS -- COMMAND...: run COMMAND under `timeout` (the smaller of BUDGET and what is left),
# its output into the log, then fold its results into the report. RESULT-FLAGS: gpu_report.py add's --json FILE /
# --junit FILE / --stdout-json FILE (the command's own output).
part() {
    local name=$1 want=$(($2 * scale)) flags=() now left limit rc t0 seconds
    shift 2
    while [ "$1" != "--" ]; do flags+=("$1"); shift; done
    shift
    wanted "$name" || return 0
    now=$(date +%s); left=$((budget - (now - start)))
    limit=$want; [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 5 ]; then
        echo "== $name: skipped, $left s of the $budget s budget left" | tee -a "$log"
        $PY benchmarks/gpu_report.py add "$report" "$name" --rc 124 --seconds 0 --budget "$want" "${meta[@]}"
        return 0
    fi
    echo "== $name (budget $want s, limit $limit s): $*" | tee -a "$log"
    t0=$(date +%s%N)
    timeout -k 10 "$limit" "$@" > "$work/$name.out" 2>&1
    rc=$?
    seconds=$(awk "BEGIN { printf \"%.1f\", ($(date +%s%N) - $t0) / 1e9 }")
    cat "$work/$name.out" >> "$log"
    tail -n 25 "$work/$name.out"
    echo "== $name: exit $rc after $seconds s" | tee -a "$log"
    $PY benchmarks/gpu_report.py add "$report" "$name" --rc "$rc" --seconds "$seconds" --budget "$want" \
        "${meta[@]}" "${flags[@]}" >> "$log" 2>&1
}

# The CUDA-only tests by node id (a renamed test fails here, in the dry run, instead of silently dropping out).
# On the CPU they are collected and skipped (skipif no CUDA): the dry run proves they import.
CUDA_TESTS=(
    "tests/test_cuda_graphs.py::test_cuda_graph_matches_eager"
    "tests/test_cuda_graphs.py::test_cuda_graph_compiled_bf16_matches_compiled_eager"
    "tests/test_cuda_graphs.py::test_graphed_decoding_with_logit_rules[cuda]"
    "tests/test_whisper_decode_graph.py::test_cuda_graph_equals_eager"
)
part cuda-tests 90 --junit "$work/cuda_tests.xml" -- \
    $PY -m pytest -q -rs -p no:cacheprovider --junitxml="$work/cuda_tests.xml" "${CUDA_TESTS[@]}"

# FSDP2 with one process: Accelerate's FSDP needs a process group, so the worker is started as rank 0 of 1.
port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
fsdp_env=(env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port)
[ "$dry" = 1 ] && fsdp_env+=(ACCELERATE_USE_CPU=1)
part fsdp2 25 --json "$work/fsdp2/rank0.json" -- \
    "${fsdp_env[@]}" $PY -m accelerate.commands.launch --config_file recipes/accelerate_fsdp2.yaml \
    --num_processes 1 --mixed_precision no tests/_fsdp2_worker.py vec "$work/fsdp2"

dry_flag=(); [ "$dry" = 1 ] && dry_flag=(--dry-run)
part cuda-checks 35 --json "$work/cuda_checks.json" -- \
    $PY benchmarks/cuda_checks.py "${dry_flag[@]}" --out "$work/cuda_checks.json"

# On the CPU, torch.compile is switched off (TORCHDYNAMO_DISABLE): the compile half then runs its code eagerly.
train_env=(env); [ "$dry" = 1 ] && train_env+=(TORCHDYNAMO_DISABLE=1 CUDA_VISIBLE_DEVICES=)
part train-check 40 --stdout-json "$work/train-check.out" -- \
    "${train_env[@]}" $PY tests/_train_gpu_check.py "$work/train"

if [ "$dry" = 1 ]; then
    vit=(--dry-run --only omni,timm --modes eager --train-only)
    whisper=(--dry-run --only train/hf/eager,train/omni/eager,decode/omni/eager,decode/omni/graph)
    dt=(--device cpu --only hf-eager,omni-graph --steps 1 --windows 1 --warmup 1 --batch 4)
    packing=(--device cpu --preset tiny --steps 1 --warmup 1 --row-length 1024 --tokens-per-step 2048
             --variants packed-flex,padded-max --check-samples 4 --pool 8)
    interop=(--device cpu --smoke)
else
    vit=(--only omni,timm --modes compile --train-only --steps 8 --warmup 3)
    whisper=(--only train/hf/compile,train/omni/compile,decode/omni/eager,decode/omni/graph+compile --steps 5
             --windows 2 --warmup 2 --decode-steps 2)
    dt=(--only hf-compile,omni-compile-graph --steps 50 --windows 3 --warmup 10)
    packing=(--variants packed-flex,padded-max --steps 5 --warmup 3)
    interop=(--modes compile --steps 8)
fi
part vit 70 --json "$work/vit.json" -- $PY benchmarks/vit_throughput.py "${vit[@]}" --out "$work/vit.json"
part whisper 75 --json "$work/whisper.json" -- \
    $PY benchmarks/whisper_throughput.py "${whisper[@]}" --out "$work/whisper.json"
part dt 35 --json "$work/dt.json" -- $PY benchmarks/dt_throughput.py "${dt[@]}" --out "$work/dt.json"
part packing 45 --json "$work/packing.json" -- \
    $PY benchmarks/multimodal_packing.py "${packing[@]}" --out "$work/packing.json"
part interop 55 --json "$work/interop.json" -- \
    $PY benchmarks/interop_speed.py vit whisper "${interop[@]}" --out "$work/interop.json"

if [ -f "$report" ]; then
    $PY benchmarks/gpu_report.py section "$report" --out "$out/results_section.md" | tee -a "$log"
else
    echo "gpu_check: no part ran (--only $only?)" | tee -a "$log"
    exit 2
fi
rm -rf "$work"
echo "gpu_check: done in $(( $(date +%s) - start )) s; results in $out" | tee -a "$log"
