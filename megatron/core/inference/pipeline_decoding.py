"""One decoding step of a model split over pipeline stages (`--pipeline-model-parallel-size` > 1).

Every stage runs the step with the same tokens `[b, s]` (the sampled tokens are broadcast to every pipeline rank,
see `communication`): the first stage embeds them, each stage runs its own layers through the key/value cache of
those layers (a stage caches only its layers: the cache is keyed by the global layer number), and the activation
`[s, b, h]` travels stage to stage with `pipeline_parallel.p2p_communication` (`send_forward` here,
`recv_forward` on the next stage, the shape known from `s` and `b`). The last stage applies the output layer and
returns the logits gathered over its tensor-parallel ranks; the other stages return None.

A model that is not one stage of several (a whole `GPTModel`, or any module that decodes on its own, such as
`megatron.inference.virtual_pipeline.VirtualPipelineModel`, which runs all the model chunks of a rank of an
interleaved pipeline) is called as `model(tokens, None, inference_context=context, runtime_gather_output=True)`:
the logits gathered over tensor-parallel ranks, whatever the model's `parallel_output`. One chunk of an
interleaved pipeline alone is refused: its step needs the rank's other chunks in between.
"""

from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.inference.model_checks import check_inference_supported
from megatron.core.pipeline_parallel import p2p_communication


def is_pipeline_stage(model) -> bool:
    """True for a model that holds only part of the layers (it lacks the embedding or the output layer)."""
    return hasattr(model, "pre_process") and not (model.pre_process and model.post_process)


def decode_forward(model, tokens: torch.Tensor, context) -> Optional[torch.Tensor]:
    """The logits `[b, s, vocab]` of `tokens` (positions `context.sequence_len_offset ..`) on the last pipeline
    stage, None on the others. Every stage of the pipeline must call it with the same tokens and context state."""
    if not is_pipeline_stage(model):
        return model(tokens, None, inference_context=context, runtime_gather_output=True)
    return _stage_forward(model, tokens, context)


def _stage_forward(model, tokens, context):
    config = model.config
    check_inference_supported(config)
    virtual_stages = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    if virtual_stages > 1:
        raise ValueError(
            f"this model is one chunk of {virtual_stages} virtual stages per pipeline rank "
            "(--num-virtual-stages-per-pipeline-rank): decode all of this rank's chunks together, wrapped in "
            "megatron.inference.virtual_pipeline.VirtualPipelineModel"
        )
    return chunk_forward(model, tokens, context)


def chunk_forward(model, tokens, context):
    """One pipeline stage's (or one model chunk's) part of a step: embed the tokens (the first stage) or receive
    the activation from the previous stage, run this stage's layers through the cache, then send the result to the
    next stage, or (the last stage) return the logits `[b, s, vocab]` gathered over tensor-parallel ranks. The
    virtual pipeline calls it chunk by chunk, with each chunk's virtual rank set."""
    config = model.config
    batch, seq_length = tokens.shape
    shape = p2p_communication.activation_shape(seq_length=seq_length, micro_batch_size=batch, config=config)
    # GPTModel's own decoding helpers give the positions and rotary angles of this step, as its forward does.
    position_ids = model._decoding_position_ids(tokens, None, context)
    rotary_angles = model._decoding_rotary_angles(tokens, context, position_ids)
    decoder_input = None
    if model.pre_process:
        decoder_input = model.embedding(tokens, position_ids)
    else:
        model.set_input_tensor(p2p_communication.recv_forward(shape, config))
    try:
        hidden_states = model.decoder(decoder_input, rotary_pos_emb=rotary_angles, inference_context=context)
    finally:
        if not model.pre_process:
            model.set_input_tensor(None)
    if not model.post_process:
        p2p_communication.send_forward(hidden_states, config, shape)
        return None
    logits = tensor_parallel.gather_from_tensor_model_parallel_region(model._vocab_parallel_logits(hidden_states))
    return logits.transpose(0, 1).contiguous()
