# Sourced by the upstream recipes (examples/<model>/train_*.sh). `refuse_positional_arguments "<variables>" "$@"`
# stops a launch in upstream's form (paths as positional arguments) naming the variables that take them here.
# Once their pretrain_gpt.py flags are in ARGS, `launch_recipe "${ARGS[@]}"` prints the flags one per line and
# stops with PRINT_ARGS=1; otherwise it creates RUN_DIR and runs pretrain_gpt.py, on 2 CPU ranks (gloo) with TINY=1
# and under torchrun's multi-node launch (GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT) else.

refuse_positional_arguments() {
    local variables="$1"
    shift
    if [[ $# -gt 0 && "$1" != -* ]]; then
        echo "$(basename "$0"): '$1' is not a pretrain_gpt.py flag. Upstream's positional arguments are environment" \
             "variables here (${variables}), e.g. CHECKPOINT_DIR=/ckpt bash $0; the arguments after the script" \
             "name are passed on to pretrain_gpt.py as flags." >&2
        exit 2
    fi
}

launch_recipe() {
    if [[ "${PRINT_ARGS:-0}" == 1 ]]; then
        printf '%s\n' "$@"
        exit 0
    fi
    mkdir -p "${RUN_DIR}"
    if [[ "${TINY:-0}" == 1 ]]; then
        exec torchrun --standalone --nproc-per-node 2 "${REPO_ROOT}/pretrain_gpt.py" "$@"
    fi
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    exec torchrun --nproc-per-node "${GPUS_PER_NODE:-8}" --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" \
        --master-addr "${MASTER_ADDR:-localhost}" --master-port "${MASTER_PORT:-6000}" \
        "${REPO_ROOT}/pretrain_gpt.py" "$@"
}
