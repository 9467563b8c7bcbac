"""One run per functional case per session, shared by the golden-value and the cross-layout tests; one run per
DDP twin of the FSDP cases."""

import dataclasses

import pytest

from tests.functional_tests.runner import load_case, run_case


@pytest.fixture(scope="session")
def case_result(tmp_path_factory):
    results = {}

    def get(case_name):
        if case_name not in results:
            case = load_case(case_name)
            workdir = tmp_path_factory.mktemp(case_name.replace("/", "_"))
            results[case_name] = run_case(case, workdir)
        return results[case_name]

    return get


# Flags that select or tune a fully sharded data-parallel wrapper. Without them a case trains with Megatron DDP.
FSDP_FLAGS = (
    "--use-torch-fsdp2",
    "--torch-fsdp2-no-reshard-after-forward",
    "--use-megatron-fsdp",
    "--data-parallel-sharding-strategy",
    "--outer-dp-sharding-strategy",
    "--num-distributed-optimizer-instances",
    "--init-model-with-meta-device",
    "--fsdp-double-buffer",
    "--megatron-fsdp-main-params-dtype",
    "--megatron-fsdp-main-grads-dtype",
    "--megatron-fsdp-grad-comm-dtype",
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
)


def ddp_twin(case):
    """`case` with every FSDP flag removed: the same model, data, layout and steps under Megatron DDP."""
    model_args = {flag: value for flag, value in case.model_args.items() if flag not in FSDP_FLAGS}
    return dataclasses.replace(case, name=f"{case.name} (DDP twin)", model_args=model_args)


@pytest.fixture(scope="session")
def ddp_twin_result(tmp_path_factory):
    results = {}

    def get(case_name):
        twin = ddp_twin(load_case(case_name))
        key = (twin.nproc_per_node, tuple(sorted((flag, str(value)) for flag, value in twin.model_args.items())))
        if key not in results:
            workdir = tmp_path_factory.mktemp(case_name.replace("/", "_") + "_ddp_twin")
            results[key] = run_case(twin, workdir)
        return results[key]

    return get
