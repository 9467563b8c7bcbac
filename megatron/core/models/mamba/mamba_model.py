"""`MambaModel`: upstream's hybrid language model of Mamba-2, attention and MLP layers.

It is a `GPTModel` whose decoder layers follow a hybrid pattern (`megatron.core.ssm.mamba_config`): embedding,
the layers, the final norm and the output layer, with the GPT model's pipeline split, tensor and sequence
parallelism, data-parallel wrappers, checkpoints and losses. Upstream's default position embedding is none (the
Mamba layers carry the order); `rope` applies to the attention layers.
"""

import dataclasses
from typing import Optional

from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.mamba.mamba_layer_specs import MambaStackSpec
from megatron.core.ssm.mamba_config import PATTERN_FLAG
from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers


class MambaModel(GPTModel):
    """Args in upstream's order: config, mamba_stack_spec (None or `mamba_layer_specs.mamba_stack_spec`),
    vocab_size, max_sequence_length, pre_process, hybrid_attention_ratio, hybrid_mlp_ratio,
    hybrid_override_pattern (see `mamba_hybrid_layer_allocation`; a config that already holds a
    `hybrid_layer_pattern` needs none of the three, or the same pattern), post_process and the GPT model's
    keywords. Without a pattern or ratios every layer is a Mamba layer."""

    def __init__(
        self,
        config,
        mamba_stack_spec=None,
        vocab_size: int = None,
        max_sequence_length: int = None,
        pre_process: bool = True,
        hybrid_attention_ratio: float = 0.0,
        hybrid_mlp_ratio: float = 0.0,
        hybrid_override_pattern: Optional[str] = None,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "none",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        scatter_embedding_sequence_parallel: bool = True,
        seq_len_interpolation_factor: Optional[float] = None,
        pg_collection=None,
        vp_stage: Optional[int] = None,
    ):
        if mamba_stack_spec is not None and not isinstance(mamba_stack_spec, MambaStackSpec):
            raise TypeError(f"MambaModel(mamba_stack_spec={mamba_stack_spec!r}): layers are built from the config "
                            "and the hybrid pattern; pass megatron.core.models.mamba.mamba_layer_specs."
                            "mamba_stack_spec or None")
        if pg_collection is not None:
            raise ValueError("MambaModel(pg_collection=...) is not supported: the layers use parallel_state's "
                             "process groups; pass None")
        config = self._with_pattern(config, hybrid_attention_ratio, hybrid_mlp_ratio, hybrid_override_pattern)
        super().__init__(
            config, vocab_size=vocab_size, max_sequence_length=max_sequence_length, pre_process=pre_process,
            post_process=post_process, fp16_lm_cross_entropy=fp16_lm_cross_entropy, parallel_output=parallel_output,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type, rotary_percent=rotary_percent, rotary_base=rotary_base,
            scatter_embedding_sequence_parallel=scatter_embedding_sequence_parallel,
            seq_len_interpolation_factor=seq_len_interpolation_factor, vp_stage=vp_stage,
        )
        self.hybrid_layer_pattern = config.hybrid_layer_pattern

    @staticmethod
    def _with_pattern(config, attention_ratio, mlp_ratio, override_pattern):
        given = override_pattern is not None or attention_ratio or mlp_ratio
        if config.hybrid_layer_pattern is not None and not given:
            return config
        pattern = allocate_layers(config.num_layers, attention_ratio, mlp_ratio, override_pattern)
        if config.hybrid_layer_pattern not in (None, pattern):
            raise ValueError(f"the config's hybrid_layer_pattern {config.hybrid_layer_pattern!r} and the pattern "
                             f"the MambaModel arguments give ({pattern!r}) differ: give the layers one way "
                             f"({PATTERN_FLAG})")
        return dataclasses.replace(config, hybrid_layer_pattern=pattern)
