#!/usr/bin/env bash
# Upstream Megatron-LM's Llama-3 8B recipe (examples/llama/train_llama3_8b_h100_fp8.sh): 32 layers, hidden 4096,
# FFN 14336, 32 heads with 8 key/value groups of 128, 8192 positions, vocabulary 128256; one node of 8 H100s in
# data parallel with the distributed optimizer (both overlaps), bf16 with FP8 (hybrid, delayed scaling, FP8
# parameter all-gather), per-token loss, sample-based schedule.
#
#   bash examples/llama/train_llama3_8b.sh                          # mock data, as upstream's default
#   DATA_PATH=/data/llama3_text_document TOKENIZER_MODEL=meta-llama/Meta-Llama-3-8B \
#       bash examples/llama/train_llama3_8b.sh
#   DTYPE=bf16 bash examples/llama/train_llama3_8b.sh               # without FP8
#   TINY=1 bash examples/llama/train_llama3_8b.sh                   # the same flags, shrunk: 2 CPU ranks, gloo
#   PRINT_ARGS=1 bash examples/llama/train_llama3_8b.sh             # print the pretrain_gpt.py flags, run nothing
#
# Differences from upstream's script: --attention-backend auto instead of fused (attention runs torch's
# scaled_dot_product_attention, which picks a flash kernel on H100 by itself), FP8 runs the torch-native backend
# unless --transformer-impl transformer_engine is added, and --rotary-base is Llama 3's 500000 (upstream's script
# has 1000000). TINY=1 keeps every training flag but shrinks the model (2 layers, hidden 64, a 1024-id vocabulary)
# and the schedule, trains TRAIN_ITERS (default 10) iterations on mock data over 2 CPU ranks joined by gloo (data
# parallel, distributed optimizer) and writes under RUN_DIR; FP8 there checks correctness, not speed.
# Extra arguments are passed on to pretrain_gpt.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "${REPO_ROOT}/examples/recipe_launch.sh"
refuse_positional_arguments "CHECKPOINT_DIR, TENSORBOARD_DIR, TOKENIZER_MODEL, DATA_PATH" "$@"
TINY="${TINY:-0}"
DTYPE="${DTYPE:-fp8}"
DATA_PATH="${DATA_PATH:-MOCK}"

if [[ "${TINY}" == 1 ]]; then
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/llama3_8b_tiny}"
    NUM_LAYERS=2 HIDDEN=64 FFN=224 HEADS=4 QUERY_GROUPS=2 KV_CHANNELS=16 SEQ=64 VOCAB=1024
    GLOBAL_BATCH=8
    TRAIN_SAMPLES=$(( ${TRAIN_ITERS:-10} * GLOBAL_BATCH ))
    DECAY_SAMPLES=$(( TRAIN_SAMPLES - 4 )) WARMUP_SAMPLES=8
    LOG_INTERVAL=1 EVAL_ITERS=1 EVAL_INTERVAL=1000 SAVE_INTERVAL=1000
    BACKEND=gloo
    NUM_WORKERS=0
else
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/llama3_8b}"
    NUM_LAYERS=32 HIDDEN=4096 FFN=14336 HEADS=32 QUERY_GROUPS=8 KV_CHANNELS=128 SEQ=8192 VOCAB=128256
    GLOBAL_BATCH=128
    TRAIN_SAMPLES=1953125000 DECAY_SAMPLES=1949218748 WARMUP_SAMPLES=3906252
    LOG_INTERVAL=1 EVAL_ITERS=32 EVAL_INTERVAL=100 SAVE_INTERVAL=1000
    BACKEND=nccl
    NUM_WORKERS=1
fi
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${RUN_DIR}/checkpoints}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-${RUN_DIR}/tensorboard}"
DATA_CACHE_DIR="${DATA_CACHE_DIR:-${RUN_DIR}/data_cache}"

MODEL_ARGS=(
    --use-mcore-models
    --num-layers "${NUM_LAYERS}"
    --hidden-size "${HIDDEN}"
    --ffn-hidden-size "${FFN}"
    --num-attention-heads "${HEADS}"
    --group-query-attention
    --num-query-groups "${QUERY_GROUPS}"
    --kv-channels "${KV_CHANNELS}"
    --seq-length "${SEQ}"
    --max-position-embeddings "${SEQ}"
    --position-embedding-type rope
    --rotary-base 500000
    --rotary-percent 1.0
    --normalization RMSNorm
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --swiglu
    --init-method-std 0.0134
    --attention-backend auto
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size "${GLOBAL_BATCH}"
    --train-samples "${TRAIN_SAMPLES}"
    --lr-decay-samples "${DECAY_SAMPLES}"
    --lr-warmup-samples "${WARMUP_SAMPLES}"
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
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
    --exit-duration-in-mins 235
)
DTYPE_ARGS=()
case "${DTYPE}" in
    fp8) DTYPE_ARGS=(--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather) ;;
    bf16) ;;
    *) echo "DTYPE=${DTYPE} is not one of fp8, bf16" >&2; exit 2 ;;
esac
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size 1
    --sequence-parallel
    --distributed-backend "${BACKEND}"
)
DDP_ARGS=(
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
if [[ "${DATA_PATH}" == MOCK ]]; then
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB}")
else
    DATA_ARGS=(--data-path "${DATA_PATH}" --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Llama 3 tokenizer}")
fi
DATA_ARGS+=(
    --data-cache-path "${DATA_CACHE_DIR}"
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files
    --num-workers "${NUM_WORKERS}"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval "${LOG_INTERVAL}"
    --eval-iters "${EVAL_ITERS}"
    --eval-interval "${EVAL_INTERVAL}"
    --save-interval "${SAVE_INTERVAL}"
    --log-throughput
    --ckpt-format torch_dist
    --distributed-timeout-minutes 60
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --tensorboard-dir "${TENSORBOARD_DIR}"
)
[[ "${TINY}" == 1 ]] || EVAL_AND_LOGGING_ARGS+=(--profile --profile-step-start 4 --profile-step-end 6)
ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DTYPE_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DDP_ARGS[@]}"
      "${DATA_ARGS[@]}" "${EVAL_AND_LOGGING_ARGS[@]}" "$@")

launch_recipe "${ARGS[@]}"
