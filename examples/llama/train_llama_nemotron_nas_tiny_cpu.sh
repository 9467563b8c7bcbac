#!/usr/bin/env bash
# Train a tiny Llama-Nemotron-style model (heterogeneous layers from a block_configs JSON) on the bundled corpus on
# CPU: 2 ranks, gloo, Megatron-FSDP ZeRO-3, about a minute. The data, width and schedule of
# examples/gpt/train_gpt_tiny_cpu.sh; the layers of examples/llama/llama_nemotron_nas_tiny.json: 2 key/value heads
# and an MLP of 512, no attention and an MLP of 256, a linear for the attention and an MLP of 512, 4 key/value heads
# and a linear for the MLP.
#
#   bash examples/llama/train_llama_nemotron_nas_tiny_cpu.sh [extra pretrain_gpt.py flags]
#
# LAYERS names another config.json with block_configs (4 entries at hidden 128 and 4 heads); TP=2 splits the layers.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-${REPO_ROOT}/runs/tiny_gpt}"
OUTPUT_DIR="${OUTPUT_DIR:-${REPO_ROOT}/runs/tiny_nemotron_nas}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
LAYERS="${LAYERS:-${REPO_ROOT}/examples/llama/llama_nemotron_nas_tiny.json}"
DATA_PREFIX="${CACHE_DIR}/stdlib_docs"

mkdir -p "${CACHE_DIR}" "${OUTPUT_DIR}"
if [[ ! -f "${DATA_PREFIX}_text_document.idx" ]]; then
    python "${REPO_ROOT}/tools/preprocess_data.py" --input "${REPO_ROOT}/data/corpus/stdlib_docs.jsonl" \
        --output-prefix "${DATA_PREFIX}" --tokenizer-type ByteLevelTokenizer --append-eod --workers 2
fi

cd "${REPO_ROOT}"
exec torchrun --standalone --nproc-per-node "${NPROC}" pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --heterogeneous-layers-config-path "${LAYERS}" \
    --seq-length 128 --max-position-embeddings 128 --position-embedding-type rope \
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights \
    --hidden-dropout 0.0 --attention-dropout 0.0 --make-vocab-size-divisible-by 64 \
    --micro-batch-size 8 --global-batch-size 16 --train-iters "${TRAIN_ITERS}" \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 \
    --seed 1234 --tensor-model-parallel-size "${TP}" --distributed-backend gloo \
    --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params \
    --data-path "${DATA_PREFIX}_text_document" --split 98,2,0 --tokenizer-type ByteLevelTokenizer \
    --data-cache-path "${CACHE_DIR}/index_cache" --num-workers 0 \
    --log-interval 10 --log-throughput --eval-interval 100 --eval-iters 4 \
    --metrics-file "${OUTPUT_DIR}/metrics.jsonl" --save "${OUTPUT_DIR}/checkpoints" --save-interval 100 \
    --ckpt-format torch_dist "$@"
