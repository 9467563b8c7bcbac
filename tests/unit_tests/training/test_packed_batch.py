"""Packed batches: a dataset's `cu_seqlens` (collated, -1-padded) become the micro-batch's `PackedSeqParams`, and
`pretrain_gpt.py` trains on packed rows exactly as on the same rows with the equivalent dense attention mask."""

import pytest
import torch

from megatron.training.packed_batch import packed_seq_params_from_batch
from tests.unit_tests.multiprocess_harness import run_on_ranks

SEQ = 16  # TINY_GPT's --seq-length


def test_collated_offsets_lose_their_padding():
    batch = {"cu_seqlens": torch.tensor([[0, 5, 12, 16, -1, -1]], dtype=torch.int32),
             "cu_seqlens_padded": torch.tensor([[0, 8, 12, 16, -1, -1]], dtype=torch.int32)}
    params = packed_seq_params_from_batch(batch, "cpu")
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 5, 12, 16]
    assert params.cu_seqlens_q_padded.tolist() == params.cu_seqlens_kv_padded.tolist() == [0, 8, 12, 16]
    assert params.max_seqlen_q == params.max_seqlen_kv == 7
    given = packed_seq_params_from_batch({"cu_seqlens": torch.tensor([0, 3]), "max_seqlen": torch.tensor([9])}, "cpu")
    assert given.max_seqlen_q == 9 and given.cu_seqlens_q_padded is None
    assert packed_seq_params_from_batch({"tokens": torch.zeros(2, SEQ)}, "cpu") is None


@pytest.mark.parametrize("batch, message", [
    ({"cu_seqlens": torch.tensor([[0, 4], [0, 4]])}, r"cu_seqlens has 2 rows: .* need --micro-batch-size 1"),
    ({"cu_seqlens": torch.tensor([0, -1, 4])}, r"-1 entries before its last offset"),
    ({"max_seqlen": torch.tensor([4])}, r"cu_seqlens_padded or max_seqlen but no cu_seqlens"),
    ({"cu_seqlens": torch.zeros(1, 1, 2)}, r"must be 1-D offsets"),
])
def test_malformed_offsets_are_refused(batch, message):
    with pytest.raises(ValueError, match=message):
        packed_seq_params_from_batch(batch, "cpu")


class PackedRowDataset(torch.utils.data.Dataset):
    """Rows of SEQ tokens holding 1-4 sequences each. `layout` says how the sequences are kept apart: "packed"
    (cu_seqlens, -1-padded to 5 entries), "dense" (the same block-diagonal causal attention mask, as
    --reset-attention-mask builds) or "causal" (not at all). Positions restart in every sequence in all three."""

    def __init__(self, num_samples, layout):
        self.num_samples, self.layout = num_samples, layout

    def __len__(self):
        return self.num_samples

    def __getitem__(self, index):
        if self.layout == "padded":
            return self._padded_sample(index)
        generator = torch.Generator().manual_seed(index)
        cuts = sorted(torch.randperm(SEQ - 1, generator=generator)[:int(index % 4)].add(1).tolist())
        offsets = [0] + cuts + [SEQ]
        stream = torch.randint(0, 100, (SEQ + 1,), generator=generator)
        positions = torch.cat([torch.arange(end - start) for start, end in zip(offsets[:-1], offsets[1:])])
        loss_mask = torch.ones(SEQ)
        loss_mask[torch.tensor(offsets[1:]) - 1] = 0.0  # each sequence's last token predicts the next sequence
        sample = {"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask, "position_ids": positions}
        if self.layout == "packed":
            sample["cu_seqlens"] = torch.tensor(offsets + [-1] * (5 - len(offsets)), dtype=torch.int32)
        elif self.layout == "dense":
            segments = torch.cat([torch.full((end - start,), i) for i, (start, end)
                                  in enumerate(zip(offsets[:-1], offsets[1:]))])
            future = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
            sample["attention_mask"] = ((segments[:, None] != segments[None, :]) | future)[None]
        return sample

    def _padded_sample(self, index):
        """Sequences at padded offsets (multiples of 4 rows, as context parallelism at CP 2 needs), each followed by
        0-3 rows of padding; the padding is out of the loss."""
        generator = torch.Generator().manual_seed(index)
        starts = [0] + sorted((4 * (1 + torch.randperm(SEQ // 4 - 1, generator=generator)[:index % 3])).tolist())
        spans = [end - start for start, end in zip(starts, starts[1:] + [SEQ])]
        lengths = [span - int(torch.randint(0, min(3, span - 1) + 1, (1,), generator=generator)) for span in spans]
        stream = torch.randint(0, 100, (SEQ + 1,), generator=generator)
        positions, loss_mask = torch.zeros(SEQ, dtype=torch.int64), torch.zeros(SEQ)
        for start, length in zip(starts, lengths):
            positions[start:start + length] = torch.arange(length)
            loss_mask[start:start + length - 1] = 1.0
        offsets = [0] + torch.tensor(lengths).cumsum(0).tolist()
        return {"tokens": stream[:-1], "labels": stream[1:], "loss_mask": loss_mask, "position_ids": positions,
                "cu_seqlens": torch.tensor(offsets + [-1] * (4 - len(offsets)), dtype=torch.int32),
                "cu_seqlens_padded": torch.tensor(starts + [SEQ] + [-1] * (4 - len(offsets)), dtype=torch.int32)}


def _losses_of_layout(workdir, layout, extra_args=""):
    import pretrain_gpt
    from tests.unit_tests.dist_checkpointing.pretrain_helpers import pretrain_records, tiny_gpt_argv

    def provider(num_samples):
        return PackedRowDataset(num_samples[0], layout), None, None

    original = pretrain_gpt.train_valid_test_datasets_provider
    pretrain_gpt.train_valid_test_datasets_provider = provider
    try:
        argv = tiny_gpt_argv("--micro-batch-size 1 --global-batch-size 4 --train-iters 3 --lr-decay-iters 3 "
                             "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params "
                             + extra_args)
        records = pretrain_records(f"{workdir}/{layout}{extra_args.replace(' ', '')}", argv)
    finally:
        pretrain_gpt.train_valid_test_datasets_provider = original
    return [record["lm loss"] for record in records]


@pytest.mark.parametrize("world_size", [2])
def test_pretrain_trains_packed_rows_as_their_dense_mask(world_size, tmp_path):
    losses = {layout: run_on_ranks(world_size, _losses_of_layout, str(tmp_path), layout)[0]
              for layout in ("packed", "dense", "causal")}
    assert len(losses["packed"]) == 3
    # The same mask and positions by two routes: the same computation in fp32.
    torch.testing.assert_close(torch.tensor(losses["packed"]), torch.tensor(losses["dense"]), rtol=1e-6, atol=0)
    # Attending across the sequences changes the losses.
    assert max(abs(a - b) for a, b in zip(losses["packed"], losses["causal"])) > 5e-4  # 1.6e-3 measured


@pytest.mark.parametrize("world_size", [2])
def test_context_parallel_pretrain_on_packed_rows_logs_the_data_parallel_losses(world_size, tmp_path):
    """The same packed rows (sequences at padded offsets) at DP 2 and at CP 2 (each rank two chunks of every
    sequence, upstream's THD split): the same losses, up to the order of fp32 sums."""
    data_parallel = run_on_ranks(world_size, _losses_of_layout, str(tmp_path), "padded")[0]
    context_parallel = run_on_ranks(world_size, _losses_of_layout, str(tmp_path), "padded",
                                    "--context-parallel-size 2")[0]
    assert len(data_parallel) == 3
    torch.testing.assert_close(torch.tensor(context_parallel), torch.tensor(data_parallel), rtol=1e-5, atol=0)
