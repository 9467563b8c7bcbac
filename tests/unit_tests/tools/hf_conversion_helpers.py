"""What the Hugging Face conversion tests of the MoE, gpt-oss and DeepSeek-V3 families share: the import as its
command line runs it, reading back what it wrote, and our model's logits (their `tools` fixture is in conftest.py)."""

import json
import os

import torch

TOOLS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "..", "tools", "checkpoint"))


def import_hf(convert_checkpoint, hf_dir, root, capsys):
    """--from hf as the command line runs it; the model flags it prints."""
    convert_checkpoint.main(["--from", "hf", "--input", str(hf_dir), "--output", str(root),
                             "--make-vocab-size-divisible-by", "64"])
    printed = capsys.readouterr().out
    return next(line for line in printed.splitlines() if line.startswith("model flags: "))[len("model flags: "):]


def read_config(directory):
    with open(os.path.join(directory, "config.json")) as stream:
        return json.load(stream)


def hf_tensors(directory):
    from megatron.core.dist_checkpointing import safetensors_format

    return safetensors_format.load_file(os.path.join(directory, "model.safetensors"))[0]


def eval_logits(state, tokens):
    """The logits of `state`'s model (a pretrain_helpers.TrainingState) on `tokens` `[batch, sequence]`."""
    model = state.model[0]
    model.eval()
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens)).clone()


def ungated_training_state(flags):
    """TINY_GPT without its --swiglu (for models whose MLP is not gated) + `flags`, as pretrain() builds it."""
    from tests.unit_tests.dist_checkpointing import pretrain_helpers

    tiny_gpt = pretrain_helpers.TINY_GPT
    pretrain_helpers.TINY_GPT = tiny_gpt.replace(" --swiglu", "")
    try:
        return pretrain_helpers.TrainingState(flags)
    finally:
        pretrain_helpers.TINY_GPT = tiny_gpt


def load_and_forward(state, tokens):
    """`state`'s model loaded as training loads it (its flags carry --load and --finetune); its logits on
    `tokens`. Closes `state`."""
    from megatron.training import checkpointing

    try:
        checkpointing.load_checkpoint(state.model, state.optimizer, state.scheduler, state.args)
        return eval_logits(state, tokens)
    finally:
        state.close()


def load_import_and_forward(flags, root, tokens):
    """On one rank: our model of TINY_GPT + `flags` (an import's printed flags), loaded from `root` as training
    loads it; its logits on `tokens`."""
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import TrainingState

    return load_and_forward(TrainingState(f"{flags} --load {root} --finetune --ckpt-format torch_dist"), tokens)


def train_save_and_forward(state, root, tokens, noise, perturb_buffers=None):
    """`state`'s model after one training step, its parameters moved by `noise` x N(0, 1) (and its buffers by
    `perturb_buffers(model, generator)` if given), saved in `root` as training saves it; its logits on `tokens`.
    Closes `state`."""
    from megatron.training import checkpointing

    try:
        state.train_steps(1)
        generator = torch.Generator().manual_seed(7)
        model = state.model[0]
        with torch.no_grad():
            for param in model.parameters():
                param.add_(noise * torch.randn(param.shape, generator=generator))
            if perturb_buffers is not None:
                perturb_buffers(model, generator)
        logits = eval_logits(state, tokens)
        state.args.save = root
        checkpointing.save_checkpoint(1, state.model, state.optimizer, state.scheduler, state.args)
        return logits
    finally:
        state.close()


def assert_logits_close(theirs, ours, label, tolerance):
    """transformers' logits `theirs` `[batch, sequence, vocab]` against ours (padded vocabulary: the extra rows are
    dropped), within `tolerance` (fp32 on CPU)."""
    difference = (theirs - ours[..., :theirs.shape[-1]]).abs().max().item()
    print(f"{label}: max |logit difference| {difference:.3g} (logits up to {theirs.abs().max().item():.3g})")
    assert difference <= tolerance


def assert_exports_back_bit_for_bit(convert_checkpoint, ours, hf_dir, back_dir):
    """`--to hf` of our checkpoint `ours` writes into `back_dir` every tensor of `hf_dir`, bit for bit, in its dtype;
    returns (the tensors of hf_dir, those of back_dir)."""
    written = convert_checkpoint.to_hf(str(ours), str(back_dir))
    before, after = hf_tensors(hf_dir), hf_tensors(back_dir)
    assert sorted(after) == sorted(before) == sorted(written)
    for name, tensor in before.items():
        assert after[name].dtype == tensor.dtype and torch.equal(after[name], tensor), name
    return before, after
