#!/bin/bash
# The box check that fits one lease: one call, under 9 minutes of wall time on a bare H200 (the
# image's python3 3.12 with torch 2.11 for CUDA, transformers, peft, pytest, pyyaml, psutil,
# aiofiles; trl, where a stage needs it, travels as a wheel in .whl/). Run it first when a box
# is lent:
#     bash bench/gpu_check.sh [OUT]        (default ./gpu-check)
# Stages, most valuable first, each under a time limit of its own so that the whole fits; a
# stage past its limit is recorded as such and the next one runs:
#   tests      every test marked gpu (in-process, through the service, tier: auto, compact
#              states, the device paths the simulated accelerator checks in CI)
#   kernels    the native AdamW kernels, the AVX-512 loop included (CI's CPUs lack it)
#   sanitizer  the GPU parity tests once under PyTorch's CUDA sanitizer: the real GPU's answer
#              to what the simulated accelerator checks
#   node       this node's rates (tiered node --json, its drive too): commit it as
#              bench/node_h200.json
#   steps      the 2.78 B GPT at batch 8, one mode a stage, most valuable first: tiered cpu.yaml
#              with the delayed update through the node's service (the product's default,
#              which crashed on its first step before issue 31), everything on the GPU (the
#              speed of light), tier: auto, FSDP2's CPU offload (a peer measured on the H100)
# Writes OUT/gpu_check.json (every stage's status, time and figures) and prints its table.
# Limits from the H100 box's figures (bench/on_gpu_box.sh's header: the gpu tests took 2.7 min
# there with test_adamw.py, which moved to the kernels stage) and from the parts timed on this
# project's 2-core CPU machine (bench/RESULTS.md, "The box check"); a mode's limit is its
# setup (materializing and pinning 2.78 B parameters) and 5 steps at its expected step time.
set -o pipefail
out=${1:-gpu-check}
mkdir -p "$out"
rm -f "$out/stages.jsonl"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi

stage() {  # stage NAME SECONDS COMMAND...: run it, log it, record its status and time
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    echo "{\"stage\": \"$name\", \"rc\": $rc, \"limit_s\": $limit," \
         "\"seconds\": $((SECONDS - start))}" >> "$out/stages.jsonl"
    echo "gpu_check: $name: exit $rc after $((SECONDS - start)) s (limit $limit s)"
}

pytest=(python3 -m pytest -q -p no:cacheprovider)
stage tests 130 "${pytest[@]}" -m gpu tests
stage kernels 45 "${pytest[@]}" tests/optim/test_kernels_isa.py -k "not two_ranks"
stage sanitizer 60 env TORCH_CUDA_SANITIZER=1 "${pytest[@]}" tests/device/test_gpu.py \
    -k "fp32_matches_pytorch or bf16_matches_autocast"
mkdir -p "$out/nvme"
stage node 40 python3 -m tiered.launch.cli node --json --remeasure --nvme "$out/nvme"
step() {  # step NAME SECONDS MODE: one mode's step time at batch 8 (--warmup 3: see +dpu)
    # GPU_CHECK_MODEL (e.g. "--layers 2 --dim 256 --seq 128"): a smaller model, for a dry run
    # of this script on a CPU machine.
    stage "step_$1" "$2" python3 bench/bench_offload.py --batch 8 --steps 5 --warmup 3 \
        ${GPU_CHECK_MODEL:-} --modes "$3" --out "$out/step_$1.json"
}
step service 100 tiered:cpu+dpu+service
step gpu 40 gpu
step auto 80 tiered:auto
step fsdp2 60 fsdp2_offload
python3 bench/gpu_check_summary.py "$out"
