"""The tokenizer flags of pretrain_gpt.py as its argument validation reads them: upstream's flags a GPT launch script
may carry, and the tokenizer settings that stop before start-up with the flag to fix."""

import pytest

from tests.unit_tests.training.argument_checks import validated

SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


@pytest.mark.parametrize("tokenizer_type", SENTENCEPIECE_TYPES)
def test_sentencepiece_types_need_their_model_file(tokenizer_type):
    assert validated(f"--tokenizer-type {tokenizer_type} --tokenizer-model tokenizer.model").tokenizer_type == \
        tokenizer_type
    with pytest.raises(ValueError, match=rf"^--tokenizer-type {tokenizer_type} needs --tokenizer-model \(the "
                                         r"SentencePiece .model file\)$"):
        validated(f"--tokenizer-type {tokenizer_type}")


def test_huggingface_tokenizer_without_tokenizer_model_stops_in_validation():
    with pytest.raises(ValueError, match=r"^--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model \(a Hugging "
                                         r"Face tokenizer directory or name, or a tokenizer.json file\)$"):
        validated("--tokenizer-type HuggingFaceTokenizer")


def test_vocab_extra_ids_zero_is_accepted_and_others_are_refused_outside_sentencepiece():
    assert validated("").vocab_extra_ids == 0
    assert validated("--vocab-extra-ids 0").vocab_extra_ids == 0
    with pytest.raises(ValueError, match=r"^--vocab-extra-ids 100 is not supported: --tokenizer-type NullTokenizer "
                                         r"has no <extra_id_N> sentinel tokens.*drop the flag"):
        validated("--vocab-extra-ids 100")
    with pytest.raises(ValueError, match=r"^--vocab-extra-ids must be 0 or more \(got -1\)$"):
        validated("--tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizer.model --vocab-extra-ids -1")
