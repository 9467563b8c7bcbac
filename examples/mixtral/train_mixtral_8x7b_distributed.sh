#!/usr/bin/env bash
# Upstream Megatron-LM's Mixtral 8x7B recipe (examples/mixtral/train_mixtral_8x7b_distributed.sh): 32 layers, hidden
# 4096, 32 heads with 8 key/value groups, every layer a Mixture of Experts of 8 SwiGLU experts (FFN 14336), top-2
# with a load-balancing loss, RoPE (base 1e6) over 4096 of 32768 positions; PP 4 x EP 8 with the distributed
# optimizer, alltoall dispatch, grouped GEMM, bf16.
#
#   DATA_PATH=/data/mixtral_text_document TOKENIZER_MODEL=/models/mixtral/tokenizer.model \
#       NNODES=4 NODE_RANK=<this node> MASTER_ADDR=<node 0> bash examples/mixtral/train_mixtral_8x7b_distributed.sh
#   TINY=1 bash examples/mixtral/train_mixtral_8x7b_distributed.sh    # the same flags, shrunk: 2 CPU ranks, gloo
#   PRINT_ARGS=1 bash examples/mixtral/train_mixtral_8x7b_distributed.sh   # print the pretrain_gpt.py flags
#
# PP 4 x EP 8 needs 32 GPUs (4 nodes of 8). Without DATA_PATH the run trains on mock data (NullTokenizer,
# Mixtral's 32000 ids). TINY=1 keeps every training flag but shrinks the model (2 layers, hidden 64, 4 experts of
# FFN 128, a 1024-id vocabulary) and the schedule, splits the experts EP 2 over 2 CPU ranks joined by gloo, trains
# TRAIN_ITERS (default 10) iterations on mock data and writes under RUN_DIR. Extra arguments are passed on to
# pretrain_gpt.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "${REPO_ROOT}/examples/recipe_launch.sh"
refuse_positional_arguments "CHECKPOINT_DIR, TOKENIZER_MODEL, DATA_PATH" "$@"
TINY="${TINY:-0}"
DATA_PATH="${DATA_PATH:-}"

if [[ "${TINY}" == 1 ]]; then
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/mixtral_8x7b_tiny}"
    NUM_LAYERS=2 HIDDEN=64 FFN=128 HEADS=4 QUERY_GROUPS=2 SEQ=64 MAX_POSITIONS=512 EXPERTS=4 VOCAB=1024
    GLOBAL_BATCH=8 TRAIN_ITERS="${TRAIN_ITERS:-10}" DECAY_ITERS="${TRAIN_ITERS}" WARMUP_ITERS=1
    PP=1 EP=2
    SAVE_INTERVAL=1000 EVAL_INTERVAL=1000 EVAL_ITERS=1
    BACKEND=gloo
    NUM_WORKERS=0
else
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/mixtral_8x7b}"
    NUM_LAYERS=32 HIDDEN=4096 FFN=14336 HEADS=32 QUERY_GROUPS=8 SEQ=4096 MAX_POSITIONS=32768 EXPERTS=8 VOCAB=32000
    GLOBAL_BATCH=256 TRAIN_ITERS=500000 DECAY_ITERS=320000 WARMUP_ITERS=500
    PP=4 EP=8
    SAVE_INTERVAL=10000 EVAL_INTERVAL=1000 EVAL_ITERS=10
    BACKEND=nccl
    NUM_WORKERS=2
fi
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${RUN_DIR}/checkpoints}"

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length "${SEQ}"
    --max-position-embeddings "${MAX_POSITIONS}"
    --num-layers "${NUM_LAYERS}"
    --hidden-size "${HIDDEN}"
    --ffn-hidden-size "${FFN}"
    --num-attention-heads "${HEADS}"
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups "${QUERY_GROUPS}"
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)
MOE_ARGS=(
    --num-experts "${EXPERTS}"
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --overlap-param-gather
    --overlap-grad-reduce
)
if [[ -n "${DATA_PATH}" ]]; then
    DATA_ARGS=(
        --tokenizer-type Llama2Tokenizer
        --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Mixtral tokenizer.model}"
        --data-path "${DATA_PATH}"
    )
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB}")
fi
DATA_ARGS+=(--split 99990,8,2 --num-workers "${NUM_WORKERS}")
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size "${GLOBAL_BATCH}"
    --lr 1e-4
    --train-iters "${TRAIN_ITERS}"
    --lr-decay-iters "${DECAY_ITERS}"
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters "${WARMUP_ITERS}"
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size "${PP}"
    --expert-model-parallel-size "${EP}"
    --use-distributed-optimizer
    --sequence-parallel
    --distributed-backend "${BACKEND}"
)
LOGGING_ARGS=(
    --log-interval 1
    --save-interval "${SAVE_INTERVAL}"
    --eval-interval "${EVAL_INTERVAL}"
    --eval-iters "${EVAL_ITERS}"
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --tensorboard-dir "${CHECKPOINT_DIR}/tensorboard"
    --no-load-optim
    --no-load-rng
)
ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}"
      "${LOGGING_ARGS[@]}" "$@")

launch_recipe "${ARGS[@]}"
