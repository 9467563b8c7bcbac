"""Multi-token prediction (DeepSeek-V3; upstream Megatron-LM's `--mtp-num-layers`): extra prediction depths after
the decoder, on the last pipeline stage.

Depth k = 1..N takes the previous depth's hidden states h^{k-1} (h^0: the decoder's output after its final norm,
what the output layer reads) and the word embedding of the input tokens shifted left by k, and computes

    h^k = final_layernorm(transformer_layer(eh_proj([enorm(emb(tokens << k)) ; hnorm(h^{k-1})])))

where `[a ; b]` concatenates along the hidden dimension and `eh_proj` projects 2H -> H (a column-parallel linear
under tensor parallelism, gathered back to the full width). The embedding is the model's own (shared) word
embedding and the logits come from the model's own output layer. Depth k's loss at position i is the cross
entropy against the label shifted left by k (the token i + k + 1); positions whose shifted label falls off the
end of the sequence (i >= s - k) are masked out, and the loss mask is shifted likewise (`masked_depth_losses`).

Under context parallelism each rank holds two load-balanced chunks of the sequence, and every shift (input ids,
position ids, labels, loss mask) is along the whole sequence: each chunk is completed by the first elements of the
next chunk, which another rank may hold (`shift_left` with a `cp_group`, see `context_parallel.sequence_shift`).
The depths' means are over the whole sequence's tokens (`mtp_loss_for_backward` with a `cp_group`).

The training objective is LM loss + F / N * sum_k mean_k, F = `mtp_loss_scaling_factor`, each depth's mean over
its unmasked tokens (`mtp_loss_for_backward`); with `calculate_per_token_loss` the depths' token sums are added
instead, as upstream. The logged `lm loss` stays the main model's; each depth's token-weighted mean over the
iteration's microbatches and data-parallel ranks is logged as `mtp_{k} loss` (`track_mtp_losses`,
`reduce_mtp_losses_for_logging`).

With `mtp_use_repeated_layer` (`--mtp-use-repeated-layer`, as upstream) the block holds one depth's layer,
`mtp.layers.0`, and runs it at every depth k = 1..N (the shift by k and the chain h^{k-1} -> h^k as above); its
MoE auxiliary losses are logged under each depth's own entry.

Parameter names follow upstream's MultiTokenPredictionBlock: `mtp.layers.{k-1}.enorm`, `.hnorm`, `.eh_proj`,
`.transformer_layer.*`, `.final_layernorm`. Each depth's transformer layer is a `TransformerLayer` built like the
decoder's last layer (the same attention and MLP kind, dense or MoE, as upstream's MTP spec); its initial weights
come from a seed of their own (`derive_init_seed(base, "mtp", k)`), so adding MTP leaves the decoder's weights
unchanged.
"""

from typing import Dict, List

import torch
import torch.distributed as dist

from megatron.core import parallel_state, tensor_parallel
from megatron.core.fp8_utils import get_fp8_context
from megatron.core.offloading.activations import ActivationOffloader
from megatron.core.offloading.fine_grained import attach_fine_grained_offloading
from megatron.core.packed_sequences import packed_rows, shift_left_within_sequences
from megatron.core.transformer.context_parallel.sequence_shift import shift_left_across_cp_ranks
from megatron.core.transformer.init_seeds import build_with_init_seed, derive_init_seed, resolve_base_init_seed
from megatron.core.transformer.moe.router import log_aux_losses_as_layer
from megatron.core.transformer.norms import build_norm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer


def context_parallel_group_or_none(config):
    """The context-parallel group when `config` splits the sequence over more than one rank, else None."""
    if getattr(config, "context_parallel_size", 1) > 1:
        return parallel_state.get_context_parallel_group()
    return None


def shift_left(tensor: torch.Tensor, shift: int, fill=0, cp_group=None) -> torch.Tensor:
    """`tensor` (`[..., s]`) moved `shift` positions to the left along its last dim, the last `shift` positions
    filled with `fill` (upstream's `roll_tensor` without the wrap-around). With a `cp_group` of more than one rank
    `tensor` is this rank's two chunks of the sequence and the shift is along the whole sequence (collective)."""
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        return shift_left_across_cp_ranks(tensor, shift, cp_group, fill)
    if shift == 0:
        return tensor
    kept = tensor[..., shift:]
    tail = torch.full((*tensor.shape[:-1], min(shift, tensor.shape[-1])), fill, dtype=tensor.dtype,
                      device=tensor.device)
    return torch.cat([kept, tail], dim=-1)


class MultiTokenPredictionLayer(torch.nn.Module):
    """Depth `depth` (1-based) of multi-token prediction; see the module docstring.

    Args: config; depth: 1..mtp_num_layers; base_init_seed: the model's base init seed (None: `config.init_seed`,
    else the default generator's seed).
    """

    def __init__(self, config: TransformerConfig, depth: int, base_init_seed=None):
        super().__init__()
        if base_init_seed is None:
            base_init_seed = resolve_base_init_seed(config)
        self.config = config
        self.depth = depth
        hidden = config.hidden_size
        self.enorm = build_norm(config, hidden)
        self.hnorm = build_norm(config, hidden)
        self.eh_proj = build_with_init_seed(
            derive_init_seed(base_init_seed, "mtp", depth, "eh_proj"),
            lambda: tensor_parallel.ColumnParallelLinear(
                2 * hidden, hidden, config=config, init_method=config.init_method, bias=False, gather_output=False
            ),
        )
        # The decoder's last layer number: the same layer kind (MoE or dense, FP8 or not) as that layer, as
        # upstream's MTP spec; the weights come from the depth's own seed.
        self.transformer_layer = TransformerLayer(
            config, layer_number=config.num_layers, base_init_seed=derive_init_seed(base_init_seed, "mtp", depth)
        )
        log_aux_losses_as_layer(self.transformer_layer, config.num_layers + depth)  # MoE: its own log entry
        self.final_layernorm = build_norm(config, hidden)
        self.activation_offloader = None
        if config.fine_grained_activation_offloading:  # the depth's layer offloads the pieces as the decoder's do
            self.activation_offloader = ActivationOffloader(min_offloaded_tensor_size=config.min_offloaded_tensor_size)
            attach_fine_grained_offloading(self.transformer_layer, self.activation_offloader, config.offload_modules)

    def forward(self, embeddings, hidden_states, attention_mask=None, rotary_pos_emb=None, packed_seq_params=None):
        """`embeddings` (of the tokens shifted by `depth`) and `hidden_states` (h^{depth-1}): `[s, b, h]`, or
        `[s / tp, b, h]` with sequence parallelism -> h^{depth}, same shape. `packed_seq_params` goes to the
        layer's attention."""
        combined = torch.cat([self.enorm(embeddings), self.hnorm(hidden_states)], dim=-1)
        projected, _ = self.eh_proj(combined)  # [s, b, h / tp]; under SP the sequence is gathered first
        projected = tensor_parallel.gather_from_tensor_model_parallel_region(projected)  # [s, b, h]
        if self.config.sequence_parallel:
            projected = tensor_parallel.scatter_to_sequence_parallel_region(projected)
        fp32_residual = getattr(self.config, "fp32_residual_connection", False)
        if fp32_residual:  # as in the decoder block: the layer's residual stream is fp32
            projected = projected.float()
        with get_fp8_context(self.config, self.transformer_layer.layer_number - 1):
            output, _ = self.transformer_layer(projected, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
                                               packed_seq_params=packed_seq_params)
        if fp32_residual:
            output = output.to(self.config.params_dtype)
        return self.final_layernorm(output)


class MultiTokenPredictionBlock(torch.nn.Module):
    """The `config.mtp_num_layers` depths, run one after the other on the last pipeline stage (one shared layer
    under `config.mtp_use_repeated_layer`)."""

    def __init__(self, config: TransformerConfig, base_init_seed=None):
        super().__init__()
        if not config.mtp_num_layers:
            raise ValueError("MultiTokenPredictionBlock needs --mtp-num-layers >= 1")
        self.config = config
        self.repeated = bool(getattr(config, "mtp_use_repeated_layer", False))
        built = 1 if self.repeated else config.mtp_num_layers
        self.layers = torch.nn.ModuleList(
            MultiTokenPredictionLayer(config, depth, base_init_seed) for depth in range(1, built + 1)
        )

    def layer_at(self, depth: int) -> MultiTokenPredictionLayer:
        """The layer that computes depth `depth` (1-based)."""
        if not self.repeated:
            return self.layers[depth - 1]
        layer = self.layers[0]
        log_aux_losses_as_layer(layer.transformer_layer, self.config.num_layers + depth)
        return layer

    def forward(self, input_ids, position_ids, hidden_states, embedding, attention_mask=None,
                rotary_pos_emb=None, packed_seq_params=None) -> List[torch.Tensor]:
        """h^1..h^N (each like `hidden_states`, the decoder's normalised output h^0). `embedding(ids,
        position_ids)` is the model's embedding; `input_ids` / `position_ids` are `[b, s]`. With
        `packed_seq_params` (`[1, t]` ids) the ids and positions shift within each packed sequence."""
        outputs = []
        cp_group = context_parallel_group_or_none(self.config)
        if packed_seq_params is None:
            def shift(tensor, depth):
                return shift_left(tensor, depth, cp_group=cp_group)
        else:
            segments = packed_rows("MultiTokenPredictionBlock.forward", packed_seq_params, input_ids.shape[1],
                                   input_ids.shape[0], input_ids.device).segments

            def shift(tensor, depth):
                return shift_left_within_sequences(tensor, depth, segments)[0]
        for depth in range(1, self.config.mtp_num_layers + 1):
            layer = self.layer_at(depth)
            shifted_positions = None if position_ids is None else shift(position_ids, depth)
            embeddings = embedding(shift(input_ids, depth), shifted_positions)
            hidden_states = layer(embeddings, hidden_states, attention_mask, rotary_pos_emb, packed_seq_params)
            outputs.append(hidden_states)
        return outputs


# ---------------------------------------------------------------------------------------------------------
# The loss: per-depth masked sums, the term added for the backward, and the logged per-depth means
# ---------------------------------------------------------------------------------------------------------


def masked_depth_losses(depth_losses: torch.Tensor, loss_mask: torch.Tensor, cp_group=None, packed_seq_params=None):
    """(sums, counts), each `[N]` fp32: depth k's per-token losses (`depth_losses[k-1]`, `[b, s]`) summed under the
    loss mask shifted left by k, and that shifted mask's sum (the depth's token count). Under context parallelism
    (`cp_group`) the mask is shifted along the whole sequence and the sums and counts are this rank's; with
    `packed_seq_params` (a `[1, t]` packed row) it is shifted within each packed sequence."""
    mask = loss_mask.detach().float()
    if packed_seq_params is None:
        def shift(depth):
            return shift_left(mask, depth, cp_group=cp_group)
    else:
        segments = packed_rows("masked_depth_losses", packed_seq_params, mask.shape[-1], mask.shape[0],
                               mask.device).segments

        def shift(depth):
            return shift_left_within_sequences(mask, depth, segments)[0]
    masks = torch.stack([shift(depth) for depth in range(1, depth_losses.shape[0] + 1)])
    sums = (depth_losses.float() * masks).sum(dim=(1, 2))
    return sums, masks.sum(dim=(1, 2))


def mtp_loss_for_backward(sums, counts, scaling_factor: float, num_tokens, per_token_loss: bool, cp_group=None):
    """The MTP term to add to the main loss sum a loss function returns, so that after the schedule divides by
    `num_tokens` (the main loss's token count) the objective is LM loss + F / N * sum_k mean_k. With
    `per_token_loss` the schedule does not divide (gradients are divided by the global token count later):
    F / N * sum_k sums_k, as upstream.

    Under context parallelism (`cp_group`, with this rank's sums, counts and main token count) the main loss is
    divided by the group's token count (`context_parallel_loss`) and each depth's mean is over the whole
    sequence: this rank's term is F / N * sum_k sums_k / (group's count_k) * (group's main token count), and the
    ranks' terms add up to F / N * sum_k mean_k times that count."""
    num_depths = sums.numel()
    if per_token_loss:
        return scaling_factor / num_depths * sums.sum()
    num_tokens = torch.as_tensor(num_tokens, device=sums.device).detach().float()
    counts = counts.detach().float()
    if cp_group is not None and dist.get_world_size(cp_group) > 1:
        totals = torch.cat([counts, num_tokens.reshape(1)])
        dist.all_reduce(totals, group=cp_group)
        counts, num_tokens = totals[:-1], totals[-1]
    means = sums / counts.clamp(min=1)
    return scaling_factor / num_depths * means.sum() * num_tokens


_tracked = None  # [N, 2] float64: per depth, [masked loss sum, token count] since the last log reduction


def track_mtp_losses(sums, counts):
    """Add one microbatch's per-depth sums and counts to what the next log line reports (training passes only:
    the caller skips evaluation). A pass the rerun state machine repeats adds the same sums and counts again,
    which leaves the logged means unchanged."""
    global _tracked
    values = torch.stack([sums.detach(), counts.detach()], dim=1).to(torch.float64)
    _tracked = values if _tracked is None else _tracked + values


def clear_mtp_loss_tracker():
    global _tracked
    _tracked = None


def reduce_mtp_losses_for_logging(num_depths: int, device) -> Dict[str, float]:
    """{`mtp_{k} loss`: depth k's token-weighted mean loss} over every microbatch tracked since the last call and
    every data-parallel rank, None (not 0/0) for a depth without any token (its shifted loss mask all zero: the
    log line leaves it out of the interval's mean, as `lm loss`); clears the tracker. Collective over the world:
    only the last pipeline stage tracks anything (zeros elsewhere) and tensor-parallel ranks track the same sums
    and counts, which cancel in the ratio."""
    total = torch.zeros(num_depths, 2, dtype=torch.float64, device=device)
    if _tracked is not None:
        total += _tracked.to(device)
    clear_mtp_loss_tracker()
    if dist.is_initialized():
        dist.all_reduce(total)
    return {f"mtp_{depth} loss": (loss_sum / count if count > 0 else None)
            for depth, (loss_sum, count) in enumerate(total.tolist(), start=1)}


def mtp_depth_losses_or_none(output_tensor):
    """(main per-token loss, depth losses `[N, b, s]` or None) from what `GPTModel.forward` returned with labels."""
    if isinstance(output_tensor, (tuple, list)):
        if len(output_tensor) != 2:
            raise ValueError(f"expected (loss, mtp depth losses) from the model, got {len(output_tensor)} outputs")
        return output_tensor[0], output_tensor[1]
    return output_tensor, None

