"""ProcessGroupCollection holds the groups it is given; use_mpu_process_groups fills it from parallel_state."""

import pytest
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.process_groups_config import ProcessGroupCollection
from tests.unit_tests.multiprocess_harness import run_on_ranks


def test_only_given_groups_are_attributes():
    collection = ProcessGroupCollection(tp="tp-group", dp_cp=None)
    assert collection.tp == "tp-group" and collection.dp_cp is None
    assert not hasattr(collection, "pp")
    assert repr(collection) == "ProcessGroupCollection(dp_cp, tp)"
    with pytest.raises(ValueError, match=r"unknown process group names \['tensor'\]"):
        ProcessGroupCollection(tensor="tp-group")
    with pytest.raises(ValueError, match=r"unknown process group names \['tensor'\]"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "tensor"])
    with pytest.raises(ValueError, match="pass a list of names"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs="tp")
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])


def _mpu_collections():
    ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    some = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "pp", "dp_cp", "embd"])
    every = ProcessGroupCollection.use_mpu_process_groups()
    result = {
        "some": {name: dist.get_process_group_ranks(getattr(some, name)) for name in ("tp", "pp", "dp_cp", "embd")},
        "some_has_cp": hasattr(some, "cp"),
        "same": [every.tp is ps.get_tensor_model_parallel_group(), every.mp is ps.get_model_parallel_group(),
                 every.expt_dp is ps.get_expert_data_parallel_group(),
                 every.intra_dp_cp is ps.get_inner_data_parallel_group()],
        "hcp": every.hcp,
        "tp_dp_cp": dist.get_process_group_ranks(every.tp_dp_cp),
    }
    ps.destroy_model_parallel()
    return result


def test_use_mpu_process_groups_on_tp2_pp2():
    for rank, result in enumerate(run_on_ranks(4, _mpu_collections)):
        stage = rank // 2
        assert result["some"] == {"tp": [2 * stage, 2 * stage + 1], "pp": [rank % 2, rank % 2 + 2],
                                  "dp_cp": [rank], "embd": [rank % 2, rank % 2 + 2]}
        assert not result["some_has_cp"]
        assert result["same"] == [True] * 4
        assert result["hcp"] is None
        assert result["tp_dp_cp"] == [2 * stage, 2 * stage + 1]
