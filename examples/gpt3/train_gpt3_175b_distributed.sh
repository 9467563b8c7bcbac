#!/usr/bin/env bash
# Upstream Megatron-LM's GPT-3 175B recipe (examples/gpt3/train_gpt3_175b_distributed.sh): 96 layers, hidden 12288,
# 96 heads, 2048 positions, TP 8 x PP 16 (128 GPUs per model replica), fp16, batch ramp-up 16 -> 1536.
#
#   DATA_PATH=/data/gpt2_text_document VOCAB_FILE=gpt2-vocab.json MERGE_FILE=gpt2-merges.txt \
#       NNODES=16 NODE_RANK=<this node> MASTER_ADDR=<node 0> bash examples/gpt3/train_gpt3_175b_distributed.sh
#   TINY=1 bash examples/gpt3/train_gpt3_175b_distributed.sh     # the same flags, shrunk: 2 CPU ranks, gloo
#   PRINT_ARGS=1 bash examples/gpt3/train_gpt3_175b_distributed.sh   # print the pretrain_gpt.py flags, run nothing
#
# Upstream's script counts --train-iters 500000 and --lr-decay-iters 430000, which its own argument check refuses
# with --rampup-batch-size (a ramp-up is defined on samples); here they are the same lengths in samples at the full
# batch of 1536: --train-samples 768000000 and --lr-decay-samples 660480000.
# Without DATA_PATH the run trains on mock data (NullTokenizer, GPT-2's 50257 ids). Extra arguments are passed on
# to pretrain_gpt.py. TINY=1 keeps every training flag but shrinks the model (4 layers, hidden 64, a 1024-id mock
# vocabulary as in the other recipes' tiny runs) and the batch, splits it TP 2 over 2 CPU ranks joined by gloo,
# trains the samples of TRAIN_ITERS (default 10) full batches on mock data (in one iteration more: the first two
# take batches of 4, the ramp-up) and writes under RUN_DIR.
# fp16 runs there as on a GPU, its dynamic loss scale starting at 2^16 (--initial-loss-scale 65536) instead of
# 2^32, which would skip a short run's every step as overflowed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "${REPO_ROOT}/examples/recipe_launch.sh"
refuse_positional_arguments "CHECKPOINT_DIR, TENSORBOARD_DIR, VOCAB_FILE, MERGE_FILE, DATA_PATH" "$@"
TINY="${TINY:-0}"
DATA_PATH="${DATA_PATH:-}"

if [[ "${TINY}" == 1 ]]; then
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/gpt3_175b_tiny}"
    NUM_LAYERS=4 HIDDEN=64 HEADS=4 SEQ=64 VOCAB=1024
    MICRO_BATCH=2 GLOBAL_BATCH=8 RAMPUP=(4 4 8)
    TRAIN_SAMPLES=$(( ${TRAIN_ITERS:-10} * GLOBAL_BATCH )) DECAY_SAMPLES=$(( ${TRAIN_ITERS:-10} * GLOBAL_BATCH ))
    TP=2 PP=1
    LOG_INTERVAL=1 SAVE_INTERVAL=1000 EVAL_INTERVAL=1000 EVAL_ITERS=1
    BACKEND=gloo
    NUM_WORKERS=0
    LOSS_SCALE_ARGS=(--initial-loss-scale 65536)
else
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/gpt3_175b}"
    NUM_LAYERS=96 HIDDEN=12288 HEADS=96 SEQ=2048 VOCAB=50257
    MICRO_BATCH=1 GLOBAL_BATCH=1536 RAMPUP=(16 16 5859375)
    TRAIN_SAMPLES=$(( 500000 * GLOBAL_BATCH )) DECAY_SAMPLES=$(( 430000 * GLOBAL_BATCH ))
    TP=8 PP=16
    LOG_INTERVAL=100 SAVE_INTERVAL=10000 EVAL_INTERVAL=1000 EVAL_ITERS=10
    BACKEND=nccl
    NUM_WORKERS=2
    LOSS_SCALE_ARGS=()
fi
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${RUN_DIR}/checkpoints}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-${RUN_DIR}/tensorboard}"

MODEL_ARGS=(
    --num-layers "${NUM_LAYERS}"
    --hidden-size "${HIDDEN}"
    --num-attention-heads "${HEADS}"
    --seq-length "${SEQ}"
    --max-position-embeddings "${SEQ}"
    --attention-backend auto
)
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH}"
    --global-batch-size "${GLOBAL_BATCH}"
    --rampup-batch-size "${RAMPUP[@]}"
    --train-samples "${TRAIN_SAMPLES}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    "${LOSS_SCALE_ARGS[@]}"
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-samples "${DECAY_SAMPLES}"
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP}"
    --pipeline-model-parallel-size "${PP}"
    --distributed-backend "${BACKEND}"
)
if [[ -n "${DATA_PATH}" ]]; then
    DATA_ARGS=(
        --data-path "${DATA_PATH}"
        --vocab-file "${VOCAB_FILE:?set VOCAB_FILE to gpt2-vocab.json}"
        --merge-file "${MERGE_FILE:?set MERGE_FILE to gpt2-merges.txt}"
        --split 949,50,1
    )
else
    DATA_ARGS=(
        --mock-data
        --tokenizer-type NullTokenizer
        --vocab-size "${VOCAB}"
        --split 949,50,1
    )
fi
DATA_ARGS+=(--num-workers "${NUM_WORKERS}")
EVAL_AND_LOGGING_ARGS=(
    --log-interval "${LOG_INTERVAL}"
    --save-interval "${SAVE_INTERVAL}"
    --eval-interval "${EVAL_INTERVAL}"
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --eval-iters "${EVAL_ITERS}"
    --tensorboard-dir "${TENSORBOARD_DIR}"
)
ARGS=("${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${EVAL_AND_LOGGING_ARGS[@]}" "$@")

launch_recipe "${ARGS[@]}"
