"""Upstream's helpers in `megatron.training.utils`: masks and positions of a left-to-right batch, the parameter
norm, the model-parallel logical and, parameter statistics, memory and progress-log lines, `use_dist_ckpt`."""

import contextlib
import io
import json
import math
import re
import types

import pytest
import torch

from tests.unit_tests.multiprocess_harness import run_on_ranks

EOD = 9


def test_ltor_masks_and_positions_by_hand():
    from megatron.training.utils import get_ltor_masks_and_position_ids

    data = torch.tensor([[1, EOD, 2, 3, EOD, 4], [5, 6, 7, 8, 1, 2]])
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(data, EOD, False, False, False)
    causal_masked = ~torch.tril(torch.ones(6, 6, dtype=torch.bool))
    assert attention_mask.shape == (1, 1, 6, 6) and torch.equal(attention_mask[0, 0], causal_masked)
    assert torch.equal(loss_mask, torch.ones(2, 6)) and torch.equal(position_ids, torch.arange(6).expand(2, 6))

    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(data, EOD, True, True, True)
    assert position_ids.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]
    assert loss_mask.tolist() == [[1, 0, 1, 1, 0, 1], [1] * 6]
    assert attention_mask.shape == (2, 1, 6, 6) and torch.equal(attention_mask[1, 0], causal_masked)
    # Row 0's documents: positions 0-1, 2-4, 5; each query sees the keys of its own document up to itself.
    sees = (~attention_mask[0, 0]).int().tolist()
    assert sees == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0],
                    [0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1]]


@pytest.mark.parametrize("flags", [(True, False, False), (False, True, True), (True, True, True)])
def test_ltor_masks_and_positions_match_the_datasets_samples(flags):
    """The GPT datasets build each sample's masks and positions from the same three flags."""
    from megatron.core.datasets.gpt_dataset import sample_from_tokens
    from megatron.training.utils import get_ltor_masks_and_position_ids

    reset_position_ids, reset_attention_mask, eod_mask_loss = flags
    config = types.SimpleNamespace(tokenizer=types.SimpleNamespace(eod=EOD), eod_mask_loss=eod_mask_loss,
                                   reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                                   create_attention_mask=True)
    windows = torch.randint(0, EOD + 1, (3, 17), generator=torch.Generator().manual_seed(0))
    samples = [sample_from_tokens(window.numpy(), config) for window in windows]
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(windows[:, :-1], EOD, *flags)
    assert torch.equal(loss_mask, torch.stack([sample["loss_mask"] for sample in samples]))
    assert torch.equal(position_ids, torch.stack([sample["position_ids"] for sample in samples]))
    expected_masks = torch.stack([sample["attention_mask"] for sample in samples])
    assert torch.equal(attention_mask.expand_as(expected_masks), expected_masks)


def test_params_l2_norm_of_one_process():
    from megatron.training.utils import calc_params_l2_norm

    torch.manual_seed(0)
    chunks = [torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False)]
    expected = math.sqrt(sum(param.double().pow(2).sum().item() for chunk in chunks for param in chunk.parameters()))
    assert calc_params_l2_norm(chunks) == pytest.approx(expected, rel=1e-6)
    assert calc_params_l2_norm(chunks[1], force_create_fp32_copy=True) == pytest.approx(
        chunks[1].weight.double().norm().item(), rel=1e-6)


LAYOUTS = ["--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2",
           "--use-distributed-optimizer --expert-model-parallel-size 2 --num-experts 2 --moe-router-topk 2"]


def _params_norms_before_each_step(workdir):
    """For each layout: (calc_params_l2_norm(model) before step 2, the params norm the log recorded after step 1)."""
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training import training
    from megatron.training.utils import calc_params_l2_norm

    results = []
    for number, layout in enumerate(LAYOUTS):
        norms, original_train_step = [], training.train_step

        def train_step(forward_step_func, data_iterator, model, *args, **kwargs):
            norms.append(calc_params_l2_norm(model))
            return original_train_step(forward_step_func, data_iterator, model, *args, **kwargs)

        metrics = f"{workdir}/metrics_{number}.jsonl"
        argv = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
                "--global-batch-size 2 --lr 1e-2 --mock-data --vocab-size 128 --make-vocab-size-divisible-by 4 "
                "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1 --eval-iters 0 "
                f"--train-iters 2 --log-params-norm --metrics-file {metrics} {layout}").split()
        training.train_step = train_step
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                training.pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                                  ModelType.encoder_or_decoder, pretrain_gpt.forward_step, argv=argv)
        finally:
            training.train_step = original_train_step
        logged = []
        if torch.distributed.get_rank() == 1:  # the logging rank
            logged = [json.loads(line)["params-norm"] for line in open(metrics)
                      if json.loads(line).get("split", "train") == "train"]
        results.append((norms[1], logged[:1]))
    return results


def test_params_l2_norm_equals_the_logged_params_norm_in_sharded_layouts(tmp_path):
    """Tensor-parallel shards and duplicates, the two pipeline stages' shared embedding, experts split over
    expert-parallel ranks with the main parameters sharded over data-parallel ranks: the norm of the model's
    parameters between steps equals the norm the log computed from the optimizer's after the step before."""
    ranks = run_on_ranks(2, _params_norms_before_each_step, str(tmp_path))
    for layout, (rank0, rank1) in zip(LAYOUTS, zip(*ranks)):
        assert rank0[0] == pytest.approx(rank1[0], rel=1e-9), layout  # the same number on every rank
        assert rank1[1] == [pytest.approx(rank1[0], rel=1e-5)], layout


def _logical_and_on_two_tensor_parallel_ranks(values):
    from megatron.core import parallel_state
    from megatron.training.utils import logical_and_across_model_parallel_group

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        return logical_and_across_model_parallel_group(values[torch.distributed.get_rank()])
    finally:
        parallel_state.destroy_model_parallel()


def test_logical_and_across_model_parallel_group():
    assert run_on_ranks(2, _logical_and_on_two_tensor_parallel_ranks, [True, False]) == [False, False]
    assert run_on_ranks(2, _logical_and_on_two_tensor_parallel_ranks, [True, True]) == [True, True]


def test_print_params_min_max_norm(capsys):
    from megatron.training.utils import print_params_min_max_norm

    weight = torch.nn.Parameter(torch.tensor([[-2.0, 1.0], [0.5, 2.0]]))
    weight.tensor_model_parallel = True
    bias = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    optimizer = types.SimpleNamespace(param_groups=[{"params": [weight]}, {"params": [bias]}])
    print_params_min_max_norm(optimizer, 12)
    assert capsys.readouterr().out.splitlines() == [
        "iteration, rank, index, tensor-model-parallel, min, max, norm",
        f"     12,    0,    1,  1, -2.000000E+00, 2.000000E+00, {math.sqrt(9.25):.6E}",
        "     12,    0,    2,  0, 3.000000E+00, 4.000000E+00, 5.000000E+00",
    ]


def test_report_memory(capsys):
    from megatron.training.utils import report_memory

    report_memory("after step")
    line = capsys.readouterr().out.strip()
    match = re.fullmatch(r"\[Rank 0\] after step memory \(MB\) \| resident: ([\d.]+) \| max resident: ([\d.]+)", line)
    assert match and float(match.group(2)) > 1.0, line


def test_append_to_progress_log(tmp_path, monkeypatch):
    from megatron.training import global_state
    from megatron.training.utils import append_to_progress_log

    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    monkeypatch.setattr(global_state, "_ARGS", types.SimpleNamespace(save=str(tmp_path / "ckpt"), world_size=8))
    append_to_progress_log("Starting job", barrier=False)
    append_to_progress_log("Exiting job")
    lines = (tmp_path / "ckpt" / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[1:] for line in lines] == [["Job ID: 4711", "# GPUs: 8", "Starting job"],
                                                       ["Job ID: 4711", "# GPUs: 8", "Exiting job"]]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", lines[0].split("\t")[0])
    monkeypatch.setattr(global_state, "_ARGS", types.SimpleNamespace(save=None, world_size=8))
    append_to_progress_log("nowhere")  # nothing to write without --save


def test_update_use_dist_ckpt():
    from megatron.training.utils import update_use_dist_ckpt

    args = types.SimpleNamespace(ckpt_format="torch")
    update_use_dist_ckpt(args)
    assert args.use_dist_ckpt is False
    args.ckpt_format = "torch_dist"
    update_use_dist_ckpt(args)
    assert args.use_dist_ckpt is True
