"""`get_gpt_heterogeneous_layer_spec`, upstream's spec of a heterogeneous GPT's decoder. Each layer takes its shape
from the config's block configs (see megatron/core/transformer/heterogeneous/), so the spec is the decoder block
spec of the pipeline stage being built, checked against the config like any other."""

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec


def get_gpt_heterogeneous_layer_spec(config, use_te=False, vp_stage=None, pp_rank=None):
    """The block spec (one layer spec per layer of the stage) of a config with heterogeneous layers."""
    if not config.is_heterogeneous:
        raise ValueError("get_gpt_heterogeneous_layer_spec needs a config with heterogeneous layers "
                         "(--heterogeneous-layers-config-path); use get_gpt_decoder_block_spec otherwise")
    return get_gpt_decoder_block_spec(config, use_te, vp_stage=vp_stage, pp_rank=pp_rank)
