"""Gather codecs (gather_codec.py) on 2 ranks with a codec that sends weights as bf16: the selected parameters get
groups of their own, travel as bf16, are decoded into the compute weights (the main weights rounded to bf16)
with an attribute attached while gathered, are re-encoded once per change of the shard, and a codec under a
strategy other than optim_grads_params is refused. A write inside `gathered_parameters()` is kept without the
decoding's rounding reaching the elements it did not set."""

import torch
import torch.distributed as dist

from tests.unit_tests.distributed.fsdp.fsdp_test_models import Block, make_model, make_optimizer, train_sharded
from tests.unit_tests.multiprocess_harness import run_on_ranks

STEPS = 3


def _bf16_codec_policy(encodes_log):
    from megatron_fsdp import GatherCodec, GatherCodecPolicy

    class Bf16Codec(GatherCodec):
        wire_dtype = torch.bfloat16

        def encode(self, shard_pieces, wire_pieces, shard_group):
            encodes_log.append(dist.get_world_size(shard_group))
            for piece, wire in zip(shard_pieces, wire_pieces):
                wire.copy_(piece)

        def decode(self, wire_params, compute_params, params):
            for wire, compute, param in zip(wire_params, compute_params, params):
                compute.copy_(wire)
                param.wire_value = wire

        def release(self, params):
            for param in params:
                del param.wire_value

    # The 7x13 weights: every block's fc1 (in a unit) and the output layer's (a root group).
    return GatherCodecPolicy(selects=lambda param: param.dim() == 2 and param.shape == (7, 13),
                             make_codec=Bf16Codec)


def _bf16_gather():
    from megatron_fsdp import DistributedDataParallelConfig, MegatronFSDP

    encodes = []
    module = make_model()
    config = DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads_params")
    model = MegatronFSDP(module, config, fsdp_unit_modules=[Block], gather_codec=_bf16_codec_policy(encodes))
    encoded_groups = [group for group in model.groups if group.codec is not None]
    result = {"encoded_names": sorted(name for group in encoded_groups for name in group.names),
              "plain_groups_clean": all(group.codec is None for group in model.groups if group not in encoded_groups)}
    optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
    from megatron_fsdp import fully_shard_optimizer

    fully_shard_optimizer(optimizer)
    encodes.clear()
    result["losses"] = train_sharded(model, optimizer, STEPS)
    # Per group, one encoding of the initial weights and one after each step (train_sharded ends with a forward
    # on the last step's weights), whatever the number of gathers (two per step for the units).
    result["encodes_per_group"] = len(encodes) / len(encoded_groups)
    result["encode_group_size"] = set(encodes)
    state = {name: value.full_tensor() for name, value in model.state_dict().items()
             if hasattr(value, "full_tensor")}
    with model.gathered_parameters() as gathered:
        compute = {name: param.detach().clone() for name, param in gathered.named_parameters()}
        attached = {name: hasattr(param, "wire_value") for name, param in gathered.named_parameters()}
    result["decoded_equal"] = all(torch.equal(compute[name], state[name].to(torch.bfloat16).float())
                                  for name in result["encoded_names"])
    result["rounded"] = all(not torch.equal(compute[name], state[name]) for name in result["encoded_names"])
    result["attached"] = sorted(name for name, has in attached.items() if has)
    result["released"] = not any(hasattr(group.params[0], "wire_value") for group in encoded_groups)
    # A write inside the context keeps the elements it set; the others keep their exact (not decoded) values.
    with model.gathered_parameters() as gathered, torch.no_grad():
        gathered.out.weight[0].fill_(0.5)
    expected = state["out.weight"].clone()
    expected[0] = 0.5
    result["written_kept_exactly"] = torch.equal(model.state_dict()["out.weight"].full_tensor(), expected)

    try:
        MegatronFSDP(make_model(), DistributedDataParallelConfig(data_parallel_sharding_strategy="optim_grads"),
                     fsdp_unit_modules=[Block], gather_codec=_bf16_codec_policy([]))
        result["refused"] = None
    except ValueError as error:
        result["refused"] = str(error)
    return result


def test_bf16_gather_codec_encodes_decodes_and_is_refused_outside_strategy_3():
    for result in run_on_ranks(2, _bf16_gather):
        assert result["encoded_names"] == sorted(
            ["blocks.0.fc1.weight", "blocks.1.fc1.weight", "blocks.2.fc1.weight", "out.weight"])
        assert result["plain_groups_clean"]
        assert result["losses"][-1] < result["losses"][0]
        assert result["encodes_per_group"] == STEPS + 1
        assert result["encode_group_size"] == {2}
        assert result["decoded_equal"] and result["rounded"]
        assert result["attached"] == result["encoded_names"]
        assert result["released"] and result["written_kept_exactly"]
        assert result["refused"] is not None and "optim_grads_params" in result["refused"]
