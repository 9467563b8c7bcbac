"""A small plain-torch Mixture-of-Experts model whose expert parameters follow the MoE layer's contract
(`allreduce=False`, `expert_global_index`, `num_local_experts`, module path `mlp.experts.local_experts.{j}`),
for testing the data-parallel wrappers, optimizers and checkpoints without the GPT model.

Expert parallelism works like the all-gather token dispatcher: the tokens of the expert-parallel group are
gathered on every rank, each rank runs its local experts on the tokens routed to them (top-1 of a softmax over
a dense router's logits, weighted by that probability), and the partial outputs are summed
and scattered back. Every expert's initial weights depend only on its global index, so models built at any
expert-parallel size hold the same experts.
"""

import torch
import torch.distributed as dist

HIDDEN, FFN, IN_FEATURES, OUT_FEATURES = 8, 12, 6, 3


def _group_size_and_rank(group):
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 over `group`; the backward sums the gradients over the group and keeps this
    rank's rows."""

    @staticmethod
    def forward(ctx, tokens, group):
        ctx.group = group
        size, _ = _group_size_and_rank(group)
        gathered = tokens.new_empty((size * tokens.shape[0],) + tuple(tokens.shape[1:]))
        dist.all_gather_into_tensor(gathered, tokens.contiguous(), group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad):
        size, rank = _group_size_and_rank(ctx.group)
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(size)[rank].contiguous(), None


class _ScatterSum(torch.autograd.Function):
    """Sum over `group` along dim 0, keeping this rank's rows; the backward all-gathers the gradients."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.group = group
        size, rank = _group_size_and_rank(group)
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        size, _ = _group_size_and_rank(ctx.group)
        gathered = grad.new_empty((size * grad.shape[0],) + tuple(grad.shape[1:]))
        dist.all_gather_into_tensor(gathered, grad.contiguous(), group=ctx.group)
        return gathered, None


class ToyExpert(torch.nn.Module):
    def __init__(self, global_index, num_local_experts, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed * 1000 + global_index)
        self.linear_fc1 = torch.nn.Linear(HIDDEN, FFN)
        self.linear_fc2 = torch.nn.Linear(FFN, HIDDEN)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
                param.allreduce = False
                param.expert_global_index = global_index
                param.num_local_experts = num_local_experts

    def forward(self, tokens):
        return self.linear_fc2(torch.tanh(self.linear_fc1(tokens)))


class ToyExperts(torch.nn.Module):
    def __init__(self, num_experts, ep_rank, ep_size, seed):
        super().__init__()
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not divide over {ep_size} expert-parallel ranks")
        self.num_local_experts = num_experts // ep_size
        first = ep_rank * self.num_local_experts
        self.local_experts = torch.nn.ModuleList(
            ToyExpert(first + j, self.num_local_experts, seed) for j in range(self.num_local_experts))
        self.first_expert = first

    def forward(self, tokens, probs):
        """The weighted outputs of the local experts for the tokens whose top-1 choice they are (zero rows for the
        others). Starts from the tokens (times zero) so that the combine's backward runs on every rank, also on
        one whose local experts got no token: the collectives of the backward must match over the group."""
        choice = probs.argmax(dim=-1)
        output = tokens * 0.0
        for j, expert in enumerate(self.local_experts):
            # Every expert runs, also on no token (as the MoE layer's experts do): its gradient is then zero,
            # not missing, and FSDP2 reduces the same tensors on every rank.
            rows = (choice == self.first_expert + j).nonzero(as_tuple=True)[0]
            weighted = expert(tokens[rows]) * probs[rows, self.first_expert + j].unsqueeze(-1)
            output = output.index_add(0, rows, weighted)
        return output


class ToyMoELayer(torch.nn.Module):
    def __init__(self, num_experts, ep_group, seed):
        super().__init__()
        ep_size, ep_rank = _group_size_and_rank(ep_group)
        self.num_experts = num_experts
        self.ep_group = ep_group if ep_size > 1 else None
        generator = torch.Generator().manual_seed(seed + 77)
        self.router = torch.nn.Linear(HIDDEN, num_experts, bias=False)  # dense: replicated on every rank
        with torch.no_grad():
            self.router.weight.copy_(torch.randn(self.router.weight.shape, generator=generator))
        self.experts = ToyExperts(num_experts, ep_rank, ep_size, seed)

    def forward(self, hidden):
        tokens = hidden if self.ep_group is None else _GatherTokens.apply(hidden, self.ep_group)
        output = self.experts(tokens, torch.softmax(self.router(tokens), dim=-1))
        return output if self.ep_group is None else _ScatterSum.apply(output, self.ep_group)


class ToyMoEModel(torch.nn.Module):
    """Linear -> LayerNorm -> tanh -> MoE (+ residual) -> Linear; dense parameters seeded by `seed`."""

    def __init__(self, num_experts=4, ep_group=None, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.linear_in = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.linear_out = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(0.5 * torch.randn(param.shape, generator=generator) + (1.0 if param.dim() == 1 and
                                                                                  param is self.norm.weight else 0.0))
        self.mlp = ToyMoELayer(num_experts, ep_group, seed)

    def forward(self, inputs):
        hidden = torch.tanh(self.norm(self.linear_in(inputs)))
        hidden = hidden + self.mlp(hidden)
        return self.linear_out(hidden)


def toy_batch(step, num_samples):
    generator = torch.Generator().manual_seed(500 + step)
    return torch.randn(num_samples, IN_FEATURES, generator=generator), torch.randn(num_samples, OUT_FEATURES,
                                                                                   generator=generator)


def mse_loss(model, inputs, targets):
    return torch.nn.functional.mse_loss(model(inputs), targets)


def named_parameters_by_global_name(module):
    """{name with global expert indices: parameter} of a toy model (local-expert names renamed)."""
    from megatron.core.expert_parameters import global_expert_name

    return {global_expert_name(name, param): param for name, param in module.named_parameters()}
