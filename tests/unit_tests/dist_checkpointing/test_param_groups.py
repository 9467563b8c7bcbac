"""Saved optimizer param groups are matched to this run's by what grouped their parameters, not by position."""

import pytest
import torch

from megatron.core.dist_checkpointing.optimizer_state import install_optimizer_state
from megatron.core.dist_checkpointing.param_groups import ParamGroupMismatchError
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer


class Tiny(torch.nn.Module):
    """A word embedding (as GPT's, tied to the output layer), a linear layer and a norm."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(8, 4)
        self.embedding.weight.is_embedding_or_output_parameter = True
        self.embedding.weight.is_embedding_parameter = True
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, tokens):
        return self.norm(self.linear(self.embedding(tokens)))


def _optimizer(model, decoupled_lr=None, **kwargs):
    config = OptimizerConfig(optimizer="adam", lr=1e-2, min_lr=1e-3, weight_decay=0.1, decoupled_lr=decoupled_lr)
    return get_megatron_optimizer(config, [model], **kwargs)


def _groups(optimizer):
    names = {id(param): name for name, param in optimizer.model_chunks[0].named_parameters()}
    return [(sorted(names[id(param)] for param in group["params"]), group["wd_mult"], group.get("max_lr"))
            for group in optimizer.param_groups]


def test_logical_load_restores_each_group_from_the_saved_group_grouped_alike():
    # Saved with --decoupled-lr; resumed adding --embedding-init-method-std, which takes the embedding out of
    # weight decay: three groups each time, the middle ones differ.
    saved = _optimizer(Tiny(), decoupled_lr=5e-3)
    saved.param_groups[0]["lr"], saved.param_groups[2]["lr"] = 0.25, 0.75  # as a scheduler would have set them
    saved_groups = [{key: value for key, value in group.items() if key != "params"} for group in saved.param_groups]
    resumed = _optimizer(Tiny(), decoupled_lr=5e-3, default_skip_embedding_weight_decay=True)
    before = _groups(resumed)
    assert before == [(["linear.weight"], 1.0, None),
                      (["linear.bias", "norm.bias", "norm.weight"], 0.0, None),
                      (["embedding.weight"], 0.0, 5e-3)]

    unmatched = install_optimizer_state(resumed, [], None, saved_groups, None)

    assert _groups(resumed) == before  # the norms are not weight-decayed, nor given the decoupled learning rate
    assert unmatched == [2]  # the checkpoint has no group of a decoupled, not weight-decayed embedding
    assert [group["lr"] for group in resumed.param_groups] == [0.25, 0.75, 5e-3]


def test_torch_style_load_refuses_groups_laid_out_otherwise_naming_the_group_and_flags():
    # Saved with --decoupled-lr; resumed with the embedding in a group of its own for another reason (a learning
    # rate multiplier): the same group sizes, so torch's positional loading would take it silently.
    saved = _optimizer(Tiny(), decoupled_lr=5e-3)
    model = Tiny()
    resumed = _optimizer(model, scale_lr_cond=lambda name, param: name == "embedding.weight", lr_mult=2.0)
    assert [len(group["params"]) for group in resumed.param_groups] == \
        [len(group["params"]) for group in saved.param_groups]
    with pytest.raises(ParamGroupMismatchError) as error:
        resumed.load_state_dict(saved.state_dict())
    message = str(error.value)
    assert message.startswith("optimizer param group 1 of the checkpoint (weight-decayed, lr_mult 1.0, decoupled "
                              "learning rate; 1 parameters) is not this run's param group 1 (weight-decayed, lr_mult "
                              "2.0; 1 parameters)")
    assert "--decoupled-lr" in message and "--no-load-optim" in message
