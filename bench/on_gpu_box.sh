#!/bin/bash
# The GPU-box checks, one stage per call so each fits the box's 10-minute command limit:
#   bash bench/on_gpu_box.sh tests|offload|variants|hbm|tiled|io|nvme|large|clip|cpu|lora|load|service|reattach|warm|hf|auto|replan|compact|capacity [OUT]
# Each stage prints its table last and keeps logs and timelines in OUT (default ./gpu-out).
# Stage times measured on the H100 box (16 cores, 125 GiB, 64 GiB free disk), tenth session:
# tests 2.7 min, cpu 1.6 min, offload 6.3 min, lora 5 min, tiled 1.4 min, io 1.7 min; fourth
# session: nvme 3.6 min, large 6.1 min. Estimated: variants 5 min, hbm 5 min, clip 4 min, load
# 8 min, service 6 min, reattach 6 min, warm 6 min, hf 8 min, auto 9 min, replan 4 min, compact 8 min,
# capacity 9 min (the large stage's 6.1 min for 1.6x the parameters, one step fewer); nvme with its service
# twin since the thirteenth session, 7 min. Every tiered process spends 50-95 s in setup there, 25-36 s of it
# compiling the one-pass AdamW (inductor's cache hits, yet the compile stays 25 s; 2.4 s on the
# development machine).
set -o pipefail
stage=${1:?stage: tests, offload, variants, hbm, tiled, io, nvme, large, clip, cpu, lora, load, service, reattach, warm, hf, auto, replan, compact or capacity}
out=${2:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvme=${TIERED_NVME:-/tmp/tiered-nvme}
case $stage in
tests)
    { python -m pytest -q -p no:cacheprovider -m gpu tests \
        && python -m pytest -q -p no:cacheprovider tests/optim/test_adamw.py; } 2>&1 \
        | tee "$out/tests.log" ;;
offload)  # issue 3: batch 4 and 8, DPU off and on, beside the GPU-resident and FSDP2 baselines
    python bench/bench_offload.py --batches 4,8 --steps 7 --warmup 3 --trace "$out" \
        --out "$out/offload.json" \
        --modes gpu,fsdp2_offload,tiered:cpu,tiered:cpu+arrive,tiered:cpu+dpu 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/offload.log"
    for trace in "$out"/trace_*.json; do  # what limits each step (bench/trace_summary.py)
        echo "== $trace"; python bench/trace_summary.py "$trace"
    done | tee "$out/traces.txt" ;;
variants)  # issue 3: the CPU update's thread count end to end: the default (14 of 16 cores
    # with a GPU since the tenth session, 0.693 s against 0.802 s on 15) against 13 and 15
    python bench/bench_offload.py --batches 8 --steps 7 --warmup 3 --out "$out/variants.json" \
        --modes tiered:cpu+dpu,tiered:cpu+dpu+threads13,tiered:cpu+dpu+threads15 \
        2>&1 | grep -v -e Warning -e _conversion | tee "$out/variants.log" ;;
hbm)  # issue 3: what sets peak HBM at batch 8 (units.split_large off, prefetch depth 1)
    python bench/bench_offload.py --batches 8 --steps 7 --warmup 3 --out "$out/hbm.json" \
        --modes tiered:cpu+dpu,tiered:cpu+dpu+nosplit,tiered:cpu+dpu+depth1 \
        2>&1 | grep -v -e Warning -e _conversion | tee "$out/hbm.log" ;;
tiled)  # issue 5: throughput against nn.Linear, and a layer larger than a 2 GiB budget
    for splits in 1x4 2x2; do
        python bench/bench_tiled.py throughput --splits $splits 2>&1 | grep '^{'
    done | tee "$out/tiled.log"
    python bench/bench_tiled.py big --in 32768 --out 65536 --hbm 2GiB 2>&1 | grep '^{' \
        | tee -a "$out/tiled.log" ;;
io)  # issue 4: the engine at its defaults against the sweep on this disk
    mkdir -p "$nvme"
    python -m tiered.launch.cli bench-io --nvme "$nvme" --size 4GiB --sweep-size 1GiB --repeats 3 2>&1 \
        | tee "$out/io.log" ;;
nvme)  # issue 4: ZeRO-Infinity's placement (params and optimizer on NVMe), 2.78 B, batch 8; and
    # issue 18: the same with the files and the update in the node's service
    mkdir -p "$nvme"
    python bench/bench_offload.py --modes tiered:nvme,tiered:nvme+service --nvme "$nvme" --steps 3 \
        --out "$out/nvme.json" 2>&1 | grep -v -e Warning -e _conversion | tee "$out/nvme.log" ;;
large)  # issue 4: 10.1 B parameters in 104 GiB of DRAM plus the disk (compact gradients)
    mkdir -p "$nvme"
    python bench/bench_offload.py --layers 40 --dim 4480 --batch 1 --modes tiered:cpu+arrive \
        --nvme "$nvme" --steps 3 --out "$out/large.json" \
        --set '{"dram": {"budget": "104GiB", "spill": "nvme"}}' 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/large.log" ;;
cpu)  # issue 3: the CPU update alone, beside DMA, on huge pages; run twice: is the compile cached?
    { lscpu | grep -E 'Model name|Socket|Core|Thread|NUMA|L3'
      grep -H . /sys/kernel/mm/transparent_hugepage/{enabled,defrag,shmem_enabled}; } \
        | tee "$out/cpu.log"  # the memory system the update runs on
    for run in 1 2; do
        python bench/bench_cpu_update.py 2>&1 | grep -v -e Warning -e _conversion
    done | tee -a "$out/cpu.log"
    # issue 21: the native one-pass kernel against inductor's and the fused one, unit-sized
    python bench/bench_adamw_kernels.py --params 87e6 --repeats 11 2>&1 | tee -a "$out/cpu.log" ;;
clip)  # issue 3: clipping at batch 8; the norm is taken as gradients arrive (bench/RESULTS.md)
    python bench/bench_offload.py --batches 8 --steps 7 --warmup 3 --out "$out/clip.json" \
        --modes tiered:cpu+arrive,tiered:cpu+dpu --set '{"optimizer": {"max_grad_norm": 1.0}}' \
        2>&1 | grep -v -e Warning -e _conversion | tee "$out/clip.log" ;;
lora)  # frozen units: LoRA rank 16 fine-tuning of the 2.78 B GPT, batch 8, against the peers
    python bench/bench_offload.py --lora 16 --batches 8 --steps 7 --warmup 3 \
        --out "$out/lora.json" \
        --modes gpu,fsdp2_offload,tiered:cpu,tiered:cpu+arrive \
        2>&1 | grep -v -e Warning -e _conversion | tee "$out/lora.log" ;;
service)  # issue 18: DRAM from the node's service (shared memory the trainer registers with
    # CUDA itself) against the trainer's own pinned memory, one invocation
    python bench/bench_offload.py --batches 8 --steps 7 --warmup 3 --out "$out/service.json" \
        --modes tiered:cpu+dpu,tiered:cpu+dpu+service,tiered:cpu,tiered:cpu+service 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/service.log" ;;
reattach)  # issue 18: a relaunch taking a killed run's state over from the service, against
    # the same relaunch from a checkpoint on the box's disk (1.4 B GPT, cpu.yaml), one invocation
    python bench/bench_reattach.py --layers 16 --dim 2560 --dir "$nvme/reattach-ckpt" 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/reattach.log" ;;
warm)  # issue 18: three jobs in a row on one service, 2.78 B GPT (cpu.yaml): the first cold
    # (the service compiles, makes its segments), the others on its spare segments
    python bench/bench_warm_start.py --layers 32 --dim 2560 --jobs 3 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/warm.log" ;;
hf)  # issue 19: TieredTrainer (cpu.yaml, the delayed update) against Trainer with DeepSpeed
    # ZeRO-3 CPU offload, an HF Llama of 32 x 4096 (6.7 B), bf16, batch 8 x 1024, one invocation.
    # The image lacks the hf extra and DeepSpeed: their wheels come in WHEELS (carried).
    pip install -q --no-index --find-links "${WHEELS:-gpu-wheels}" transformers accelerate \
        peft trl deepspeed 2>&1 | tail -2
    python bench/bench_hf_trainer.py --layers 32 --dim 4096 --vocab 32000 --seq 1024 \
        --batch 8 --steps 6 --bf16 --delayed --modes tiered,deepspeed 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/hf.log" ;;
auto)  # issue 20: tier: auto, batch 8: the 2.78 B GPT against the GPU-resident step and cpu.yaml
    # with the delayed update, then the 6.5 B one (32 x 4096, too large for the GPU with AdamW)
    # against FSDP2's CPU offload, one invocation each; first this node's rates, which the plan
    # in each result's "plan" reads (the predicted step against the measured one).
    mkdir -p "$nvme"  # the rates without the drive are those the engines below read
    python -m tiered.launch.cli node --json > "$out/node.json"
    python -m tiered.launch.cli node --nvme "$nvme" --json | tee "$out/node_nvme.json"
    python bench/bench_offload.py --batches 8 --steps 7 --warmup 3 --out "$out/auto.json" \
        --modes gpu,tiered:cpu+dpu,tiered:auto,tiered:auto+dpu 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/auto.log"
    # Its activations (about 30 GB) outgrow the default reserve (a quarter of the budget).
    python bench/bench_offload.py --layers 32 --dim 4096 --batches 8 --steps 6 --warmup 3 \
        --out "$out/auto_6b.json" --modes tiered:auto+dpu,fsdp2_offload \
        --set '{"hbm": {"reserve": "36GiB"}}' 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/auto_6b.log" ;;
replan)  # issue 20: the re-plan after step 1. The 6.5 B GPT at batch 2 under auto.yaml with the
    # default reserve (a quarter of the budget, 20 GiB) keeps 17 units on the device; its
    # activations (8 GiB) leave room for 19, which the first step measures and moves.
    python -m tiered.launch.cli node --json > "$out/node.json"
    python bench/bench_offload.py --layers 32 --dim 4096 --batches 2 --steps 6 --warmup 3 \
        --out "$out/replan.json" --modes tiered:auto+dpu 2>&1 \
        | grep -v -e Warning -e _conversion | tee "$out/replan.log" ;;
compact)  # issue 21: ZeRO-Infinity's placement of the 2.78 B GPT with int8 moments against fp32
    # states (45.1 s/step in the fourth session), both in this stage
    mkdir -p "$nvme"
    for moments in fp32 int8; do
        python bench/bench_offload.py --modes tiered:nvme --nvme "$nvme" --steps 3 \
            --out "$out/compact_$moments.json" --set "{\"optimizer\": {\"moments\": \"$moments\"}}" \
            2>&1 | grep -v -e Warning -e _conversion
    done | tee "$out/compact.log" ;;
capacity)  # issue 21: the largest GPT bench_capacity.py plans with int8 moments (15.9 B: 49 x
    # 5120), trained in 104 GiB of DRAM plus the disk
    mkdir -p "$nvme"
    python bench/bench_offload.py --layers 49 --dim 5120 --batch 1 --modes tiered:cpu+arrive \
        --nvme "$nvme" --steps 2 --out "$out/capacity.json" \
        --set '{"dram": {"budget": "104GiB", "spill": "nvme"}, "optimizer": {"moments": "int8"}}' \
        2>&1 | grep -v -e Warning -e _conversion | tee "$out/capacity.log" ;;
load)  # pretrained weights: the 2.78 B GPT's bf16 safetensors into a model ready to train
    mkdir -p "$nvme"
    python bench/bench_load.py --layers 32 --dim 2560 --nvme "$nvme" \
        --modes read,torch,tiered:cpu,tiered:nvme \
        2>&1 | grep -v -e Warning -e _conversion | tee "$out/load.log" ;;
*)
    echo "unknown stage $stage: tests, offload, variants, hbm, tiled, io, nvme, large, clip," \
        "cpu, lora, load, service, reattach, warm, hf, auto, replan, compact, capacity" >&2
    exit 2 ;;
esac
