#!/usr/bin/env bash
# Train a tiny GPT on the bundled corpus on CPU: 2 ranks, gloo, about a minute on 2 cores.
#
#   bash examples/gpt/train_gpt_tiny_cpu.sh [extra pretrain_gpt.py flags]
#
# The corpus (data/corpus/stdlib_docs.jsonl, CPython docstrings) is tokenized once with the byte-level tokenizer
# into $CACHE_DIR; later runs reuse it. Set TP=2 (or PP=2) to split the model instead of the data.
# Expect the loss to start near 5.6 (uniform over 257 byte tokens) and reach about 2.0 at iteration 200.
# Checkpoints go to $OUTPUT_DIR/checkpoints; the same command launched again resumes from the latest one there.
#
# Data parallelism: Megatron-FSDP ZeRO-3 by default. DP_WRAPPER selects another wrapper:
#   DP_WRAPPER=mfsdp   Megatron-FSDP; ZERO=optim_grads_params (default), optim_grads, optim or no_shard
#   DP_WRAPPER=ddp     Megatron DDP (gradients all-reduced, every rank holds the whole state)
#   DP_WRAPPER=distopt Megatron DDP with the distributed optimizer (ZeRO-1)
#   DP_WRAPPER=fsdp2   PyTorch FSDP2 (fully_shard per layer; needs untied embeddings, added here)
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_DIR="${CACHE_DIR:-${REPO_ROOT}/runs/tiny_gpt}"
OUTPUT_DIR="${OUTPUT_DIR:-${CACHE_DIR}/run}"
NPROC="${NPROC:-2}"
TP="${TP:-1}"
PP="${PP:-1}"
TRAIN_ITERS="${TRAIN_ITERS:-200}"
# Warm up over 20 iterations, or a tenth of a shorter run (warm-up must end before the last iteration).
WARMUP_ITERS="${WARMUP_ITERS:-$(( TRAIN_ITERS >= 200 ? 20 : TRAIN_ITERS / 10 ))}"
DP_WRAPPER="${DP_WRAPPER:-mfsdp}"
ZERO="${ZERO:-optim_grads_params}"
DATA_PREFIX="${CACHE_DIR}/stdlib_docs"

mkdir -p "${CACHE_DIR}" "${OUTPUT_DIR}"
if [[ ! -f "${DATA_PREFIX}_text_document.idx" ]]; then
    echo "tokenizing the bundled corpus into ${DATA_PREFIX}_text_document.{bin,idx}"
    python "${REPO_ROOT}/tools/preprocess_data.py" \
        --input "${REPO_ROOT}/data/corpus/stdlib_docs.jsonl" \
        --output-prefix "${DATA_PREFIX}" \
        --tokenizer-type ByteLevelTokenizer \
        --append-eod \
        --workers 2
fi

MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 128
    --max-position-embeddings 128
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --hidden-dropout 0.0
    --attention-dropout 0.0
    --make-vocab-size-divisible-by 64
)
TRAINING_ARGS=(
    --micro-batch-size 8
    --global-batch-size 16
    --train-iters "${TRAIN_ITERS}"
    --lr 3e-3
    --min-lr 3e-4
    --lr-decay-style cosine
    --lr-warmup-iters "${WARMUP_ITERS}"
    --weight-decay 0.1
    --clip-grad 1.0
    --seed 1234
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP}"
    --pipeline-model-parallel-size "${PP}"
    --distributed-backend gloo
)
case "${DP_WRAPPER}" in
    mfsdp) PARALLEL_ARGS+=(--use-megatron-fsdp --data-parallel-sharding-strategy "${ZERO}") ;;
    ddp) ;;
    distopt) PARALLEL_ARGS+=(--use-distributed-optimizer) ;;
    fsdp2) PARALLEL_ARGS+=(--use-torch-fsdp2 --untie-embeddings-and-output-weights) ;;
    *) echo "DP_WRAPPER=${DP_WRAPPER} is not one of mfsdp, ddp, distopt, fsdp2" >&2; exit 2 ;;
esac
DATA_ARGS=(
    --data-path "${DATA_PREFIX}_text_document"
    --split 98,2,0
    --tokenizer-type ByteLevelTokenizer
    --data-cache-path "${CACHE_DIR}/index_cache"
    --num-workers 0
)
OUTPUT_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 100
    --eval-iters 4
    --tensorboard-dir "${OUTPUT_DIR}/tensorboard"
    --metrics-file "${OUTPUT_DIR}/metrics.jsonl"
    --save "${OUTPUT_DIR}/checkpoints"
    --save-interval 100
    --ckpt-format torch_dist
)
LAUNCH=(torchrun --standalone --nproc-per-node "${NPROC}" pretrain_gpt.py
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")
# The same command launched again resumes from its latest checkpoint; another command (wrapper, layout, model
# flags, TRAIN_ITERS) trains afresh, as the checkpoint would not load under it or would have nothing left to train.
LAUNCH_RECORD="${OUTPUT_DIR}/launch_command.txt"
TRACKER="${OUTPUT_DIR}/checkpoints/latest_checkpointed_iteration.txt"
THIS_LAUNCH="$(printf '%q ' "${LAUNCH[@]}")"
if [[ -f "${TRACKER}" && -f "${LAUNCH_RECORD}" && "$(cat "${LAUNCH_RECORD}")" == "${THIS_LAUNCH}" ]]; then
    echo "resuming from the latest checkpoint in ${OUTPUT_DIR}/checkpoints (another OUTPUT_DIR starts afresh)"
    LAUNCH+=(--load "${OUTPUT_DIR}/checkpoints")
else
    if [[ -f "${TRACKER}" ]]; then
        echo "${OUTPUT_DIR}/checkpoints holds a run of another command: training afresh and saving over it" \
             "(set OUTPUT_DIR to keep both)"
        # Its iterations are not this command's to resume, even if this run stops before its first save.
        rm -f "${TRACKER}"
    fi
    # A fresh run starts a fresh record; a resumed one appends to the record of the run it continues.
    rm -f "${OUTPUT_DIR}/metrics.jsonl"
    printf '%s' "${THIS_LAUNCH}" > "${LAUNCH_RECORD}"
fi

cd "${REPO_ROOT}"
exec "${LAUNCH[@]}"
