"""GPTModel on packed (THD) sequences, upstream's `packed_seq_params` (with RoPE, learned positions, a sliding
window, MoE, multi-latent attention and multi-token prediction): each sequence of a packed row gets the per-token
loss it has alone and the row's gradient is the sum of its sequences' gradients; the same holds for a transformer
block called directly as upstream calls it, under tensor + sequence parallelism, a two-stage pipeline and context
parallelism (upstream's THD split, every comm type), and training on packed rows under every data-parallel wrapper
matches one process on one row holding every rank's sequences."""

import os

import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from tests.unit_tests.models.gpt.gpt_test_utils import VOCAB_SIZE, seeded_model, tiny_config
from tests.unit_tests.multiprocess_harness import run_on_ranks
from tests.unit_tests.test_utilities import Utils

LENGTHS = (5, 7, 4)
PADDED_TO = 4  # with padding: each sequence starts at a multiple of 4 rows


def _sequences(lengths=LENGTHS, seed=0):
    """One token stream per sequence, `length + 1` ids (inputs and next-token labels)."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE, (length + 1,), generator=generator) for length in lengths]


def _packed_batch(sequences, padded=False, trailing=0, padded_to=PADDED_TO):
    """(tokens `[1, t]`, labels `[1, t]`, loss mask `[1, t]`, PackedSeqParams, real rows) of `sequences` back to
    back; with `padded` each starts at a multiple of `padded_to`, and `trailing` rows of padding end the row."""
    lengths = [len(stream) - 1 for stream in sequences]
    starts, row = [], 0
    for length in lengths:
        starts.append(row)
        row += -(-length // padded_to) * padded_to if padded else length
    total = row + trailing
    tokens, labels, mask = (torch.zeros(1, total, dtype=torch.int64), torch.zeros(1, total, dtype=torch.int64),
                            torch.zeros(1, total))
    real_rows = []
    for start, stream in zip(starts, sequences):
        tokens[0, start:start + len(stream) - 1] = stream[:-1]
        labels[0, start:start + len(stream) - 1] = stream[1:]
        mask[0, start:start + len(stream) - 1] = 1.0
        real_rows.extend(range(start, start + len(stream) - 1))
    offsets = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    padded_offsets = torch.tensor(starts + [row], dtype=torch.int32) if padded else None
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=offsets, cu_seqlens_kv=offsets,
                             cu_seqlens_q_padded=padded_offsets, cu_seqlens_kv_padded=padded_offsets,
                             max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    return tokens, labels, mask, params, real_rows


def _separate(model, sequences):
    """Per-token losses of each sequence run alone (concatenated) and the gradients of their summed loss."""
    model.zero_grad(set_to_none=True)
    losses = []
    for stream in sequences:
        positions = torch.arange(len(stream) - 1)[None]
        loss = model(stream[None, :-1], positions, labels=stream[None, 1:])
        loss.sum().backward()
        losses.append(loss.detach()[0])
    return torch.cat(losses), {name: p.grad.clone() for name, p in model.named_parameters()}


def _packed(model, batch, position_ids=None):
    tokens, labels, mask, params, real_rows = batch
    model.zero_grad(set_to_none=True)
    loss = model(tokens, position_ids, labels=labels, packed_seq_params=params)
    (loss * mask).sum().backward()
    return loss.detach()[0, real_rows], {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_matches(losses, grads, expected_losses, expected_grads):
    # fp32: a row's attention sums the same terms as the sequence alone plus exact zeros for the masked keys. A
    # gradient sums over all the row's tokens at once instead of sequence by sequence: another order of the same
    # fp32 additions (biases: up to ~2e-6 on sums of order 1 over 16 tokens).
    torch.testing.assert_close(losses, expected_losses, rtol=0, atol=2e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-5, atol=4e-6, msg=name)


VARIANTS = {
    "rope, grouped query attention": dict(model=dict(position_embedding_type="rope"),
                                          config=dict(num_query_groups=2)),
    "learned absolute positions": dict(model=dict(position_embedding_type="learned_absolute"), config={}),
    "rope, sliding window of 3": dict(model=dict(position_embedding_type="rope"), config=dict(window_size=(2, 0))),
    "rope, attention recomputed in backward": dict(
        model=dict(position_embedding_type="rope"),
        config=dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
    # No auxiliary loss: the load-balancing loss couples the tokens of the whole batch, packed or not.
    "MoE, 4 experts, top 2": dict(model=dict(position_embedding_type="rope"),
                                  config=dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.0)),
    "multi-latent attention, YaRN": dict(
        model=dict(position_embedding_type="none"),
        config=dict(multi_latent_attention=True, kv_lora_rank=12, qk_head_dim=6, qk_pos_emb_head_dim=16, v_head_dim=10,
                    q_lora_rank=10, rotary_scaling_factor=4.0, mscale=1.0, mscale_all_dim=0.8,
                    original_max_position_embeddings=256)),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("padded", [False, True], ids=["back to back", "padded offsets"])
def test_each_packed_sequence_trains_as_if_alone(variant, padded):
    Utils.initialize_model_parallel()
    try:
        model = seeded_model(tiny_config(**VARIANTS[variant]["config"]), **VARIANTS[variant]["model"])
        sequences = _sequences()
        expected = _separate(model, sequences)
        _assert_matches(*_packed(model, _packed_batch(sequences, padded=padded, trailing=2)), *expected)
        # Upstream passes the positions within each sequence; None computes the same ones.
        if VARIANTS[variant]["model"]["position_embedding_type"] == "learned_absolute" and not padded:
            positions = torch.cat([torch.arange(length) for length in LENGTHS])[None]
            _assert_matches(*_packed(model, _packed_batch(sequences), positions), *expected)
        # Without the packed parameters the row is one long sequence: the losses differ.
        tokens, labels, *_ = _packed_batch(sequences)
        with torch.no_grad():
            unpacked = model(tokens, torch.arange(tokens.shape[1])[None], labels=labels)[0]
        assert (unpacked - expected[0]).abs().max() > 1e-3  # 500 x the tolerance above
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("padded", [False, True], ids=["back to back", "padded offsets"])
def test_multi_token_prediction_depths_see_each_sequence_alone(padded):
    """With --mtp-num-layers 2 each depth's per-token losses on a packed row equal those of each sequence alone
    (labels and inputs shifted within the sequence, zero past its end), and so do the gradients."""
    Utils.initialize_model_parallel()
    try:
        model = seeded_model(tiny_config(mtp_num_layers=2), position_embedding_type="rope")
        sequences = _sequences()
        model.zero_grad(set_to_none=True)
        expected_main, expected_depths = [], []
        for stream in sequences:
            main, depths = model(stream[None, :-1], None, labels=stream[None, 1:])
            (main.sum() + depths.sum()).backward()
            expected_main.append(main.detach()[0])
            expected_depths.append(depths.detach()[:, 0])
        expected_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        tokens, labels, mask, params, real_rows = _packed_batch(sequences, padded=padded, trailing=2)
        model.zero_grad(set_to_none=True)
        main, depths = model(tokens, None, labels=labels, packed_seq_params=params, loss_mask=mask)
        ((main * mask).sum() + depths.sum()).backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        _assert_matches(main.detach()[0, real_rows], grads, torch.cat(expected_main), expected_grads)
        torch.testing.assert_close(depths.detach()[:, 0, real_rows], torch.cat(expected_depths, dim=1), rtol=0,
                                   atol=2e-6)
        padding_rows = [row for row in range(tokens.shape[1]) if row not in real_rows]
        assert depths[:, 0, padding_rows].abs().max() == 0
    finally:
        parallel_state.destroy_model_parallel()


def test_the_block_takes_upstreams_thd_call():
    """`TransformerBlock.forward(hidden [t, 1, h], rotary_pos_emb=<angles of max_seqlen positions>,
    packed_seq_params=...)` as upstream's model calls it: each sequence's output equals the block's on it alone."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    Utils.initialize_model_parallel()
    try:
        block = seeded_model(tiny_config(), position_embedding_type="rope").decoder
        hidden = torch.randn(sum(LENGTHS), 1, 32, generator=torch.Generator().manual_seed(4))
        *_, params, _ = _packed_batch(_sequences())
        rope = RotaryEmbedding(8)
        angles = rope(rope.get_rotary_seq_len(None, block, hidden, block.config, params))
        with torch.no_grad():
            packed = block(hidden, None, rotary_pos_emb=angles, packed_seq_params=params)
            start = 0
            for length in LENGTHS:
                alone = block(hidden[start:start + length], None, rotary_pos_emb=rope(length))
                torch.testing.assert_close(packed[start:start + length], alone, rtol=0, atol=2e-6)
                start += length
            with pytest.raises(ValueError, match=r"SelfAttention\(packed_seq_params=...\): rotary_pos_emb holds "
                                                 r"the angles of 4 positions but a packed sequence has 7 tokens"):
                block(hidden, None, rotary_pos_emb=angles[:4], packed_seq_params=params)
    finally:
        parallel_state.destroy_model_parallel()


def _gpt_pipeline_loss(model, batch, num_layers_first_stage=None):
    """The packed row's masked loss sum through a pipeline schedule (one microbatch)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens, labels, mask, params, _ = batch

    def forward_step(data_iterator, chunk):
        next(data_iterator)
        output = chunk(tokens, None, labels=labels, packed_seq_params=params)
        return output, lambda per_token: ((per_token * mask).sum(), {"lm loss": (per_token * mask).sum().detach()})

    reported = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([None]), model=[model],
                                           num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=1)
    return reported[0]["lm loss"].item() if reported else None


def _tensor_and_pipeline_parallel_packed_rows():
    """Errors of the packed row's loss and gradients at TP2 + SP and at PP2 against one rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = _packed_batch(_sequences(), padded=True, trailing=2)  # 22 rows: split evenly by sequence parallelism
    tokens, labels, mask, params, _ = batch
    parallel_state.initialize_model_parallel()
    untied = dict(position_embedding_type="rope", share_embeddings_and_output_weights=False)
    reference = seeded_model(tiny_config(num_layers=4), **untied)
    loss = reference(tokens, None, labels=labels, packed_seq_params=params)
    (loss * mask).sum().backward()
    reference_loss = (loss * mask).sum().item()
    reference_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    parallel_state.destroy_model_parallel()
    errors = {}

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model = seeded_model(tiny_config(tp=world, sequence_parallel=True, num_layers=4), **untied)
    loss = model(tokens, None, labels=labels, packed_seq_params=params)
    (loss * mask).sum().backward()
    errors["tp loss"] = abs((loss * mask).sum().item() - reference_loss)
    # A replicated weight's gradient is whole on every rank (the norms'), a split one is compared by its slice.
    for name, p in model.named_parameters():
        expected = reference_grads[name]
        if p.shape != expected.shape:
            dim = [a != b for a, b in zip(p.shape, expected.shape)].index(True)
            expected = expected.chunk(world, dim)[rank]
        grad = p.grad
        if getattr(p, "sequence_parallel", False):
            grad = grad.clone()
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        errors[f"tp grad {name}"] = (grad - expected).abs().max().item()
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=world)
    stage = seeded_model(tiny_config(pp=world, num_layers=4), pre_process=rank == 0, post_process=rank == world - 1,
                         **untied)
    stage_loss = _gpt_pipeline_loss(stage, batch)
    if rank == world - 1:
        errors["pp loss"] = abs(stage_loss - reference_loss)
    layers_per_stage = 4 // world
    for name, p in stage.named_parameters():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(local) + rank * layers_per_stage}.{rest}"
        errors[f"pp grad {name}"] = (p.grad - reference_grads[name]).abs().max().item()
    parallel_state.destroy_model_parallel()
    return errors


@pytest.mark.parametrize("world_size", [2])
def test_tensor_sequence_and_pipeline_parallel_packed_rows_match_one_rank(world_size):
    for errors in run_on_ranks(world_size, _tensor_and_pipeline_parallel_packed_rows):
        assert {name.split()[0] for name in errors} == {"tp", "pp"}, sorted(errors)
        assert max(errors.values()) < 2e-5, errors


MLA_CONFIG = VARIANTS["multi-latent attention, YaRN"]["config"]
CONTEXT_PARALLEL_CASES = {  # name: (--cp-comm-type, config fields, model keywords)
    "p2p": ("p2p", dict(num_query_groups=2), dict(position_embedding_type="rope")),
    "allgather": ("allgather", dict(num_query_groups=2), dict(position_embedding_type="rope")),
    "a2a": ("a2a", {}, dict(position_embedding_type="rope")),
    "p2p, learned positions": ("p2p", {}, dict(position_embedding_type="learned_absolute")),
    "p2p, multi-latent attention": ("p2p", MLA_CONFIG, dict(position_embedding_type="none")),
    "allgather, sliding window of 3": ("allgather", dict(window_size=(2, 0)), dict(position_embedding_type="rope")),
    "a2a+p2p at CP 4": ("a2a+p2p", dict(hierarchical_context_parallel_sizes=[2, 2]),
                        dict(position_embedding_type="rope")),
}


def _context_parallel_packed_rows(case):
    """Errors of CP 2 on a packed row (upstream's THD split: two chunks of every sequence per rank) against CP 1:
    each rank's per-token losses and the gradients summed over the context-parallel ranks."""
    from megatron.core.packed_sequences import cut_packed_batch_for_cp_rank, thd_local_indices

    comm_type, config_fields, model_kwargs = CONTEXT_PARALLEL_CASES[case]
    rank, world = dist.get_rank(), dist.get_world_size()
    # Each span a multiple of 2 x CP rows: 8, 8, 4 at CP 2; 8, 8, 8 at CP 4.
    tokens, labels, mask, params, _ = _packed_batch(_sequences(), padded=True, padded_to=2 * world)
    parallel_state.initialize_model_parallel()
    hierarchical_sizes = config_fields.get("hierarchical_context_parallel_sizes")
    model_fields = {name: value for name, value in config_fields.items()
                    if name != "hierarchical_context_parallel_sizes"}
    reference = seeded_model(tiny_config(**model_fields), **model_kwargs)
    reference_loss = reference(tokens, None, labels=labels, packed_seq_params=params)
    (reference_loss * mask).sum().backward()
    reference_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
    parallel_state.destroy_model_parallel()

    parallel_state.initialize_model_parallel(context_parallel_size=world,
                                             hierarchical_context_parallel_sizes=hierarchical_sizes)
    model = seeded_model(tiny_config(context_parallel_size=world, cp_comm_type=comm_type, **config_fields),
                         **model_kwargs)
    local = cut_packed_batch_for_cp_rank({"tokens": tokens, "labels": labels, "loss_mask": mask}, params)
    loss = model(local["tokens"], None, labels=local["labels"], packed_seq_params=params)
    (loss * local["loss_mask"]).sum().backward()
    rows = thd_local_indices(params, tokens.shape[1], world, rank)
    errors = {"loss": (loss.detach() - reference_loss.detach()[:, rows]).abs().max().item()}
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        errors[f"grad {name}"] = (grad - reference_grads[name]).abs().max().item()
    parallel_state.destroy_model_parallel()
    return errors


@pytest.mark.parametrize("case", CONTEXT_PARALLEL_CASES)
def test_context_parallel_packed_rows_match_one_rank(case):
    for errors in run_on_ranks(4 if "CP 4" in case else 2, _context_parallel_packed_rows, case):
        assert len(errors) > 10 and max(errors.values()) < 1e-5, errors


STEPS = 3
WRAPPER_FLAGS = {
    "ddp": "",
    "distributed optimizer": "--use-distributed-optimizer",
    "megatron-fsdp z3": "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params",
    "fsdp2": "--use-torch-fsdp2",
}


def _rank_rows(step):
    """Each rank's packed row at `step`: rank 0 packs three sequences back to back, rank 1 three padded ones."""
    lengths = ((5, 7, 4), (6, 3, 4))
    return [_packed_batch(_sequences(lengths[rank], seed=10 * step + rank), padded=rank == 1) for rank in (0, 1)]


def _one_row(rows):
    """Both ranks' sequences in one packed row (back to back)."""
    sequences = []
    for tokens, labels, mask, params, real_rows in rows:
        offsets = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        for start, length in zip(offsets[:-1].tolist(), (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()):
            sequences.append(torch.cat([tokens[0, start:start + length], labels[0, start + length - 1:start + length]]))
    return _packed_batch(sequences)


def _build_untied_rope_gpt():
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt.gpt_model import GPTModel

    tensor_parallel.model_parallel_cuda_manual_seed(99)
    config = tiny_config(init_seed=99, normalization="RMSNorm")
    return GPTModel(config, vocab_size=VOCAB_SIZE, max_sequence_length=32, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope")


def _train_packed_under(wrapper):
    """(losses per step, final weights) of SGD on packed rows through `wrapper` at DP2, and of one process on one
    row holding both ranks' sequences; the loss is the mean over every real token of the global batch."""
    from megatron.core.distributed import wrap_data_parallel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.model_config import ddp_config_from_args

    rank, world = dist.get_rank(), dist.get_world_size()
    learning_rate = 0.5
    parallel_state.initialize_model_parallel()
    reference = _build_untied_rope_gpt()
    reference_losses = []
    for step in range(STEPS):
        tokens, labels, mask, params, _ = _one_row(_rank_rows(step))
        reference.zero_grad(set_to_none=True)
        loss = (reference(tokens, None, labels=labels, packed_seq_params=params) * mask).sum() / mask.sum()
        loss.backward()
        with torch.no_grad():
            for p in reference.parameters():
                p -= learning_rate * p.grad
        reference_losses.append(loss.item())
    expected_weights = {name: p.detach().clone() for name, p in reference.named_parameters()}
    parallel_state.destroy_model_parallel()

    flags = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
             "--train-iters 10 --lr 1e-3 --mock-data --vocab-size 64 --untie-embeddings-and-output-weights "
             + WRAPPER_FLAGS[wrapper])
    os.environ.update({"WORLD_SIZE": str(world), "RANK": str(rank)})
    args = validate_args(parse_args(args=flags.split()))
    args.data_parallel_size = world
    parallel_state.initialize_model_parallel()
    model = _build_untied_rope_gpt()
    chunk = wrap_data_parallel(model.config, ddp_config_from_args(args), model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=learning_rate, sgd_momentum=0.0, weight_decay=0.0, clip_grad=0.0,
                        use_distributed_optimizer=args.use_distributed_optimizer), [chunk])
    losses = []
    for step in range(STEPS):
        rows = _rank_rows(step)
        tokens, labels, mask, params, _ = rows[rank]
        global_tokens = sum(row[2].sum() for row in rows)
        optimizer.zero_grad()
        chunk.zero_grad_buffer()
        # The wrappers average gradients over ranks: scale by the world size to get the global mean's gradient.
        loss = (chunk(tokens, None, labels=labels, packed_seq_params=params) * mask).sum() * world / global_tokens
        loss.backward()
        chunk.finish_grad_sync()
        success, _, _ = optimizer.step()
        assert success
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    with chunk.gathered_parameters() if hasattr(chunk, "gathered_parameters") else torch.no_grad():
        weights = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                   for name, p in chunk.state_dict().items() if name in expected_weights}
    parallel_state.destroy_model_parallel()
    return losses, reference_losses, weights, expected_weights


@pytest.mark.parametrize("wrapper", WRAPPER_FLAGS)
def test_packed_rows_train_alike_under_every_data_parallel_wrapper(wrapper):
    losses, reference_losses, weights, expected = run_on_ranks(2, _train_packed_under, wrapper)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference_losses), rtol=1e-5, atol=0)
    assert abs(reference_losses[-1] - reference_losses[0]) > 1e-2  # the steps moved the weights
    assert sorted(weights) == sorted(expected)
    for name, value in weights.items():
        torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
def test_packed_sequences_on_cuda_train_as_if_alone():
    """The mask on a CUDA device goes to other attention kernels than the causal flag: the same equality, with
    fp32 kernel tolerances (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = seeded_model(tiny_config(num_query_groups=2), position_embedding_type="rope").to("cuda")
    sequences = [stream.to("cuda") for stream in _sequences()]
    expected_losses, expected_grads = _separate(model, sequences)
    tokens, labels, mask, params, real_rows = _packed_batch(sequences, padded=True, trailing=2)
    batch = (tokens.cuda(), labels.cuda(), mask.cuda(), params, real_rows)
    losses, grads = _packed(model, batch)
    torch.testing.assert_close(losses, expected_losses, rtol=1e-5, atol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-5, msg=name)
