"""examples/post_training/quantize.py: modelopt PTQ (FP8 and INT8 fake quantization) of a trained tiny GPT on 2
ranks, calibrated on corpus batches; the validation loss is reported before and after, and a fresh model restored
from the saved `modelopt_state` and weights reproduces the quantized model's outputs exactly."""

import pytest
import torch

from megatron.core.optional_deps import modelopt_installed
from tests.unit_tests.corpus_data import write_corpus_prefix
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.post_training.modelopt_plugins import import_modelopt_plugins

pytestmark = pytest.mark.skipif(
    not modelopt_installed(), reason="nvidia-modelopt is not installed (pip install -e '.[modelopt]')"
)

TINY_GPT = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --max-position-embeddings 32 "
    "--normalization RMSNorm --swiglu --hidden-dropout 0 --attention-dropout 0 --make-vocab-size-divisible-by 64 "
    "--micro-batch-size 4 --global-batch-size 8 --lr 3e-3 --seed 1234 --tokenizer-type ByteLevelTokenizer "
    "--split 90,10,0 --num-workers 0 --log-interval 1 --ckpt-format torch"
)
# Fake quantization of a small model changes its loss by a few hundredths at most (FP8 operands carry a
# relative error of up to 2**-4, INT8 per-channel weights / per-tensor activations about 2**-8 of their range).
LOSS_CHANGE_BOUND = 0.1


def _train_then_quantize(prefix, workdir):
    import pretrain_gpt
    from examples.post_training import quantize
    from megatron.core.enums import ModelType
    from megatron.training import checkpointing
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import _teardown, pretrain

    import_modelopt_plugins()
    base = f"{TINY_GPT} --data-path {prefix}"
    pretrain(pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
             ModelType.encoder_or_decoder, pretrain_gpt.forward_step,
             argv=f"{base} --train-iters 12 --eval-iters 0 --save {workdir}/trained".split())

    results = {}
    # int8 with upstream's flags: --export-quant-cfg, --calib-size in samples (2 global batches), saved under --save.
    for quant_cfg, flags in (("fp8", "--quant-cfg fp8 --calib-batches 2 --export-dir"),
                             ("int8", "--export-quant-cfg int8 --calib-size 16 --save")):
        export = f"{workdir}/{quant_cfg}"
        argv = f"{base} --train-iters 12 --load {workdir}/trained --eval-iters 2 --eval-interval 10 " \
               f"{flags} {export}"
        args = initialize_megatron(extra_args_provider=quantize.add_quantize_arguments, args=argv.split())
        try:
            result = quantize.run(args)
            quantized = result["model"]
            tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
            positions = torch.arange(32).unsqueeze(0).expand(2, -1)
            with torch.no_grad():
                expected = quantized(tokens, positions)
                trained = quantize.build_model(args)
                checkpointing.load_checkpoint([trained], None, None, args)
                plain = trained(tokens, positions)
                restored = quantize.build_model(args)
                saved = quantize.load_quantized_model(restored, export)
                actual = restored(tokens, positions)
            results[quant_cfg] = {
                "quant_cfg": args.quant_cfg,
                "calibration_batches": quantize.calibration_batches(args),
                "export": result.get("export"),
                "before": result["before"],
                "after": result["after"],
                "restored_equal": torch.equal(actual, expected),
                "quantized_differs_from_plain": not torch.equal(plain, expected),
                "output_change": ((expected - plain).norm() / plain.norm()).item(),
                "saved_losses": saved["validation_loss"],
                "num_quantizers": sum(1 for name, _ in restored.named_modules() if name.endswith("weight_quantizer")),
            }
        finally:
            _teardown(args)
    return results


def test_ptq_reports_losses_and_restores_from_modelopt_state(tmp_path):
    prefix = write_corpus_prefix(tmp_path, 300)
    results = run_on_ranks(2, _train_then_quantize, prefix, str(tmp_path))
    assert results[0] == results[1]
    for quant_cfg, result in results[0].items():
        assert result["quant_cfg"] == quant_cfg and result["calibration_batches"] == 2, result
        assert result["export"].startswith(f"{tmp_path}/{quant_cfg}/"), result
        assert result["before"] < 5.0, result  # a trained model (untrained: ~5.6)
        assert result["after"] != result["before"], result  # quantization is in effect
        assert abs(result["after"] - result["before"]) < LOSS_CHANGE_BOUND, result
        assert result["restored_equal"] and result["quantized_differs_from_plain"], result
        assert 1e-5 < result["output_change"] < 0.05, result  # logits of the quantized vs the trained model
        assert result["saved_losses"] == {"before": result["before"], "after": result["after"]}
        assert result["num_quantizers"] == 2 * 4 + 1  # qkv, proj, fc1, fc2 per layer, and the output layer


def test_calibration_size_is_given_one_way():
    from argparse import Namespace

    from examples.post_training.quantize import calibration_batches

    def args(batches=None, size=None):
        return Namespace(calib_batches=batches, calib_size=size, global_batch_size=8)

    assert [calibration_batches(args()), calibration_batches(args(batches=3)), calibration_batches(args(size=17))] \
        == [4, 3, 3]
    for wrong, message in ((args(2, 16), "not both"), (args(size=0), "--calib-size"), (args(0), "--calib-batches")):
        with pytest.raises(ValueError, match=message):
            calibration_batches(wrong)
