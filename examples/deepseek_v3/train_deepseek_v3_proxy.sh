#!/usr/bin/env bash
# DeepSeek-V3 pretraining with upstream Megatron-LM's recipe (megatron/core/transformer/moe/README.md, "DeepSeek-V3
# pretraining"): 61 layers, hidden 7168, 128 heads of multi-latent attention (query rank 1536, key/value rank 512,
# head dims 128 + 64 rope, value 128, YaRN x40 over 4096 positions), the first 3 layers dense (FFN 18432) and 58 of
# 256 routed experts (FFN 2048, top-8 of a sigmoid router limited to 4 of 8 groups, scaled by 2.5, aux-loss-free
# expert bias plus a 1e-4 sequence aux loss) and one shared expert, one multi-token-prediction depth, vocabulary
# 129280; PP 16 with 2 virtual stages per rank (layout Et|(tt|)*30mL) x EP 64 on 1024 GPUs, bf16.
#
#   DATA_PATH=/data/dsv3_text_document NNODES=128 NODE_RANK=<this node> MASTER_ADDR=<node 0> \
#       bash examples/deepseek_v3/train_deepseek_v3_proxy.sh
#   TINY=1 bash examples/deepseek_v3/train_deepseek_v3_proxy.sh      # the proxy: same flags, 2 CPU ranks, gloo
#   PRINT_ARGS=1 bash examples/deepseek_v3/train_deepseek_v3_proxy.sh  # print the pretrain_gpt.py flags, run nothing
#
# Differences from upstream's recipe: --moe-token-dispatcher-type alltoall instead of flex with DeepEP and no
# --use-flash-attn or --transformer-impl transformer_engine (this build has neither DeepEP nor Transformer Engine
# attention; torch's scaled_dot_product_attention picks a flash kernel by itself), and it trains from scratch
# (upstream's --finetune --load of a converted checkpoint is one flag away: add --finetune --load <dir>).
# Without DATA_PATH the run trains on mock data (NullTokenizer). TINY=1 is a DeepSeek-V3 proxy with every training
# flag kept: 3 layers (1 dense, 2 MoE with 8 experts, top-4 of 2 of 4 groups, a shared expert), hidden 64, small
# latent ranks, a 1024-id vocabulary, the experts split EP 2 over 2 CPU ranks joined by gloo, no pipeline; it
# trains TRAIN_ITERS (default 10) iterations on mock data and writes under RUN_DIR. Extra arguments are passed on
# to pretrain_gpt.py.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "${REPO_ROOT}/examples/recipe_launch.sh"
refuse_positional_arguments "CHECKPOINT_DIR, OUTPUT_DIR, TOKENIZER_MODEL, DATA_PATH" "$@"
TINY="${TINY:-0}"
DATA_PATH="${DATA_PATH:-}"

if [[ "${TINY}" == 1 ]]; then
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/deepseek_v3_proxy}"
    NUM_LAYERS=3 HIDDEN=64 FFN=128 HEADS=4 KV_CHANNELS=16 SEQ=64 VOCAB=1024 VOCAB_DIVISOR=128
    Q_LORA=32 KV_LORA=16 QK_HEAD=16 QK_POS=8 V_HEAD=16 MOE_LAYER_FREQ="([0]*1+[1]*2)"
    EXPERTS=8 MOE_FFN=32 SHARED_FFN=32 TOPK=4 NUM_GROUPS=4 GROUP_TOPK=2
    GLOBAL_BATCH=8 TRAIN_SAMPLES=$(( ${TRAIN_ITERS:-10} * GLOBAL_BATCH ))
    DECAY_SAMPLES=$(( TRAIN_SAMPLES - 4 )) WARMUP_SAMPLES=8
    PARALLEL_ARGS=(--pipeline-model-parallel-size 1 --expert-model-parallel-size 2)
    EVAL_ITERS=1 EVAL_INTERVAL=1000 SAVE_INTERVAL=1000 NUM_WORKERS=0
    BACKEND=gloo
else
    RUN_DIR="${RUN_DIR:-${REPO_ROOT}/runs/deepseek_v3}"
    NUM_LAYERS=61 HIDDEN=7168 FFN=18432 HEADS=128 KV_CHANNELS=128 SEQ=4096 VOCAB=129280 VOCAB_DIVISOR=3232
    Q_LORA=1536 KV_LORA=512 QK_HEAD=128 QK_POS=64 V_HEAD=128 MOE_LAYER_FREQ="([0]*3+[1]*58)"
    EXPERTS=256 MOE_FFN=2048 SHARED_FFN=2048 TOPK=8 NUM_GROUPS=8 GROUP_TOPK=4
    GLOBAL_BATCH=8192 TRAIN_SAMPLES=585937500
    DECAY_SAMPLES=584765624 WARMUP_SAMPLES=1536000
    PARALLEL_ARGS=(--pipeline-model-parallel-size 16 --pipeline-model-parallel-layout "Et|(tt|)*30mL"
                   --expert-model-parallel-size 64)
    EVAL_ITERS=32 EVAL_INTERVAL=200 SAVE_INTERVAL=500 NUM_WORKERS=6
    BACKEND=nccl
fi
OUTPUT_DIR="${OUTPUT_DIR:-${RUN_DIR}/output}"
CHECKPOINT_DIR="${CHECKPOINT_DIR:-${RUN_DIR}/checkpoints}"
DATA_CACHE_DIR="${DATA_CACHE_DIR:-${RUN_DIR}/data_cache}"

DISTRIBUTED_ARGS=(
    --distributed-timeout-minutes 60
    --tensor-model-parallel-size 1
    "${PARALLEL_ARGS[@]}"
    --context-parallel-size 1
    --expert-tensor-parallel-size 1
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --distributed-backend "${BACKEND}"
)
TRAINING_ARGS=(
    --use-mcore-models
    --sequence-parallel
    --disable-bias-linear
    --micro-batch-size 1
    --global-batch-size "${GLOBAL_BATCH}"
    --train-samples "${TRAIN_SAMPLES}"
    --exit-duration-in-mins 220
    --no-check-for-nan-in-loss-and-grad
    --manual-gc
    --manual-gc-interval 10
    --recompute-granularity selective
    --recompute-modules mla_up_proj layernorm
)
if [[ -n "${DATA_PATH}" ]]; then
    DATA_ARGS=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:-deepseek-ai/DeepSeek-V3}"
               --data-path "${DATA_PATH}")
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB}")
fi
DATA_ARGS+=(
    --seq-length "${SEQ}"
    --data-cache-path "${DATA_CACHE_DIR}"
    --split 99,1,0
    --no-mmap-bin-files
    --no-create-attention-mask-in-dataloader
    --num-workers "${NUM_WORKERS}"
)
NETWORK_SIZE_ARGS=(
    --num-layers "${NUM_LAYERS}"
    --hidden-size "${HIDDEN}"
    --ffn-hidden-size "${FFN}"
    --num-attention-heads "${HEADS}"
    --kv-channels "${KV_CHANNELS}"
    --max-position-embeddings "${SEQ}"
    --position-embedding-type rope
    --rotary-base 10000
    --make-vocab-size-divisible-by "${VOCAB_DIVISOR}"
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --untie-embeddings-and-output-weights
    --multi-latent-attention
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
)
REGULARIZATION_ARGS=(
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --clip-grad 1.0
    --weight-decay 0.1
    --qk-layernorm
)
LEARNING_RATE_ARGS=(
    --lr-decay-samples "${DECAY_SAMPLES}"
    --lr-warmup-samples "${WARMUP_SAMPLES}"
    --lr-warmup-init 3.9e-7
    --lr 3.9e-6
    --min-lr 3.9e-7
    --lr-decay-style cosine
    --adam-beta1 0.9
    --adam-beta2 0.95
)
MOE_ARGS=(
    --num-experts "${EXPERTS}"
    --moe-layer-freq "${MOE_LAYER_FREQ}"
    --moe-ffn-hidden-size "${MOE_FFN}"
    --moe-shared-expert-intermediate-size "${SHARED_FFN}"
    --moe-router-load-balancing-type seq_aux_loss
    --moe-router-topk "${TOPK}"
    --moe-token-dispatcher-type alltoall
    --moe-router-pre-softmax
    --moe-grouped-gemm
    --moe-aux-loss-coeff 1e-4
    --moe-router-group-topk "${GROUP_TOPK}"
    --moe-router-num-groups "${NUM_GROUPS}"
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-dtype fp32
    --moe-permute-fusion
)
MLA_ARGS=(
    --q-lora-rank "${Q_LORA}"
    --kv-lora-rank "${KV_LORA}"
    --qk-head-dim "${QK_HEAD}"
    --qk-pos-emb-head-dim "${QK_POS}"
    --v-head-dim "${V_HEAD}"
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
)
EVAL_ARGS=(--eval-iters "${EVAL_ITERS}" --eval-interval "${EVAL_INTERVAL}")
CHECKPOINT_ARGS=(
    --auto-detect-ckpt-format
    --load "${CHECKPOINT_DIR}"
    --save "${CHECKPOINT_DIR}"
    --save-interval "${SAVE_INTERVAL}"
    --dist-ckpt-strictness log_all
)
LOGGING_ARGS=(
    --init-method-std 0.02
    --log-timers-to-tensorboard
    --log-memory-to-tensorboard
    --log-num-zeros-in-grad
    --log-params-norm
    --log-validation-ppl-to-tensorboard
    --log-throughput
    --log-interval 1
    --tensorboard-dir "${OUTPUT_DIR}/tensorboard"
    --bf16
)
ARGS=("${DISTRIBUTED_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${NETWORK_SIZE_ARGS[@]}"
      "${REGULARIZATION_ARGS[@]}" "${LEARNING_RATE_ARGS[@]}" "${MOE_ARGS[@]}" "${MLA_ARGS[@]}" "${EVAL_ARGS[@]}"
      "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}" "$@")

launch_recipe "${ARGS[@]}"
