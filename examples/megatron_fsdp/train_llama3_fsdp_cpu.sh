#!/usr/bin/env bash
# Upstream Megatron-LM's Megatron-FSDP Llama-3 8B recipe (examples/megatron_fsdp/train_llama3_8b_fsdp_h100_fp8.sh),
# scaled down to run on CPU with gloo: the same flags, with the sizes, sample counts and intervals shrunk.
#
#   bash examples/megatron_fsdp/train_llama3_fsdp_cpu.sh [extra pretrain_gpt.py flags]
#   PRINT_ARGS=1 bash examples/megatron_fsdp/train_llama3_fsdp_cpu.sh   # print the pretrain_gpt.py flags, run nothing
#
# Dropped from the upstream recipe because they need GPUs: the NCCL user-buffer flags (--use-nccl-ub,
# --fsdp-manual-registration), its FP8 flags (an H100 FP8 recipe; FP8 on CPU is for correctness, not speed) and
# Transformer Engine's fused attention backend; context parallelism stays at 1. Mock data stands in for the
# recipe's dataset; the TikTokenizer vocabulary is a byte-level one written on first use (256 byte tokens after
# upstream's 1000 special ids).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "${REPO_ROOT}/examples/recipe_launch.sh"
refuse_positional_arguments "CHECKPOINT_DIR, TENSORBOARD_DIR, TOKENIZER_MODEL" "$@"
RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/llama3_fsdp_cpu}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${RUN_DIR}/checkpoints}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-${RUN_DIR}/tensorboard}"
TOKENIZER_MODEL="${TOKENIZER_MODEL:-${RUN_DIR}/byte_tiktoken.json}"
NPROC="${NPROC:-2}"

MODEL_ARGS=(
    --use-mcore-models
    --num-layers 2
    --hidden-size 64
    --ffn-hidden-size 224
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --kv-channels 16
    --seq-length 64
    --max-position-embeddings 64
    --position-embedding-type rope
    --rotary-base 1000000
    --rotary-percent 1.0
    --normalization RMSNorm
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 8
    --train-samples 160
    --lr-decay-samples 156
    --lr-warmup-samples 16
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)
DDP_ARGS=(
    --use-megatron-fsdp
    --data-parallel-sharding-strategy optim_grads_params
    --no-gradient-accumulation-fusion
    --use-distributed-optimizer
    --init-model-with-meta-device
    --grad-reduce-in-bf16
    --fsdp-double-buffer
)
DATA_ARGS=(
    --mock-data
    --tokenizer-type TikTokenizer
    --tiktoken-pattern v2
    --tokenizer-model "${TOKENIZER_MODEL}"
    --vocab-size 1256
    --split 99,1,0
    --num-workers 0
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --eval-iters 1
    --eval-interval 10
    --save-interval 10
    --log-throughput
    --distributed-timeout-minutes 60
    --ckpt-format fsdp_dtensor
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --tensorboard-dir "${TENSORBOARD_DIR}"
    --no-check-for-nan-in-loss-and-grad
    --logging-level 20
    --distributed-backend gloo
)
ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DDP_ARGS[@]}" "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@")

if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
    printf '%s\n' "${ARGS[@]}"
    exit 0
fi

mkdir -p "${RUN_DIR}"
if [[ ! -f "${TOKENIZER_MODEL}" ]]; then
    python -c "import base64, json, sys; json.dump([{'rank': i, 'token_bytes': base64.b64encode(bytes([i])).decode(), 'token_str': chr(i)} for i in range(256)], open(sys.argv[1], 'w'))" "${TOKENIZER_MODEL}"
fi
torchrun --standalone --nproc-per-node "${NPROC}" "${REPO_ROOT}/pretrain_gpt.py" "${ARGS[@]}"
