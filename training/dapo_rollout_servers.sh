#!/usr/bin/env bash
# DAPO with the rollouts on GPUs of their own (issue 51; docs/multi_gpu.md, "Rollouts on their own GPUs"): one rollout
# server per GPU of ROLLOUT_GPUS (python -m qerl.rollout_server, each with its own port and seed), the trainer on
# TRAIN_GPUS (one GPU: python -m qerl.train; several: accelerate launch with configs/accelerate/ddp.yaml), sampling
# every round on the servers (--rollout-backend server). The servers stop when the run ends; their logs are
# CKPTS_DIR/rollout-server-N.log. The trainer waits for them (--rollout-server-timeout, 600 s by default).
#
# From the user: MODEL_PATH (required: the base checkpoint folder the servers load too; python -m qerl.quantize makes
# an NVFP4 one), CONFIG (default configs/dapo_gsm8k_nvfp4.yaml), ROLLOUT_GPUS and TRAIN_GPUS (comma-separated GPU
# indices, default 1 and 0), PORT (the first server's, default 8001; the next take the ports after it), LORA_RANK (the
# largest the servers take, default 16: the recipes'), ENGINE (the servers' engine: native, the default, or vllm),
# SERVER_MEMORY (with ENGINE=vllm: vLLM's share of a server's GPU, default 0.85), CKPTS_DIR (default
# ./ckpt/<run name>), PYTHON, DRY_RUN=1 (print the commands instead of running them). Extra flags go to qerl.train and
# override the recipe.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL_PATH="${MODEL_PATH:?set MODEL_PATH to the base checkpoint folder (python -m qerl.quantize makes an NVFP4 one)}"
CONFIG="${CONFIG:-configs/dapo_gsm8k_nvfp4.yaml}"
ROLLOUT_GPUS="${ROLLOUT_GPUS:-1}"
TRAIN_GPUS="${TRAIN_GPUS:-0}"
PORT="${PORT:-8001}"
LORA_RANK="${LORA_RANK:-16}"
ENGINE="${ENGINE:-native}"
SERVER_MEMORY="${SERVER_MEMORY:-0.85}"
PYTHON="${PYTHON:-python}"
IFS=, read -ra rollout_gpus <<< "$ROLLOUT_GPUS"
IFS=, read -ra train_gpus <<< "$TRAIN_GPUS"
runname="$(basename "$CONFIG" .yaml)_servers${#rollout_gpus[@]}_trainers${#train_gpus[@]}"
CKPTS_DIR="${CKPTS_DIR:-./ckpt/${runname}}"

engine=(--engine "$ENGINE")
[ "$ENGINE" = vllm ] && engine+=(--gpu-memory-utilization "$SERVER_MEMORY")
servers=()
pids=()
trap '[ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2> /dev/null || true' EXIT
for i in "${!rollout_gpus[@]}"; do
    port=$((PORT + i))
    servers+=("http://127.0.0.1:${port}")
    # Seeds of their own: servers seeded alike would draw the same completions for the same prompts.
    server=(env CUDA_VISIBLE_DEVICES="${rollout_gpus[$i]}" "$PYTHON" -m qerl.rollout_server --model "$MODEL_PATH"
            --port "$port" --seed "$((i + 1))" --lora-rank "$LORA_RANK" "${engine[@]}")
    if [ -n "${DRY_RUN:-}" ]; then
        echo "${server[*]}"
    else
        mkdir -p "$CKPTS_DIR"
        "${server[@]}" > "$CKPTS_DIR/rollout-server-$i.log" 2>&1 &
        pids+=($!)
    fi
done

if [ ${#train_gpus[@]} -gt 1 ]; then
    launcher=(accelerate launch --config_file configs/accelerate/ddp.yaml --num_processes "${#train_gpus[@]}" -m qerl.train)
else
    launcher=("$PYTHON" -m qerl.train)
fi
${DRY_RUN:+echo} env CUDA_VISIBLE_DEVICES="$TRAIN_GPUS" "${launcher[@]}" \
    --config "$CONFIG" \
    --model-name "$MODEL_PATH" \
    --output-dir "$CKPTS_DIR" \
    --run-name "$runname" \
    --rollout-backend server \
    --rollout-servers "${servers[@]}" \
    --resume-from-checkpoint true \
    "$@"
