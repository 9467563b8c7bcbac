#!/usr/bin/env bash
# Supervised fine-tuning (SFT) of the tiny GPT on chat conversations, on CPU: 2 ranks, gloo, about a minute.
#
#   bash examples/gpt/sft_gpt_tiny_cpu.sh [extra pretrain_gpt.py flags]
#
# The conversations (questions about the Python standard library answered by the first paragraph of the bundled
# corpus' docstrings) are built once into $CACHE_DIR/stdlib_qa.jsonl by tools/build_sft_conversations.py. The run
# starts from the latest checkpoint of examples/gpt/train_gpt_tiny_cpu.sh when there is one ($PRETRAINED, weights
# only, iteration 0) and otherwise from random weights; it saves to $OUTPUT_DIR/checkpoints, and the same command
# launched again resumes from there. The loss covers the assistant's replies only (chatml format); conversations
# are packed into rows of 512 tokens, each attending to itself only, so a micro-batch is one row.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-${REPO_ROOT}/runs/tiny_gpt}"
OUTPUT_DIR="${OUTPUT_DIR:-${CACHE_DIR}/sft}"
PRETRAINED="${PRETRAINED:-${CACHE_DIR}/run/checkpoints}"
NPROC="${NPROC:-2}"
TRAIN_ITERS="${TRAIN_ITERS:-100}"
CONVERSATIONS="${CACHE_DIR}/stdlib_qa.jsonl"

mkdir -p "${CACHE_DIR}" "${OUTPUT_DIR}"
if [[ ! -f "${CONVERSATIONS}" ]]; then
    python "${REPO_ROOT}/tools/build_sft_conversations.py" --output "${CONVERSATIONS}"
fi
START_ARGS=()
if [[ -f "${PRETRAINED}/latest_checkpointed_iteration.txt" ]]; then
    echo "starting from the pretrained checkpoint in ${PRETRAINED}"
    START_ARGS=(--pretrained-checkpoint "${PRETRAINED}")
else
    echo "no checkpoint in ${PRETRAINED} (run examples/gpt/train_gpt_tiny_cpu.sh first to fine-tune it): starting" \
         "from random weights"
fi

cd "${REPO_ROOT}"
exec torchrun --standalone --nproc-per-node "${NPROC}" pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 512 --max-position-embeddings 512 --position-embedding-type rope \
    --normalization RMSNorm --swiglu --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64 \
    --sft --sft-tokenizer-prompt-format chatml --data-path "${CONVERSATIONS}" --split 98,2,0 \
    --tokenizer-type ByteLevelTokenizer --num-workers 0 \
    --micro-batch-size 1 --global-batch-size 8 --train-iters "${TRAIN_ITERS}" \
    --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 \
    --seed 1234 --distributed-backend gloo --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --log-interval 10 --eval-interval 50 --eval-iters 4 --metrics-file "${OUTPUT_DIR}/metrics.jsonl" \
    --save "${OUTPUT_DIR}/checkpoints" --load "${OUTPUT_DIR}/checkpoints" --save-interval 50 --ckpt-format torch_dist \
    "${START_ARGS[@]}" "$@"
