#!/usr/bin/env bash
# Train a tiny hybrid Mamba model (Mamba-2, attention and MLP layers) on the bundled corpus on CPU: 2 ranks, gloo,
# Megatron-FSDP ZeRO-3, about a minute. The same data, shapes and schedule as examples/gpt/train_gpt_tiny_cpu.sh.
#
#   bash examples/mamba/train_mamba_tiny_cpu.sh [extra pretrain_mamba.py flags]
#
# PATTERN sets the layers (M Mamba, * attention, - MLP; default M*M-); TP=2 splits the Mamba mixers by groups.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-${REPO_ROOT}/runs/tiny_gpt}"
OUTPUT_DIR="${OUTPUT_DIR:-${REPO_ROOT}/runs/tiny_mamba}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
PATTERN="${PATTERN:-M*M-}"
DATA_PREFIX="${CACHE_DIR}/stdlib_docs"

mkdir -p "${CACHE_DIR}" "${OUTPUT_DIR}"
if [[ ! -f "${DATA_PREFIX}_text_document.idx" ]]; then
    python "${REPO_ROOT}/tools/preprocess_data.py" --input "${REPO_ROOT}/data/corpus/stdlib_docs.jsonl" \
        --output-prefix "${DATA_PREFIX}" --tokenizer-type ByteLevelTokenizer --append-eod --workers 2
fi

cd "${REPO_ROOT}"
exec torchrun --standalone --nproc-per-node "${NPROC}" pretrain_mamba.py \
    --num-layers "${#PATTERN}" --hybrid-override-pattern "${PATTERN}" --hidden-size 128 --num-attention-heads 4 \
    --mamba-state-dim 32 --mamba-head-dim 32 --mamba-num-groups 2 \
    --seq-length 128 --max-position-embeddings 128 --position-embedding-type none \
    --normalization RMSNorm --swiglu --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "${TRAIN_ITERS}" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
    --seed 1234 --tensor-model-parallel-size "${TP}" --distributed-backend gloo \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --data-path "${DATA_PREFIX}_text_document" --split 98,2,0 --tokenizer-type ByteLevelTokenizer \
    --data-cache-path "${CACHE_DIR}/index_cache" --num-workers 0 \
    --log-interval 10 --log-throughput --eval-interval 100 --eval-iters 4 \
    --metrics-file "${OUTPUT_DIR}/metrics.jsonl" --save "${OUTPUT_DIR}/checkpoints" --save-interval 100 \
    --ckpt-format torch_dist "$@"
