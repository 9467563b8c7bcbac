"""SFT datasets: conversations from JSON-lines files as packed rows (each conversation's ids, labels, loss mask and
positions in its own span, described by cu_seqlens) or one per padded sample; epochs, splits and blends."""

import json
import random

import pytest
import torch

from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.training.datasets.sft_dataset import SFTDatasetConfig, build_sft_datasets
from megatron.training.tokenizer.byte_level_tokenizer import ByteLevelTokenizer
from megatron.training.tokenizer.chat_prompt_formats import IGNORE_INDEX, tokenize_conversation

WORDS = ("red", "blue", "green", "tea", "sun", "moon", "river", "stone")
SEQ = 256


def write_conversations(path, count, seed=0, extra=()):
    """`count` short user/assistant conversations of random words (some with a system message), then `extra`."""
    rng = random.Random(seed)
    with open(path, "w") as stream:
        for index in range(count):
            messages = [{"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 6)))},
                        {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(1, 8)))}]
            if index % 3 == 0:
                messages.insert(0, {"role": "system", "content": "short"})
            stream.write(json.dumps({"messages": messages}) + "\n")
        for record in extra:
            stream.write(json.dumps(record) + "\n")
    return str(path)


def _config(paths, weights=None, **overrides):
    fields = dict(random_seed=7, sequence_length=SEQ, tokenizer=ByteLevelTokenizer(), blend=(paths, weights),
                  split=(1.0, 0.0, 0.0), prompt_format="plain")
    fields.update(overrides)
    return SFTDatasetConfig(**fields)


def _conversations(path):
    with open(path) as stream:
        return [json.loads(line)["messages"] for line in stream]


def _spans(sample):
    """[(start, real length, padded span)] of a packed sample's conversations."""
    real = [int(x) for x in sample["cu_seqlens"] if x >= 0]
    padded = [int(x) for x in sample["cu_seqlens_padded"] if x >= 0]
    return [(padded[i], real[i + 1] - real[i], padded[i + 1] - padded[i]) for i in range(len(real) - 1)]


@pytest.mark.parametrize("pad_multiple", [1, 4])
def test_packed_rows_hold_each_conversation_once_per_epoch_in_its_own_span(tmp_path, pad_multiple):
    path = write_conversations(tmp_path / "chat.jsonl", 40)
    dataset = build_sft_datasets(_config([path], pad_multiple=pad_multiple), (60, 0, 0))[0]
    expected = [tokenize_conversation(ByteLevelTokenizer(), messages, "plain") for messages in _conversations(path)]
    rows = len(dataset.rows_by_epoch[0])
    assert 40 * 25 // SEQ < rows < 40  # several conversations share a row
    seen = []
    for index in range(rows):
        sample = dataset[index]
        spans = _spans(sample)
        assert spans[-1][0] + spans[-1][2] == SEQ and int(sample["max_seqlen"]) == max(s[1] for s in spans)
        for start, length, span in spans:
            assert span % pad_multiple == 0 and span >= length
            ids = sample["tokens"][start:start + length].tolist() + [int(sample["labels"][start + length - 1])]
            match = [i for i, (tokens, _) in enumerate(expected) if tokens == ids]
            assert len(match) == 1
            tokens, target = expected[match[0]]
            assert sample["labels"][start:start + length].tolist() == tokens[1:]
            assert sample["loss_mask"][start:start + length].tolist() == [float(t != IGNORE_INDEX) for t in target[1:]]
            assert sample["position_ids"][start:start + span].tolist() == list(range(span))
            seen.append(match[0])
        # Padding is out of the loss; a row is closed only when the next conversation does not fit.
        real = torch.zeros(SEQ, dtype=torch.bool)
        for start, length, _ in spans:
            real[start:start + length] = True
        assert not sample["loss_mask"][~real].any()
        used = spans[-1][0] + -(-spans[-1][1] // pad_multiple) * pad_multiple
        if index + 1 < rows:
            following = _spans(dataset[index + 1])[0]
            assert used + -(-following[1] // pad_multiple) * pad_multiple > SEQ
    assert sorted(seen) == list(range(40))
    # The next epoch serves the same conversations in another order.
    assert len(dataset) == 60 and dataset.conversations_of_sample(rows) != dataset.conversations_of_sample(0)


def test_one_conversation_per_sample_is_padded_and_epochs_reshuffle(tmp_path):
    path = write_conversations(tmp_path / "chat.jsonl", 5)
    dataset = build_sft_datasets(_config([path], pack=False), (12, 0, 0))[0]
    expected = [tokenize_conversation(ByteLevelTokenizer(), messages, "plain")[0] for messages in _conversations(path)]
    firsts = [dataset.conversations_of_sample(i)[0] for i in range(10)]
    assert sorted(firsts[:5]) == sorted(firsts[5:]) == list(range(5)) and firsts[:5] != firsts[5:]
    sample = dataset[0]
    assert "cu_seqlens" not in sample
    tokens = expected[firsts[0]]
    assert sample["tokens"][:len(tokens) - 1].tolist() == tokens[:-1]
    assert sample["labels"][:len(tokens) - 1].tolist() == tokens[1:]
    assert not sample["loss_mask"][len(tokens) - 1:].any() and (sample["tokens"][len(tokens) - 1:] == 256).all()
    assert sample["position_ids"].tolist() == list(range(SEQ))


def test_long_conversations_are_cut_and_untrainable_ones_dropped(tmp_path):
    long_reply = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "x" * 600}]}
    user_only = {"messages": [{"role": "user", "content": "nothing to learn"}]}
    path = write_conversations(tmp_path / "chat.jsonl", 3, extra=[long_reply, user_only])
    dataset = build_sft_datasets(_config([path]), (4, 0, 0))[0]
    assert len(dataset.conversations) == 4
    lengths = sorted(len(tokens) for tokens, _ in dataset.conversations)
    assert lengths[-1] == SEQ + 1  # cut to --seq-length positions
    row = next(i for i in range(len(dataset)) if any(len(dataset.conversations[m][0]) == SEQ + 1
                                                      for m in dataset.conversations_of_sample(i)))
    assert _spans(dataset[row]) == [(0, SEQ, SEQ)] and dataset[row]["loss_mask"][-1] == 1.0


def test_split_and_blend(tmp_path):
    first = write_conversations(tmp_path / "a.jsonl", 50, seed=1)
    second = write_conversations(tmp_path / "b.jsonl", 30, seed=2)
    train, valid, test = build_sft_datasets(_config([first, second], [3.0, 1.0], split=(0.8, 0.2, 0.0),
                                                    pack=False), (40, 8, 0))
    assert test is None and isinstance(train, BlendedDataset)
    assert train.samples_per_dataset.tolist() == [30, 10] and len(train) == 40
    assert [len(part.conversations) for part in train.datasets] == [40, 24]  # the first 80% of each file
    assert [len(part.conversations) for part in valid.datasets] == [10, 6]
    train_ids = {tuple(tokens) for part in train.datasets for tokens, _ in part.conversations}
    valid_ids = {tuple(tokens) for part in valid.datasets for tokens, _ in part.conversations}
    assert not train_ids & valid_ids
    by_size = build_sft_datasets(_config([first, second], pack=False), (16, 0, 0))[0]
    assert by_size.samples_per_dataset.tolist() == [10, 6]  # without weights: shares by conversations (50 : 30)
    whole = build_sft_datasets(_config([first, second], split=(0.5, 0.5, 0.0)), (4, None, 0))[1]
    assert len(whole) == sum(len(part.rows_by_epoch[0]) for part in whole.datasets)  # --full-validation


@pytest.mark.parametrize("line, message", [
    ("not json", r"a\.jsonl:2: not JSON"),
    ('{"text": "pretraining text"}', r"a\.jsonl:2: a conversation is"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', r"a\.jsonl:2: .*role 'robot' is not one of"),
])
def test_malformed_lines_are_refused_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "a.jsonl"
    write_conversations(path, 1)
    with open(path, "a") as stream:
        stream.write(line + "\n")
    with pytest.raises(ValueError, match=message):
        build_sft_datasets(_config([str(path)]), (2, 0, 0))


def test_missing_files_and_bad_settings_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"--sft reads conversations from JSON-lines files; .*nope\.jsonl "
                                                r"does not exist"):
        build_sft_datasets(_config([str(tmp_path / "nope.jsonl")]), (2, 0, 0))
    with pytest.raises(ValueError, match=r"--seq-length 256 must be a multiple of 96"):
        _config(["x"], pad_multiple=96)
    with pytest.raises(ValueError, match=r"--sft-tokenizer-prompt-format 'mistral'"):
        _config(["x"], prompt_format="mistral")
    path = write_conversations(tmp_path / "a.jsonl", 0, extra=[{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match=r"has no conversation with an assistant reply"):
        build_sft_datasets(_config([path]), (2, 0, 0))


def test_multiple_validation_sets_are_labelled_by_their_files(tmp_path):
    from megatron.training.validation_sets import set_labels

    first = write_conversations(tmp_path / "a.jsonl", 20, seed=1)
    second = write_conversations(tmp_path / "b.jsonl", 20, seed=2)
    valid = build_sft_datasets(_config([first, second], split=(0.5, 0.5, 0.0), multiple_validation_sets=True),
                               (4, 4, 0))[1]
    assert isinstance(valid, list) and set_labels(valid) == ["a.jsonl", "b.jsonl"]
