#!/usr/bin/env bash
# Multi-node GPU template: run this script once per node (e.g. `srun --ntasks-per-node=1 bash ...` under SLURM).
#
#   sbatch --nodes=4 --gpus-per-node=8 --ntasks-per-node=1 --wrap "srun bash examples/gpt/train_gpt_multinode.sh"
#
# torchrun's c10d rendezvous joins the nodes: every node must agree on MASTER_ADDR:MASTER_PORT and RDZV_ID.
# Under SLURM they come from SLURM_* variables; elsewhere export NNODES, NODE_RANK and MASTER_ADDR yourself.
# Edit DATA_PREFIX, the tokenizer flags and the model size for your run; extra arguments are passed on to
# pretrain_gpt.py (e.g. --use-megatron-fsdp for Megatron-FSDP instead of the distributed optimizer). The
# torch_dist checkpoints resume at another node count, TP / PP layout or data-parallel wrapper.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"

GPUS_PER_NODE="${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}"
NNODES="${NNODES:-${SLURM_NNODES:-1}}"
NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
    MASTER_ADDR="$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)"
fi
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-megatron_gpt}}"

TP="${TP:-2}"
PP="${PP:-2}"
DATA_PREFIX="${DATA_PREFIX:-/data/my_corpus_text_document}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${REPO_ROOT}/checkpoints/gpt_multinode}"
TENSORBOARD_DIR="${TENSORBOARD_DIR:-${REPO_ROOT}/runs/gpt_multinode/tensorboard}"

# One connection orders tensor-parallel communication before the compute that needs it (Megatron DDP/TP).
# Megatron-FSDP refuses it (it would serialise communication with compute): passed --use-megatron-fsdp, the
# script leaves CUDA_DEVICE_MAX_CONNECTIONS as it finds it.
if [[ " $* " != *" --use-megatron-fsdp "* ]]; then
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
fi
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
# With --max-restarts, each restart meets on a fresh store: the shared rendezvous store would still hold the
# addresses of the killed ranks, and the restarted ones would connect to them (or wait on them) and fail.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

DISTRIBUTED_ARGS=(
    --nnodes "${NNODES}"
    --node-rank "${NODE_RANK}"
    --nproc-per-node "${GPUS_PER_NODE}"
    --rdzv-backend c10d
    --rdzv-endpoint "${MASTER_ADDR}:${MASTER_PORT}"
    --rdzv-id "${RDZV_ID}"
)
MODEL_ARGS=(
    --num-layers 24
    --hidden-size 2048
    --num-attention-heads 16
    --seq-length 2048
    --max-position-embeddings 2048
    --position-embedding-type rope
    --normalization RMSNorm
    --swiglu
    --untie-embeddings-and-output-weights
    --hidden-dropout 0.0
    --attention-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 512
    --train-iters 100000
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP}"
    --pipeline-model-parallel-size "${PP}"
    --sequence-parallel
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --distributed-backend nccl
)
DATA_ARGS=(
    --data-path "${DATA_PREFIX}"
    --split 969,30,1
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "${TOKENIZER_MODEL:-gpt2}"
    --num-workers 2
)
OUTPUT_ARGS=(
    --log-interval 10
    --log-throughput
    --log-memory-to-tensorboard
    --eval-interval 1000
    --eval-iters 10
    --tensorboard-dir "${TENSORBOARD_DIR}"
    --save "${CHECKPOINT_DIR}"
    --load "${CHECKPOINT_DIR}"
    --save-interval 1000
    --exit-signal-handler
    --ckpt-format torch_dist
)

cd "${REPO_ROOT}"
exec torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@"
