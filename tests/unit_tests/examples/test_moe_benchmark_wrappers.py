"""`examples/moe/benchmark_wrappers.py`: the step times and the memory record come from the training iterations of
the metrics file, and its runs end without the final evaluation a run reaching `--train-iters` makes."""

import json

from examples.moe import benchmark_wrappers


def test_training_records_leave_out_the_evaluations(tmp_path):
    lines = [{"iteration": i, "split": "train", "iteration-time": 0.1 * i, "expert-params-bytes": 100 + i}
             for i in range(1, 4)]
    lines += [{"iteration": 3, "split": "validation", "when": "on validation set", "lm loss": 6.9},
              {"iteration": 3, "split": "test", "when": "on test set", "lm loss": 6.9}]
    records = benchmark_wrappers.training_records(json.loads(json.dumps(line)) for line in lines)
    assert [record["iteration"] for record in records] == [1, 2, 3]
    assert [record["iteration-time"] for record in records[1:]] == [0.1 * 2, 0.1 * 3]
    assert records[-1]["expert-params-bytes"] == 103


def test_arms_train_without_evaluation():
    from megatron.training.arguments import parse_args

    for model in benchmark_wrappers.MODELS:
        for expert_parallel_size, flags, _ in benchmark_wrappers.ARMS.values():
            argv = (f"{benchmark_wrappers.model_flags(model)} {flags} --expert-model-parallel-size "
                    f"{expert_parallel_size} --train-iters 4").split()
            args = parse_args(args=argv)
            assert args.eval_iters == 0
            assert args.num_experts == benchmark_wrappers.EXPERTS
