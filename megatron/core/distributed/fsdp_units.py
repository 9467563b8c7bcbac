"""Which modules the two FSDP wrappers make units of communication by default (one place for both)."""


def default_fsdp_unit_modules(embedding_unit: bool = False) -> tuple:
    """Module classes whose instances become FSDP units (one all-gather before their forward / backward and
    one gradient reduce-scatter after their backward each).

    Both wrappers: every `TransformerLayer` (and a hybrid model's `MambaLayer`), which bounds the gathered weights
    to about one layer at a time.
    The embedding differs, on purpose:
    - Megatron-FSDP (`MegatronFSDPAdapter`, `embedding_unit=False`): the embedding stays in the root group with
      the final norm and the output layer, so a tied word-embedding / output weight of a single-stage model is
      gathered once and stays gathered from the forward until its gradient is in.
    - FSDP2 (`TorchFSDP2`, `embedding_unit=True`): the embedding is a unit of its own and is resharded after its
      forward. FSDP2 keeps the root unit gathered from forward to backward, so leaving the embedding (one of
      the largest weights) in it would hold it gathered all step; FSDP2 refuses tied embeddings instead.
    """
    from megatron.core.ssm.mamba_layer import MambaLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if not embedding_unit:
        return (TransformerLayer, MambaLayer)
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding

    return (TransformerLayer, MambaLayer, LanguageModelEmbedding)
