"""Token dispatchers: move each token to the ranks holding its experts, and the experts' outputs back.

Both work over the expert tensor-and-model-parallel group (ETP x EP ranks of a pipeline stage, ETP the expert
tensor-parallel size; ETP x EP = 1 makes every step local): its ranks hold every expert once between them. Under
sequence parallelism each tensor-parallel rank routes its own tokens, and every rank of an expert's ETP group
must see all of that expert's tokens, since each holds a slice of its weights. The group need not line up with
the dense tensor-parallel group (e.g. TP 2 with ETP 1: the two TP ranks of a sequence are two EP ranks).

- `MoEAllGatherTokenDispatcher`: gather every rank's tokens, probabilities and routing map over ETP x EP; each
  rank picks the tokens of its local experts; the combine scatters the weighted outputs into a buffer of all
  gathered tokens and reduce-scatters it (summing the experts' ETP partial outputs and the EP ranks' experts).
- `MoEAlltoAllTokenDispatcher`: sort the local tokens by expert, send each expert-parallel rank's block to
  every ETP rank of that EP rank with one `all_to_all_single` over ETP x EP (what upstream's all-to-all over EP
  followed by an all-gather over ETP delivers), regroup by local expert; the combine sends the outputs back
  the same way and sums each token's ETP partial outputs on the source rank.

`dispatch(hidden_states, probs, routing_map)` returns (tokens sorted by local expert, tokens per local expert);
`combine(expert_output)` returns the `[s, b, h]` output: the sum over the token's experts of probability x
expert output, computed in the probabilities' dtype (the router dtype) and cast back.
"""

import torch

from megatron.core import parallel_state
from megatron.core.transformer.moe.collectives import (
    all_to_all,
    gather_along_first_dim,
    gather_without_grad,
    group_size,
    reduce_scatter_along_first_dim,
    start_all_to_all,
)


def permute(tokens, routing_map):
    """(tokens grouped by expert in token order, the source row of each, tokens per expert) for a routing map
    `[num_tokens, num_experts]`."""
    mask = routing_map.t()
    token_index = torch.arange(tokens.size(0), device=tokens.device).unsqueeze(0).expand_as(mask).masked_select(mask)
    return tokens.index_select(0, token_index), token_index, mask.sum(dim=1)


def unpermute(rows, token_index, probs, num_tokens):
    """Sum of probability x row into each row's source token: `[num_tokens, h]` in `probs`' dtype."""
    weighted = rows.to(probs.dtype) * probs.unsqueeze(-1)
    return weighted.new_zeros(num_tokens, rows.size(-1)).index_add(0, token_index, weighted)


def _concatenated_ranges(starts, sizes):
    """cat(arange(start, start + size) for each chunk), vectorised."""
    sizes = torch.as_tensor(sizes, dtype=torch.int64).cpu()
    starts = torch.as_tensor(starts, dtype=torch.int64).cpu()
    total = int(sizes.sum())
    chunk_of_row = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
    first_row_of_chunk = torch.cumsum(sizes, 0) - sizes
    return starts[chunk_of_row] + torch.arange(total) - first_row_of_chunk[chunk_of_row]


class _Dispatcher:
    """Args, in upstream's order: num_local_experts; local_expert_indices: the global indices of this rank's
    experts (consecutive); config; pg_collection: must be None (the groups come from `parallel_state`)."""

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        if pg_collection is not None:
            raise ValueError(f"{type(self).__name__}(pg_collection=...) is not supported: the process groups come "
                             "from parallel_state.initialize_model_parallel; drop pg_collection")
        self.config = config
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        initialized = parallel_state.model_parallel_is_initialized()
        self.group = parallel_state.get_expert_tensor_and_model_parallel_group() if initialized else None
        self.ep_size = parallel_state.get_expert_model_parallel_world_size() if initialized else 1
        self.ep_rank = parallel_state.get_expert_model_parallel_rank() if initialized else 0
        if group_size(self.group) == 1:
            self.group = None

    def _routing_state(self):
        """The attributes `dispatch` sets for its `combine`; dropped once combined, so the last forward's routing
        (its probabilities tied to the autograd graph, its index tensors) is not kept alive until the next one."""
        return {name: getattr(self, name) for name in self.ROUTING_STATE}

    def _forget_routing(self):
        for name in self.ROUTING_STATE:
            self.__dict__.pop(name, None)


class MoEAllGatherTokenDispatcher(_Dispatcher):
    ROUTING_STATE = ("hidden_shape", "hidden_dtype", "num_gathered_tokens", "token_index", "permuted_probs")

    def dispatch(self, hidden_states, probs, routing_map):
        self.hidden_shape, self.hidden_dtype = hidden_states.shape, hidden_states.dtype
        tokens = hidden_states.reshape(-1, hidden_states.size(-1))
        tokens = gather_along_first_dim(tokens, self.group)
        probs = gather_along_first_dim(probs, self.group)
        routing_map = gather_without_grad(routing_map, self.group)
        first = self.local_expert_indices[0]
        local_map = routing_map[:, first:first + self.num_local_experts]
        local_probs = probs[:, first:first + self.num_local_experts]
        self.num_gathered_tokens = tokens.size(0)
        permuted, self.token_index, tokens_per_expert = permute(tokens, local_map)
        self.permuted_probs = local_probs.t().masked_select(local_map.t())
        return permuted, tokens_per_expert

    def combine(self, expert_output):
        state = self._routing_state()
        self._forget_routing()
        output = unpermute(expert_output, state["token_index"], state["permuted_probs"], state["num_gathered_tokens"])
        output = reduce_scatter_along_first_dim(output, self.group)
        return output.to(state["hidden_dtype"]).view(state["hidden_shape"])


class MoEAlltoAllTokenDispatcher(_Dispatcher):
    _member_ep_ranks = None
    ROUTING_STATE = ("hidden_shape", "hidden_dtype", "num_tokens", "token_index", "permuted_probs", "input_splits",
                     "output_splits", "send_index", "sort_index", "overlapped_result")

    def _ep_rank_of_members(self, device):
        """The expert-parallel rank of each member of the ETP x EP group, in group-rank order (gathered once)."""
        if self._member_ep_ranks is None:
            mine = torch.tensor([self.ep_rank], dtype=torch.int64, device=device)
            self._member_ep_ranks = gather_without_grad(mine, self.group).tolist()
        return self._member_ep_ranks

    def dispatch(self, hidden_states, probs, routing_map, while_tokens_travel=None):
        """`while_tokens_travel`: a callable run while the tokens are exchanged (the all-to-all is launched
        asynchronously first: the shared experts' overlap); its result is kept as `self.overlapped_result`."""
        self.hidden_shape, self.hidden_dtype = hidden_states.shape, hidden_states.dtype
        tokens = hidden_states.reshape(-1, hidden_states.size(-1))
        self.num_tokens = tokens.size(0)
        permuted, self.token_index, counts = permute(tokens, routing_map)
        self.permuted_probs = probs.t().masked_select(routing_map.t())
        local = self.num_local_experts
        member_ep = self._ep_rank_of_members(tokens.device)
        counts_per_ep = counts.view(self.ep_size, local).sum(dim=1)
        ep_starts = torch.cumsum(counts_per_ep, 0) - counts_per_ep
        self.input_splits = [int(counts_per_ep[ep]) for ep in member_ep]
        self.send_index = _concatenated_ranges([int(ep_starts[ep]) for ep in member_ep], self.input_splits)
        # Counts of every member's tokens per expert: what this rank receives for its experts from each member.
        all_counts = gather_without_grad(counts.unsqueeze(0), self.group)
        first = self.local_expert_indices[0]
        received_counts = all_counts[:, first:first + local]  # [members, local experts], arrival order row-major
        self.output_splits = received_counts.sum(dim=1).tolist()
        send = permuted.index_select(0, self.send_index.to(permuted.device))
        finish_exchange = start_all_to_all(send, self.group, self.output_splits, self.input_splits)
        self.overlapped_result = while_tokens_travel() if while_tokens_travel is not None else None
        received = finish_exchange()
        chunk_sizes = received_counts.reshape(-1)
        chunk_starts = torch.cumsum(chunk_sizes, 0) - chunk_sizes
        # Arrival order is (member, expert); the experts want (expert, member).
        by_expert = torch.arange(chunk_sizes.numel(), device=chunk_sizes.device).view(-1, local).t().reshape(-1)
        self.sort_index = _concatenated_ranges(chunk_starts[by_expert], chunk_sizes[by_expert]).to(received.device)
        return received.index_select(0, self.sort_index), received_counts.sum(dim=0)

    def combine(self, expert_output):
        state = self._routing_state()
        self._forget_routing()
        unsorted = expert_output.new_zeros(expert_output.shape).index_add(0, state["sort_index"], expert_output)
        returned = all_to_all(unsorted, self.group, state["input_splits"], state["output_splits"])
        per_assignment = returned.new_zeros(state["token_index"].numel(), returned.size(-1))
        per_assignment = per_assignment.index_add(0, state["send_index"].to(returned.device), returned)
        output = unpermute(per_assignment, state["token_index"], state["permuted_probs"], state["num_tokens"])
        return output.to(state["hidden_dtype"]).view(state["hidden_shape"])


def build_token_dispatcher(config, num_local_experts, local_expert_indices):
    cls = MoEAlltoAllTokenDispatcher if config.moe_token_dispatcher_type == "alltoall" else MoEAllGatherTokenDispatcher
    return cls(num_local_experts, local_expert_indices, config)
