"""Context-parallel benchmark: activation bytes, K/V traffic and attention work per rank, against theory.

    python examples/context_parallel/benchmark_cp.py [--seq-length 1024] [--cp-sizes 2 4] [--markdown out.md]

For each CP size N (ranks spawned on gloo) and each comm type, one GPT forward/backward at sequence length S:
- activation bytes per rank: the tensors autograd saves for backward (saved-tensor hooks; parameters excluded,
  each storage counted once), against CP1's, with 1/N the ideal;
- K/V bytes per layer: bytes each rank receives from its peers in the forward of one attention layer, counted at
  the collectives, against theory (p2p: N-1 hops of the local K/V; allgather: the N-1 other ranks' K/V; a2a: the
  (N-1)/N of Q, K, V and the output that change hands; a2a+p2p with sizes (A, B): the (A-1)/A of Q, K, V and the
  output inside, then B-1 ring hops of K/V that are as large as the local K/V);
- attention work balance under causal masking: unmasked score entries per rank with the load-balanced split
  (and, for contrast, with a contiguous split), max over mean.
Prints a markdown table (and writes it with --markdown).
"""

import argparse
import os
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megatron.core.transformer.context_parallel import collectives  # noqa: E402
from megatron.core.transformer.context_parallel.sequence_split import local_token_indices  # noqa: E402

HIDDEN, HEADS, GROUPS, LAYERS, VOCAB, BATCH = 128, 8, 4, 2, 256, 1
COMM_TYPES = ("p2p", "allgather", "a2a", "a2a+p2p")


def hierarchical_sizes(comm_type, cp_size):
    """(all-to-all size, ring size) of a2a+p2p: pairs inside, a ring across them; None for the other types."""
    return (2, cp_size // 2) if comm_type == "a2a+p2p" else None


def comm_types_for(cp_size):
    return [name for name in COMM_TYPES if name != "a2a+p2p" or cp_size >= 4]


def _model(cp_size, comm_type, seq_len):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    sizes = hierarchical_sizes(comm_type, cp_size)
    parallel_state.initialize_model_parallel(context_parallel_size=cp_size, hierarchical_context_parallel_sizes=sizes)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               num_query_groups=GROUPS, hidden_dropout=0.0, attention_dropout=0.0,
                               context_parallel_size=cp_size, cp_comm_type=comm_type,
                               hierarchical_context_parallel_sizes=sizes)
    return GPTModel(config, vocab_size=VOCAB, max_sequence_length=seq_len, position_embedding_type="rope",
                    share_embeddings_and_output_weights=False)


class _ReceivedBytes:
    """Counts the bytes this rank receives from peers in the context-parallel collectives."""

    def __init__(self):
        self.total = 0
        self._originals = {}

    def __enter__(self):
        start, gather, a2a = collectives.RingExchange.start, collectives.dist.all_gather_single, \
            collectives.dist.all_to_all_single
        self._originals = {"start": start, "gather": gather, "a2a": a2a}
        counter = self

        def counted_start(exchange, tensor):
            counter.total += tensor.numel() * tensor.element_size()
            return start(exchange, tensor)

        def counted_gather(output, tensor, *args, group=None, **kwargs):
            size = dist.get_world_size(group)
            counter.total += (size - 1) * tensor.numel() * tensor.element_size()
            return gather(output, tensor, *args, group=group, **kwargs)

        def counted_a2a(output, tensor, *args, group=None, **kwargs):
            size = dist.get_world_size(group)
            counter.total += tensor.numel() * tensor.element_size() * (size - 1) // size
            return a2a(output, tensor, *args, group=group, **kwargs)

        collectives.RingExchange.start = counted_start
        collectives.dist.all_gather_single = counted_gather
        collectives.dist.all_to_all_single = counted_a2a
        return self

    def __exit__(self, *exc):
        collectives.RingExchange.start = self._originals["start"]
        collectives.dist.all_gather_single = self._originals["gather"]
        collectives.dist.all_to_all_single = self._originals["a2a"]


def _saved_activation_bytes(model, tokens, positions, labels):
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in param_storages and storage.data_ptr() != 0:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, positions, labels=labels)
    loss.sum().backward()
    return sum(storages.values())


def _measure_on_rank(rank, world_size, init_file, seq_len, results):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=300))
    from megatron.core import parallel_state

    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(0, VOCAB, (BATCH, seq_len + 1), generator=generator)
    local = local_token_indices(seq_len, world_size, rank)
    tokens, labels = stream[:, :-1][:, local], stream[:, 1:][:, local]
    positions = local.unsqueeze(0).expand(BATCH, -1)
    row = {}
    for comm_type in comm_types_for(world_size) if world_size > 1 else ("p2p",):
        model = _model(world_size, comm_type, seq_len)
        activation_bytes = _saved_activation_bytes(model, tokens, positions, labels)
        attention = model.decoder.layers[0].self_attention
        head_dim = HIDDEN // HEADS
        query = torch.randn(seq_len // world_size, BATCH, HEADS, head_dim)
        key = torch.randn(seq_len // world_size, BATCH, GROUPS, head_dim)
        with _ReceivedBytes() as received, torch.no_grad():
            attention.core_attention(query, key, key.clone(), None)
        row[comm_type] = (activation_bytes, received.total)
        parallel_state.destroy_model_parallel()
    results[rank] = row
    dist.barrier()
    dist.destroy_process_group()


def measure(cp_size, seq_len):
    handle, init_file = tempfile.mkstemp(prefix="cp_bench_")
    os.close(handle)
    os.unlink(init_file)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_measure_on_rank, args=(cp_size, init_file, seq_len, results), nprocs=cp_size, join=True)
        return dict(results)


def kv_theory_bytes(comm_type, cp_size, seq_len, element_size=4):
    """Bytes one rank receives from its peers in one attention layer's forward."""
    head_dim = HIDDEN // HEADS
    local_kv = 2 * (seq_len // cp_size) * BATCH * GROUPS * head_dim * element_size
    local_q = (seq_len // cp_size) * BATCH * HEADS * head_dim * element_size
    if comm_type in ("p2p", "allgather"):
        return (cp_size - 1) * local_kv
    if comm_type == "a2a":
        return (cp_size - 1) * (local_kv + 2 * local_q) // cp_size  # Q, K, V in, the output back
    inner, outer = hierarchical_sizes(comm_type, cp_size)
    return (inner - 1) * (local_kv + 2 * local_q) // inner + (outer - 1) * local_kv


def causal_work(cp_size, seq_len, balanced=True):
    """Unmasked (query, key) score entries per rank under causal masking."""
    work = []
    for rank in range(cp_size):
        if balanced:
            rows = local_token_indices(seq_len, cp_size, rank)
        else:
            per_rank = seq_len // cp_size
            rows = torch.arange(rank * per_rank, (rank + 1) * per_rank)
        work.append(int((rows + 1).sum()))
    return work


def report(seq_len, cp_sizes):
    baseline = measure(1, seq_len)[0]["p2p"][0]
    lines = [f"Sequence length {seq_len}, GPT {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads / {GROUPS} query "
             f"groups, micro-batch {BATCH}, fp32, gloo. CP1 saved activations: {baseline / 2**20:.2f} MiB per rank.",
             "",
             "| CP | comm type | activation bytes per rank / CP1 | ideal 1/N | K/V bytes received per layer (fwd) "
             "| theory | measured / theory | causal work max/mean (balanced) | (contiguous split) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for cp_size in cp_sizes:
        results = measure(cp_size, seq_len)
        balanced, contiguous = causal_work(cp_size, seq_len), causal_work(cp_size, seq_len, balanced=False)
        balance = max(balanced) / (sum(balanced) / cp_size)
        imbalance = max(contiguous) / (sum(contiguous) / cp_size)
        for comm_type in comm_types_for(cp_size):
            activation = max(results[rank][comm_type][0] for rank in range(cp_size))
            received = max(results[rank][comm_type][1] for rank in range(cp_size))
            theory = kv_theory_bytes(comm_type, cp_size, seq_len)
            lines.append(f"| {cp_size} | {comm_type} | {activation / baseline:.3f} | {1 / cp_size:.3f} | "
                         f"{received} | {theory} | {received / theory:.3f} | {balance:.3f} | {imbalance:.3f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    options = parser.parse_args()
    table = report(options.seq_length, options.cp_sizes)
    print(table)
    if options.markdown:
        with open(options.markdown, "w") as stream:
            stream.write(table + "\n")


if __name__ == "__main__":
    main()
