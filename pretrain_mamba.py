"""Pretrain a hybrid Mamba model: `torchrun --nproc-per-node N pretrain_mamba.py --num-layers ...
--hybrid-override-pattern M-M*-M- ...` (upstream's script).

The model is a `MambaModel` (megatron/core/models/mamba/): Mamba-2, attention and MLP layers as the hybrid
flags say (every layer a Mamba layer without them); the data, the loss and everything else are pretrain_gpt.py's.
"""

from megatron.core.enums import ModelType
from megatron.core.models.mamba import MambaModel
from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron.training.global_vars import get_args
from megatron.training.model_config import core_transformer_config_from_args
from megatron.training.training import pretrain
from pretrain_gpt import forward_step, train_valid_test_datasets_provider


def model_provider(pre_process=True, post_process=True):
    """The hybrid layers of this pipeline stage, shaped by the command line."""
    args = get_args()
    return MambaModel(
        config=core_transformer_config_from_args(args),
        mamba_stack_spec=mamba_stack_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        hybrid_attention_ratio=args.hybrid_attention_ratio,
        hybrid_mlp_ratio=args.hybrid_mlp_ratio,
        hybrid_override_pattern=args.hybrid_override_pattern,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base,
    )


if __name__ == "__main__":
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"is_hybrid_model": True})
