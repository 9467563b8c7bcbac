#!/usr/bin/env bash
# gpt-oss-20b pretraining: 24 layers, hidden 2880, 64 query heads of 64 with 8 key/value groups, every layer a
# Mixture of Experts of 32 experts (FFN 2880, top-4, router with a bias), biases on every linear layer, attention
# sinks (--softmax-type learnable), a 128-token sliding window on alternate layers (layers 1, 3, ... ; 2, 4, ...
# attend fully), the clamped quick-GeGLU (limit 7, linear offset 1), YaRN RoPE (base 150000, factor 32 over 4096
# positions: a 131072-position context), vocabulary 201088 (o200k_harmony). One node of 8 GPUs: EP 8 with the
# distributed optimizer, alltoall dispatch, bf16, sequences of 4096.
#
#   DATA_PATH=/data/oss_text_document TOKENIZER_MODEL=openai/gpt-oss-20b bash examples/gpt_oss/train_gpt_oss_20b.sh
#   TINY=1 bash examples/gpt_oss/train_gpt_oss_20b.sh            # the same flags, shrunk: 2 CPU ranks, gloo
#   PRINT_ARGS=1 bash examples/gpt_oss/train_gpt_oss_20b.sh      # print the pretrain_gpt.py flags, run nothing
#
# A checkpoint converted from Hugging Face (tools/checkpoint, docs/checkpointing.md) continues with --load <dir>
# --finetune. Without DATA_PATH the run trains on mock data (NullTokenizer).
# TINY=1 keeps every layer and training flag but shrinks the model (4 layers, hidden 64, 4 experts top-2, a window
# of 8, YaRN x32 over 64 positions, a 1024-id vocabulary) and the schedule, splits the experts EP 2 over 2 CPU ranks
# joined by gloo, trains TRAIN_ITERS (default 10) iterations on mock data and writes under RUN_DIR. Extra arguments
# are passed on to pretrain_gpt.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "${REPO_ROOT}/examples/recipe_launch.sh"
refuse_positional_arguments "CHECKPOINT_DIR, TENSORBOARD_DIR, TOKENIZER_MODEL, DATA_PATH" "$@"
TINY="${TINY:-0}"
DATA_PATH="${DATA_PATH:-}"

if [[ "${TINY}" == 1 ]]; then
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/gpt_oss_20b_tiny}"
    NUM_LAYERS=4 HIDDEN=64 HEADS=4 KV_CHANNELS=16 QUERY_GROUPS=2 EXPERTS=4 TOPK=2 EXPERT_FFN=64 VOCAB=1024
    SEQ=64 WINDOW="(7, 0)" YARN_ORIGINAL=64 MAX_POSITIONS=2048
    GLOBAL_BATCH=8 TRAIN_ITERS="${TRAIN_ITERS:-10}" DECAY_ITERS="${TRAIN_ITERS}" WARMUP_ITERS=1
    EP=2
    EVAL_ITERS=1 EVAL_INTERVAL=1000 SAVE_INTERVAL=1000 NUM_WORKERS=0
    BACKEND=gloo
else
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/gpt_oss_20b}"
    NUM_LAYERS=24 HIDDEN=2880 HEADS=64 KV_CHANNELS=64 QUERY_GROUPS=8 EXPERTS=32 TOPK=4 EXPERT_FFN=2880 VOCAB=201088
    SEQ=4096 WINDOW="(127, 0)" YARN_ORIGINAL=4096 MAX_POSITIONS=131072
    GLOBAL_BATCH=512 TRAIN_ITERS=100000 DECAY_ITERS=100000 WARMUP_ITERS=2000
    EP=8
    EVAL_ITERS=32 EVAL_INTERVAL=1000 SAVE_INTERVAL=1000 NUM_WORKERS=2
    BACKEND=nccl
fi
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${RUN_DIR}/checkpoints}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-${RUN_DIR}/tensorboard}"

MODEL_ARGS=(
    --use-mcore-models
    --num-layers "${NUM_LAYERS}"
    --hidden-size "${HIDDEN}"
    --ffn-hidden-size "${EXPERT_FFN}"
    --num-attention-heads "${HEADS}"
    --kv-channels "${KV_CHANNELS}"
    --group-query-attention
    --num-query-groups "${QUERY_GROUPS}"
    --add-qkv-bias
    --seq-length "${SEQ}"
    --max-position-embeddings "${MAX_POSITIONS}"
    --position-embedding-type yarn
    --rotary-base 150000
    --yarn-rotary-scaling-factor 32
    --yarn-original-max-position-embeddings "${YARN_ORIGINAL}"
    --yarn-beta-fast 32
    --yarn-beta-slow 1
    --no-yarn-correction-range-round-to-int
    --window-size "${WINDOW}"
    --window-attn-skip-freq 2
    --softmax-type learnable
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --quick-geglu
    --activation-func-clamp-value 7
    --glu-linear-offset 1
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)
MOE_ARGS=(
    --num-experts "${EXPERTS}"
    --moe-router-topk "${TOPK}"
    --moe-ffn-hidden-size "${EXPERT_FFN}"
    --moe-router-bias
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size "${GLOBAL_BATCH}"
    --train-iters "${TRAIN_ITERS}"
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-decay-iters "${DECAY_ITERS}"
    --lr-warmup-iters "${WARMUP_ITERS}"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size "${EP}"
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --distributed-backend "${BACKEND}"
)
if [[ -n "${DATA_PATH}" ]]; then
    DATA_ARGS=(--data-path "${DATA_PATH}" --tokenizer-type HuggingFaceTokenizer
               --tokenizer-model "${TOKENIZER_MODEL:-openai/gpt-oss-20b}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB}")
fi
DATA_ARGS+=(--split 99,1,0 --num-workers "${NUM_WORKERS}")
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --eval-iters "${EVAL_ITERS}"
    --eval-interval "${EVAL_INTERVAL}"
    --save-interval "${SAVE_INTERVAL}"
    --ckpt-format torch_dist
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --tensorboard-dir "${TENSORBOARD_DIR}"
)
ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}"
      "${EVAL_AND_LOGGING_ARGS[@]}" "$@")

launch_recipe "${ARGS[@]}"
