#!/usr/bin/env bash
# The checks that need a GPU, in one run on one CUDA device (run from the repository root):
#
#   bash tools/gpu_checks.sh [SECTION ...]     # default: env fp8-linear gpu-tests fp8-pretrain offload
#
# Sections:
#   env            the device, driver and torch build
#   fp8-linear     FP8 per-linear table against bf16, and where one FP8 linear's time goes (profile)
#   gpu-tests      every test marked `gpu` (pytest -m gpu)
#   fp8-pretrain   pretrain_gpt.py end to end (GPT 24 x 2048), bf16 against both FP8 recipes, DDP and Megatron-FSDP z3
#   offload        peak memory and step time with optimizer / parameter offloading (GPT 24 x 2048)
#
# Logs go to $OUT (default /tmp/gpu_checks), one file per section; each section has its own time limit and a
# failing section does not stop the next one.
set -uo pipefail

OUT="${OUT:-/tmp/gpu_checks}"
mkdir -p "${OUT}"
export PYTHONPATH=".:megatron/core/distributed/fsdp/src${PYTHONPATH:+:${PYTHONPATH}}"
export PYTHONUNBUFFERED=1
SECTIONS=("$@")
if [[ ${#SECTIONS[@]} -eq 0 ]]; then
    SECTIONS=(env fp8-linear gpu-tests fp8-pretrain offload)
fi

run_section() {
    local name="$1" limit="$2"
    shift 2
    echo "=== ${name} (limit ${limit} s) $(date -u +%H:%M:%S)"
    local start=${SECONDS}
    timeout "${limit}" "$@" > "${OUT}/${name}.log" 2>&1
    local rc=$?
    echo "=== ${name}: rc ${rc} in $(( SECONDS - start )) s"
}

for section in "${SECTIONS[@]}"; do
    case "${section}" in
        env)
            run_section env 60 bash -c 'nvidia-smi; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"'
            cat "${OUT}/env.log" | tail -3 ;;
        fp8-linear)
            run_section fp8-linear 120 bash -c 'python3 examples/fp8/benchmark_fp8.py --part gpu --skip-pretrain && python3 examples/fp8/benchmark_fp8.py --part gpu-diagnostics'
            grep -E '^\|' "${OUT}/fp8-linear.log" | head -40 ;;
        gpu-tests)
            run_section gpu-tests 150 python3 -m pytest -m gpu tests/unit_tests -q -p no:cacheprovider -o addopts="-ra --strict-markers" --timeout 120
            tail -25 "${OUT}/gpu-tests.log" ;;
        fp8-pretrain)
            run_section fp8-pretrain 300 python3 examples/fp8/benchmark_fp8.py --part gpu --pretrain-only
            grep -E '^\||pretrain_gpt|failed|Error' "${OUT}/fp8-pretrain.log" | tail -12 ;;
        offload)
            run_section offload 200 python3 examples/offloading/benchmark.py
            tail -12 "${OUT}/offload.log" ;;
        *)
            echo "unknown section ${section}" ;;
    esac
done
