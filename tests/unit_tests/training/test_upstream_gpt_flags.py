"""Upstream GPT flags that once stopped at argparse: each now works as upstream documents it, or parses and stops
at validation with a message naming the flag and what to do instead; an unknown flag's error points to the list
of flags without guessing where it came from."""

import sys
import types

import pytest
import torch

from megatron.core import num_microbatches_calculator as calculator
from megatron.training.arguments import parse_args, validate_args

TINY_GPT = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 --lr 1e-3 "
    "--mock-data --vocab-size 127 --distributed-backend gloo"
)


@pytest.fixture(autouse=True)
def one_rank(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    calculator.destroy_num_microbatches_calculator()
    yield
    calculator.destroy_num_microbatches_calculator()


def _validated(extra, length="--train-iters 4"):
    return validate_args(parse_args(args=f"{TINY_GPT} {length} {extra}".split()))


def _refusal(extra, length="--train-iters 4"):
    with pytest.raises(ValueError) as error:
        _validated(extra, length)
    return str(error.value)


# --decrease-batch-size-if-needed ---------------------------------------------------------------------------------


def test_decreased_ramp_runs_the_largest_multiple_of_each_step():
    # 4 samples per microbatch step (mbs 2 x DP 2); the ramp 6, 12, 18, 24 moves one increment per 36 / 3 samples.
    ramp = calculator.RampupBatchsizeNumMicroBatchesCalculator(24, 2, 2, 6, 6, 36, decrease_batch_size_if_needed=True)
    steps = {}
    for consumed in (0, 11, 12, 24, 36, 37):
        ramp.update(consumed)
        steps[consumed] = (ramp.current_global_batch_size, ramp.current_running_global_batch_size,
                           ramp.num_microbatches)
    assert steps == {0: (6, 4, 1), 11: (6, 4, 1), 12: (12, 12, 3), 24: (18, 16, 4), 36: (24, 24, 6),
                     37: (24, 24, 6)}
    with pytest.raises(ValueError) as error:
        calculator.RampupBatchsizeNumMicroBatchesCalculator(24, 2, 2, 6, 6, 36)
    assert "must be multiples of --micro-batch-size x data-parallel size (4)" in str(error.value)
    assert "--decrease-batch-size-if-needed" in str(error.value)


def test_decreased_constant_batch_and_the_process_wide_calculator():
    constant = calculator.ConstantNumMicroBatchesCalculator(30, 4, 2, decrease_batch_size_if_needed=True)
    assert (constant.current_global_batch_size, constant.current_running_global_batch_size,
            constant.num_microbatches) == (30, 24, 3)
    calculator.init_num_microbatches_calculator(0, (6, 6, 36), 24, 2, 2,
                                                decrease_batch_size_if_needed=True)
    calculator.update_num_microbatches(24)
    assert (calculator.get_current_global_batch_size(), calculator.get_current_running_global_batch_size(),
            calculator.get_num_microbatches()) == (18, 16, 4)
    with pytest.raises(ValueError, match=r"--global-batch-size: global batch size 3 is below one microbatch"):
        calculator.ConstantNumMicroBatchesCalculator(3, 2, 2, decrease_batch_size_if_needed=True)


def test_decrease_batch_size_if_needed_validation(monkeypatch, capsys):
    assert "or pass --decrease-batch-size-if-needed" not in _refusal("--global-batch-size 7")
    assert "--global-batch-size (7) must be a positive multiple" in _refusal("--global-batch-size 7")
    args = _validated("--global-batch-size 7 --decrease-batch-size-if-needed")
    assert args.global_batch_size == 6 and args.lr_schedule_samples.decay == 4 * 6
    assert "running 6 samples per step" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    # Ramp at DP 2 (4 samples per step), counting what runs: 4, 4, 4 (12 consumed), 12 (24), 16 (40 > 36), then
    # (100 - 40) // 24 = 2 full batches.
    ramp = "--global-batch-size 24 --rampup-batch-size 6 6 36 --decrease-batch-size-if-needed"
    args = _validated(ramp, length="--train-samples 100")
    assert (args.global_batch_size, args.rampup_batch_size, args.train_iters) == (24, (6, 6, 36), 5 + 2)
    assert "must be multiples of" in _refusal(ramp.replace(" --decrease-batch-size-if-needed", ""),
                                              length="--train-samples 100")
    assert "--rampup-batch-size start: global batch size 3 is below one microbatch" in _refusal(
        "--global-batch-size 24 --rampup-batch-size 3 3 36 --decrease-batch-size-if-needed",
        length="--train-samples 100")


# --no-initialization --------------------------------------------------------------------------------------------


class _CountingNormal:
    def __init__(self):
        self.calls = 0

    def __call__(self, tensor):
        self.calls += 1
        return torch.nn.init.normal_(tensor, std=0.02)


def _gpt(perform_initialization, init_method):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2, add_bias_linear=True,
                               perform_initialization=perform_initialization, init_method=init_method,
                               output_layer_init_method=init_method, embedding_init_method=init_method)
    return GPTModel(config, vocab_size=32, max_sequence_length=8, share_embeddings_and_output_weights=False)


def test_no_initialization_reaches_the_transformer_config():
    from megatron.training.argument_groups.model import transformer_config_kwargs

    assert transformer_config_kwargs(_validated(""))["perform_initialization"] is True
    assert transformer_config_kwargs(_validated("--no-initialization"))["perform_initialization"] is False


def test_uninitialized_model_has_the_shapes_and_loads_a_checkpoint_to_its_values(tmp_path):
    drawn = _CountingNormal()
    initialized = _gpt(True, drawn)
    assert drawn.calls > 0
    skipped = _CountingNormal()
    uninitialized = _gpt(False, skipped)
    assert skipped.calls == 0  # no weight drew its random values
    reference = initialized.state_dict()
    state = uninitialized.state_dict()
    assert {name: value.shape for name, value in state.items()} == {
        name: value.shape for name, value in reference.items()}
    biases = [name for name in state if name.endswith("linear_fc1.bias")]
    assert biases and all(torch.count_nonzero(state[name]) == 0 for name in biases)  # still zeroed
    torch.save(reference, tmp_path / "model.pt")
    uninitialized.load_state_dict(torch.load(tmp_path / "model.pt"), strict=True)
    for name, value in uninitialized.state_dict().items():
        assert torch.equal(value, reference[name]), name


@pytest.mark.fake_te_bases
def test_no_initialization_reaches_transformer_engine_layers():
    from megatron.core.extensions import transformer_engine as te_backend
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.extensions.test_transformer_engine import _FakeTELinearBase, _FakeTELayerNormLinearBase

    column, _, _ = te_backend.make_te_linear_classes(_FakeTELinearBase, _FakeTELayerNormLinearBase)
    for perform_initialization, expected_calls in ((True, 1), (False, 0)):
        config = TransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                   transformer_impl="transformer_engine",
                                   perform_initialization=perform_initialization)
        init = _CountingNormal()
        layer = column(16, 24, config=config, init_method=init)
        assert init.calls == expected_calls and layer.weight.shape == (24, 16)


# --trust-remote-code --------------------------------------------------------------------------------------------


class _FakePretrainedTokenizer:
    """What `transformers.AutoTokenizer.from_pretrained` returns for a directory with custom tokenizer code."""

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3}
    unk_token, unk_token_id, eos_token, pad_token = "<unk>", 0, "<eos>", None

    def encode(self, text, add_special_tokens=True):
        return [self.vocab.get(word, 0) for word in text.split()] + ([1] if add_special_tokens else [])

    def decode(self, token_ids, skip_special_tokens=False):
        names = {index: word for word, index in self.vocab.items()}
        return " ".join(names[int(index)] for index in token_ids)

    def convert_tokens_to_ids(self, token):
        return self.vocab.get(token, self.unk_token_id)

    def __len__(self):
        return len(self.vocab)


@pytest.fixture
def from_pretrained_calls(monkeypatch):
    calls = []

    def from_pretrained(path, **kwargs):
        calls.append((path, kwargs))
        return _FakePretrainedTokenizer()

    fake = types.ModuleType("transformers")
    fake.AutoTokenizer = types.SimpleNamespace(from_pretrained=from_pretrained)
    monkeypatch.setitem(sys.modules, "transformers", fake)
    return calls


@pytest.mark.parametrize("flag, trusted", [("", False), ("--trust-remote-code", True)])
def test_trust_remote_code_reaches_from_pretrained(tmp_path, from_pretrained_calls, flag, trusted):
    from megatron.training.tokenizer import build_tokenizer_from_args

    args = _validated(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path} {flag}")
    assert args.trust_remote_code is trusted
    tokenizer = build_tokenizer_from_args(args)
    assert from_pretrained_calls == [(str(tmp_path), {"trust_remote_code": trusted})]
    assert tokenizer.tokenize("hello world") == [2, 3, 1]  # special tokens added, as upstream's tokenizer(text)
    assert tokenizer.detokenize([3, 2]) == "world hello"
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.pad) == (4, 1, 1)


def test_a_tokenizer_json_never_goes_through_from_pretrained(tmp_path, from_pretrained_calls):
    pytest.importorskip("tokenizers")
    from megatron.training.tokenizer.bpe_training import save_bpe_tokenizer, train_bpe_tokenizer
    from megatron.training.tokenizer import build_tokenizer

    save_bpe_tokenizer(train_bpe_tokenizer(["hello world"] * 20, vocab_size=270), str(tmp_path))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path), trust_remote_code=True)
    assert from_pretrained_calls == [] and tokenizer.vocab_size > 0


def test_trust_remote_code_needs_the_huggingface_tokenizer():
    assert "--trust-remote-code applies to --tokenizer-type HuggingFaceTokenizer" in _refusal("--trust-remote-code")


# Flags refused at validation ------------------------------------------------------------------------------------


def test_distribute_saved_activations_rules(monkeypatch):
    assert _refusal("--distribute-saved-activations").endswith("it needs --recompute-granularity full")
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = _refusal("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 "
                       "--tensor-model-parallel-size 2 --sequence-parallel --distribute-saved-activations")
    assert message.startswith("--distribute-saved-activations does not work with --sequence-parallel")


def test_overlap_param_gather_with_optimizer_step_rules_then_refusal(monkeypatch):
    flag = "--overlap-param-gather-with-optimizer-step"
    assert _refusal(flag) == f"{flag} needs --use-distributed-optimizer"
    assert _refusal(f"{flag} --use-distributed-optimizer") == f"{flag} needs --overlap-param-gather"
    overlapped = f"{flag} --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"
    assert _refusal(overlapped).startswith(f"{flag} needs the interleaved pipeline")
    monkeypatch.setenv("WORLD_SIZE", "2")
    message = _refusal(f"{overlapped} --num-layers 4 --pipeline-model-parallel-size 2 "
                       "--num-layers-per-virtual-pipeline-stage 1 --global-batch-size 4")
    assert message.startswith(f"{flag} is not implemented")
    assert "already overlaps the next forward" in message and message.endswith("drop the flag")


@pytest.mark.parametrize("extra, what_to_do", [
    ("--test-mode", "run the unit tests (pytest tests/unit_tests)"),
    ("--decoder-num-layers 2", "give its layers with --num-layers and drop --decoder-num-layers"),
    ("--load-main-params-from-ckpt --no-load-optim",
     "already takes the fp32 main weights from the checkpoint (its optimizer.state.<name>.fp32_param"),
])
def test_flags_refused_at_validation(extra, what_to_do):
    message = _refusal(extra)
    assert message.startswith(f"{extra.split()[0]} is not supported") and what_to_do in message


def test_unknown_flag_error_points_to_the_flag_list(capsys):
    with pytest.raises(SystemExit):
        parse_args(args=f"{TINY_GPT} --train-iters 4 --no-such-flag".split())
    error = capsys.readouterr().err
    assert "unrecognized arguments: --no-such-flag" in error and "docs/training_flags.md" in error
    assert "model families" not in error
