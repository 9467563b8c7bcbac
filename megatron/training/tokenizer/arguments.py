"""The flags that name a tokenizer's files and settings, shared by `pretrain_gpt.py` (through
`megatron.training.argument_groups.data`) and `tools/preprocess_data.py`. A module of its own, importing
nothing: the tool reads them without loading the training flags' groups (torch and the optimizers)."""


def add_tokenizer_file_arguments(group):
    """The flags naming a tokenizer's files and settings, shared with tools/preprocess_data.py."""
    group.add_argument("--vocab-file", default=None, help="GPT-2 vocab.json (GPT2BPETokenizer).")
    group.add_argument("--merge-file", default=None, help="GPT-2 merges.txt (GPT2BPETokenizer).")
    group.add_argument("--tokenizer-model", default=None,
                       help="Tokenizer file or name (HuggingFaceTokenizer), or the .json vocabulary (TikTokenizer).")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="HuggingFaceTokenizer: a --tokenizer-model directory or name loads with "
                       "transformers.AutoTokenizer.from_pretrained(..., trust_remote_code=True), which may run the "
                       "directory's Python code. A bare tokenizer.json (or a directory holding only that file) is "
                       "read without running any code either way.")
    group.add_argument("--tokenizer-hf-use-fast", action="store_true",
                       help="HuggingFaceTokenizer: load a --tokenizer-model directory or name with "
                       "AutoTokenizer.from_pretrained(..., use_fast=True), as upstream.")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer: accepted for upstream scripts; text is always tokenized with the "
                       "special tokens the tokenizer adds (such as a beginning-of-sequence token), flag or not, as "
                       "upstream's legacy tokenizer.")
    group.add_argument("--tiktoken-pattern", default=None, choices=["v1", "v2"],
                       help="TikTokenizer pre-tokenizer: v1 splits numbers into digits, v2 into groups of three.")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=None,
                       help="TikTokenizer ids reserved for special tokens (the BPE ids follow them); default 1000.")
    group.add_argument("--tiktoken-special-tokens", nargs="+", default=None,
                       help="TikTokenizer special tokens (must include <unk>, <s>, </s>); default <unk> <s> </s> "
                       "<mask> <pad> <cls> <sep>.")
    group.add_argument("--vocab-extra-ids", type=int, default=0,
                       help="SentencePieceTokenizer: this many <extra_id_N> sentinel tokens appended to the "
                       "vocabulary, as upstream; other types take only 0 (none, the default).")


def vocab_extra_ids_refusal(vocab_extra_ids, tokenizer_type=None):
    """Why --vocab-extra-ids `vocab_extra_ids` is refused for --tokenizer-type `tokenizer_type`; None for 0 (the
    default) and for SentencePieceTokenizer's count."""
    if vocab_extra_ids == 0 or (tokenizer_type == "SentencePieceTokenizer" and vocab_extra_ids > 0):
        return None
    if vocab_extra_ids < 0:
        return f"--vocab-extra-ids must be 0 or more (got {vocab_extra_ids})"
    return (f"--vocab-extra-ids {vocab_extra_ids} is not supported: --tokenizer-type {tokenizer_type} has no "
            "<extra_id_N> sentinel tokens (SentencePieceTokenizer appends them, as upstream's BERT/T5 tokenizers); "
            "drop the flag or use --tokenizer-type SentencePieceTokenizer")
