"""Decoding a model split over an interleaved (virtual) pipeline: each pipeline rank holds several model chunks
(`--num-layers-per-virtual-pipeline-stage` / `--num-virtual-stages-per-pipeline-rank`).

Chunk `c` of pipeline rank `r` is virtual stage `c * p + r`, so a decoding step passes through chunk 0 of every
rank, then chunk 1 of every rank, and so on: the activation `[s, b, h]` goes from rank to rank with
`p2p_communication` (the last rank sends chunk `c`'s output to the first rank's chunk `c + 1`, the pipeline's
next rank wraps around). Chunk 0 of the first rank embeds the tokens; the last chunk of the last rank applies the
output layer and returns the logits gathered over its tensor-parallel ranks. Each chunk caches the keys and
values of its own layers in the step's context (the cache is keyed by the global layer number).

`VirtualPipelineModel` wraps the chunks of one rank as one module that `decode_forward` (and so
`generate_static_batch` and the server) calls as a whole model: it returns the logits on the last pipeline
rank and None on the others, as a pipeline stage does.
"""

from typing import Optional, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.inference.model_checks import check_inference_supported
from megatron.core.inference.pipeline_decoding import chunk_forward


def num_virtual_stages(config) -> int:
    return getattr(config, "virtual_pipeline_model_parallel_size", None) or 1


class VirtualPipelineModel(torch.nn.Module):
    """This pipeline rank's model chunks (in chunk order), decoded as one model; see the module docstring."""

    def __init__(self, chunks: Sequence[torch.nn.Module]):
        super().__init__()
        if not chunks:
            raise ValueError("VirtualPipelineModel needs this rank's model chunks, got none")
        expected = num_virtual_stages(chunks[0].config)
        if len(chunks) != expected:
            raise ValueError(f"{len(chunks)} model chunks on this rank, but the config has {expected} virtual "
                             "stages per pipeline rank (--num-virtual-stages-per-pipeline-rank)")
        check_inference_supported(chunks[0].config)
        self.chunks = torch.nn.ModuleList(chunks)

    def forward(self, tokens: torch.Tensor, position_ids=None, inference_context=None,
                runtime_gather_output=True) -> Optional[torch.Tensor]:
        """The logits gathered over tensor-parallel ranks on the last pipeline rank (as `decode_forward` asks),
        None on the others."""
        if not runtime_gather_output:
            raise ValueError("VirtualPipelineModel returns the logits gathered over tensor-parallel ranks: pass "
                             "runtime_gather_output=True")
        if position_ids is not None:
            raise ValueError("VirtualPipelineModel decodes the positions of the context's offset: pass "
                             "position_ids=None")
        if inference_context is None:
            raise ValueError("VirtualPipelineModel decodes through a key/value cache: pass inference_context")
        previous_rank = parallel_state.get_virtual_pipeline_model_parallel_rank()
        logits = None
        try:
            for index, chunk in enumerate(self.chunks):
                parallel_state.set_virtual_pipeline_model_parallel_rank(index)
                logits = chunk_forward(chunk, tokens, inference_context)
        finally:
            parallel_state.set_virtual_pipeline_model_parallel_rank(previous_rank)
        return logits
