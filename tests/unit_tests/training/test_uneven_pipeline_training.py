"""pretrain() with uneven pipeline splits (PP2, with and without virtual stages) equals the same model without
pipelining, under Megatron DDP, the distributed optimizer and Megatron-FSDP ZeRO-1 / ZeRO-3; each run also reports
which global layers every model chunk ran, so a split flag that was silently ignored cannot pass.

The splits: 1/3 by `--decoder-first-pipeline-num-layers`, a layout whose first stage holds only the embedding
(`E|t*4L`), an interleaved layout with a middle chunk holding nothing (`Ett||t|tL`: it passes its input on in the
forward and its gradient back in the backward; under Megatron-FSDP it is wrapped too, with nothing to gather, reduce
or step) or a last chunk holding only the loss (`Et|tt|t|L`), and the embedding and loss accounted as layers (6
layers over 2 x 2 virtual stages: 1, 2, 2, 1). fp32 on the CPU: the runs differ only in the order of floating-point
reductions, so losses agree to 1e-5 relative (measured: at most 3e-8; the empty-chunk runs are bit-identical).
Checkpoints saved under an uneven split resume under the even one in dist_checkpointing/test_resume.py and
test_interleaved_pipeline_training.py.
"""

import pytest

from tests.unit_tests.dist_checkpointing.pretrain_helpers import run_pretrain
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.training.test_interleaved_pipeline_training import ITERATIONS, REL_TOLERANCE

PP2 = "--pipeline-model-parallel-size 2"
Z3 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params"
Z1 = "--use-megatron-fsdp --data-parallel-sharding-strategy optim"
SIX_LAYERS = "--num-layers 6"
# name: (flags, reference run, {rank: the 1-based layer numbers of each chunk it ran})
RUNS = {
    "ddp_first_1": (f"{PP2} --decoder-first-pipeline-num-layers 1", "", {0: [(1,)], 1: [(2, 3, 4)]}),
    "mfsdp_z3_first_1": (f"{Z3} {PP2} --decoder-first-pipeline-num-layers 1", "", {0: [(1,)], 1: [(2, 3, 4)]}),
    "ddp_embedding_alone": (f"{PP2} --pipeline-model-parallel-layout E|t*4L", "", {0: [()], 1: [(1, 2, 3, 4)]}),
    "mfsdp_z3_embedding_alone": (f"{Z3} {PP2} --pipeline-model-parallel-layout E|t*4L", "",
                                 {0: [()], 1: [(1, 2, 3, 4)]}),
    "distopt_vpp_empty_middle_chunk": (f"--use-distributed-optimizer {PP2} --pipeline-model-parallel-layout "
                                       "Ett||t|tL", "", {0: [(1, 2), (3,)], 1: [(), (4,)]}),
    "mfsdp_z3_vpp_empty_middle_chunk": (f"{Z3} {PP2} --pipeline-model-parallel-layout Ett||t|tL", "",
                                        {0: [(1, 2), (3,)], 1: [(), (4,)]}),
    "mfsdp_z1_vpp_empty_middle_chunk": (f"{Z1} {PP2} --pipeline-model-parallel-layout Ett||t|tL", "",
                                        {0: [(1, 2), (3,)], 1: [(), (4,)]}),
    "mfsdp_z3_vpp_loss_alone": (f"{Z3} {PP2} --pipeline-model-parallel-layout Et|tt|t|L", "",
                                {0: [(1,), (4,)], 1: [(), (2, 3)]}),
    "ddp_vpp_accounted": (f"{SIX_LAYERS} {PP2} --num-virtual-stages-per-pipeline-rank 2 "
                          "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
                          SIX_LAYERS, {0: [(1,), (4, 5)], 1: [(2, 3), (6,)]}),
}

_layers_seen = set()


def _forward_step_recording_layers(data_iterator, model):
    """pretrain_gpt's forward step, noting the global layer numbers of the chunk it runs."""
    import pretrain_gpt
    from megatron.core.transformer.transformer_layer import TransformerLayer

    _layers_seen.add(tuple(module.layer_number for module in model.modules() if isinstance(module, TransformerLayer)))
    return pretrain_gpt.forward_step(data_iterator, model)


def _uneven_runs_and_references(workdir, names):
    references, runs = {}, {}
    for name in names:
        flags, reference, _ = RUNS[name]
        if reference not in references:
            references[reference] = run_pretrain(workdir, f"{reference} {ITERATIONS}")
        _layers_seen.clear()
        losses = run_pretrain(workdir, f"{flags} {ITERATIONS}", forward_step=_forward_step_recording_layers)
        runs[name] = (losses, references[reference], sorted(_layers_seen))
    return runs


@pytest.mark.world_size(2)
def test_uneven_splits_equal_no_pipeline(tmp_path):
    per_rank = run_on_ranks(2, _uneven_runs_and_references, str(tmp_path), list(RUNS))
    for name, (_, _, chunk_layers) in RUNS.items():
        for rank in (0, 1):
            assert per_rank[rank][name][2] == sorted(chunk_layers[rank]), (name, rank)
        losses, reference, _ = per_rank[0][name]
        assert sorted(losses) == [1, 2, 3, 4], name
        assert len(set(losses.values())) == 4, name  # every iteration updates the model
        for iteration, loss in losses.items():
            assert loss == pytest.approx(reference[iteration], rel=REL_TOLERANCE, abs=0), (name, iteration)
