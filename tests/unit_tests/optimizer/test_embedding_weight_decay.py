"""`default_skip_embedding_weight_decay` (set by `--embedding-init-method-std`): the embedding weights
(`is_embedding_parameter`: word and learned position embeddings, a tied output layer's copy) go to the wd_mult 0
group, whatever wraps the model; without it they are decayed like every other matrix."""

import pytest
import torch

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_param_groups
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.multiprocess_harness import run_on_ranks

EMBEDDINGS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
WEIGHT_DECAY = 0.1


def _gpt(tied, embedding_std=1.0, **kwargs):
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, init_seed=1234, embedding_init_method_std=embedding_std)
    return GPTModel(config, vocab_size=64, max_sequence_length=16, share_embeddings_and_output_weights=tied,
                    **kwargs)


def _names_by_wd_mult(model, **kwargs):
    groups = get_param_groups([model], OptimizerConfig(lr=1e-3, weight_decay=WEIGHT_DECAY), **kwargs)
    name_of = {id(param): name for name, param in model.named_parameters()}
    names = {}
    for group in groups:
        assert group["weight_decay"] == WEIGHT_DECAY * group["wd_mult"]
        names.setdefault(group["wd_mult"], set()).update(name_of[id(param)] for param in group["params"])
    return names


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_embeddings_skip_weight_decay_only_when_asked(tied):
    model = _gpt(tied)
    skipped = _names_by_wd_mult(model, default_skip_embedding_weight_decay=True)
    default = _names_by_wd_mult(model)
    assert set(EMBEDDINGS) <= skipped[0.0] and set(EMBEDDINGS) <= default[1.0]
    # Only the embeddings move; an untied output layer keeps its weight decay.
    assert default[1.0] - skipped[1.0] == set(EMBEDDINGS)
    assert ("output_layer.weight" in skipped[1.0]) == (not tied)


def test_a_last_stage_tied_copy_skips_weight_decay_like_the_embedding():
    """Decayed on one stage but not on the other, the two copies of the tied weight would drift apart."""
    last_stage = _gpt(tied=True, pre_process=False)
    assert "output_layer.weight" in _names_by_wd_mult(last_stage, default_skip_embedding_weight_decay=True)[0.0]
    untied_last_stage = _gpt(tied=False, pre_process=False)
    assert "output_layer.weight" in _names_by_wd_mult(untied_last_stage, default_skip_embedding_weight_decay=True)[1.0]


def test_a_given_no_weight_decay_cond_decides_alone():
    names = _names_by_wd_mult(_gpt(tied=False), default_skip_embedding_weight_decay=True,
                              no_weight_decay_cond=lambda name, param: False)
    assert set(names) == {1.0}


# --------------------------------------------------------------------------------------------------------------
# Every data-parallel wrapper: one step on a batch that never looks up the upper half of the vocabulary. Those
# word-embedding rows get zero gradients, so AdamW leaves them exactly as they were unless weight decay shrinks
# them.
# --------------------------------------------------------------------------------------------------------------

WRAPPERS = {
    "ddp": dict(),
    "distributed_optimizer": dict(use_distributed_optimizer=True),
    "megatron_fsdp": dict(use_megatron_fsdp=True, use_distributed_optimizer=True,
                          data_parallel_sharding_strategy="optim_grads"),
    "torch_fsdp2": dict(use_torch_fsdp2=True),
}


def _full(tensor):
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _step_through_every_wrapper(skip_embedding_weight_decay):
    from megatron.core.distributed import DistributedDataParallelConfig, wrap_data_parallel
    from megatron.core.optimizer import get_megatron_optimizer
    from tests.unit_tests.distributed.precision_gpt import VOCAB, build_gpt, gpt_batch, gpt_loss

    results = {}
    for name, ddp_fields in WRAPPERS.items():
        model = build_gpt(untie=True, num_layers=1)  # FSDP2 refuses tied embeddings
        unused_rows = slice(VOCAB // 2, VOCAB)  # gpt_batch draws tokens below VOCAB // 2
        before = {"word": _full(model.embedding.word_embeddings.weight)[unused_rows],
                  "fc1": _full(model.decoder.layers[0].mlp.linear_fc1.weight)}
        chunk = wrap_data_parallel(model.config, DistributedDataParallelConfig(**ddp_fields), model)
        optimizer_config = OptimizerConfig(lr=1e-2, weight_decay=WEIGHT_DECAY, clip_grad=0.0,
                                           use_distributed_optimizer=ddp_fields.get("use_distributed_optimizer", False))
        optimizer = get_megatron_optimizer(optimizer_config, [chunk], default_skip_embedding_weight_decay=skip_embedding_weight_decay)
        gpt_loss(chunk, gpt_batch(0)).backward()
        chunk.finish_grad_sync()
        success, _, _ = optimizer.step()
        after = {"word": _full(model.embedding.word_embeddings.weight)[unused_rows],
                 "fc1": _full(model.decoder.layers[0].mlp.linear_fc1.weight)}
        results[name] = {
            "stepped": bool(success),
            "unused_rows_unchanged": torch.equal(before["word"], after["word"]),
            "fc1_changed": not torch.equal(before["fc1"], after["fc1"]),
            "wd_mults": sorted({group["wd_mult"] for group in optimizer.param_groups}),
        }
    return results


@pytest.mark.parametrize("skip", [True, False], ids=["skipped", "default"])
def test_every_wrapper_keeps_the_embeddings_out_of_weight_decay_when_asked(skip):
    results = run_on_ranks(1, _step_through_every_wrapper, skip)[0]
    assert sorted(results) == sorted(WRAPPERS)
    for name, result in results.items():
        # Without the skip the unused rows shrink by (1 - lr * weight decay): the check sees weight decay.
        assert result == {"stepped": True, "unused_rows_unchanged": skip, "fc1_changed": True,
                          "wd_mults": [0.0, 1.0]}, name
