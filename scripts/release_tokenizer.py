"""A stand-in for the Qwen3.5 tokenizer, in the release's files and with the release's special tokens at their ids.

The release's vocabulary (248,044 byte-level BPE tokens) cannot be downloaded here, so this one is small: the 256
byte-level symbols and the merges `tokenizers`' BPE trainer learns from a fixed text (the chat template and a few
sentences), then unused filler entries up to id 248,043 so that the special tokens sit at the release's ids
(248,044 on) while every id below them exists (the project's loader, harness/data/tokenizer.py, takes the vocabulary
size from the count of ids). The fillers are plain vocabulary entries no merge produces: no text encodes to them.

The pipeline is the Qwen3.5 tokenizer's (transformers' Qwen3_5Tokenizer, which `AutoTokenizer` builds for a
qwen3_5_moe folder from tokenizer.json's vocabulary and merges): NFC, the Qwen split regex, byte-level BPE. So
`tokenizers.Tokenizer.from_file` (the project's loader) and `AutoTokenizer` give the same ids.

Special tokens: the Qwen lineage's 26 added tokens in their order (Qwen3's 151643-151668, moved to 248044-248069).
Ids confirmed in public copies of the Qwen3.5 files: <|endoftext|> 248044 (text_config.eos_token_id),
<|im_start|> 248045, <|im_end|> 248046 (generation_config eos), <|vision_start|> 248053, <|vision_end|> 248054,
<|image_pad|> 248056, <|video_pad|> 248057 (config.json), <think> 248068, </think> 248069 (tokenizer_config.json's
added_tokens_decoder). The release has more added tokens after 248069 (id 248070 is in use) whose names were not
found: they are left out. Which tokens are `special` follows Qwen3's tokenizer_config.json (tool, FIM and think
tags are added but not special, so decoding without specials keeps them).
"""

from __future__ import annotations

import json
from pathlib import Path

RELEASE_BPE_SIZE = 248044  # ids below the first added token in the release
# (content, special) from id 248044 on, in order.
ADDED_TOKENS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True), ("<|quad_start|>", True),
    ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True), ("<|vision_pad|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", False), ("<|fim_middle|>", False), ("<|fim_suffix|>", False), ("<|fim_pad|>", False),
    ("<|repo_name|>", False), ("<|file_sep|>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<think>", False), ("</think>", False),
]
# transformers' Qwen3_5Tokenizer split regex (models/qwen3_5/tokenization_qwen3_5.py), which the release's
# tokenizer.json also holds.
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Think step by step, then answer.",
    "Hello! How can I help you today? Here is the answer: 42.",
    "def main():\n    print('hello, world')\n    return 0\n",
    "The weather in Paris is sunny; in Tokyo it is raining.",
]
BPE_VOCAB_SIZE = 2048  # learned tokens at most (the training text yields fewer)


def build_tokenizer(chat_template: str):
    """The tokenizer (a `tokenizers.Tokenizer`): BPE learned from the chat template and TRAINING_TEXT, fillers up
    to RELEASE_BPE_SIZE, then ADDED_TOKENS at the release's ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

    learner = _with_qwen_pipeline(Tokenizer(models.BPE()))
    learner.train_from_iterator([chat_template, *TRAINING_TEXT], trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    learned = json.loads(learner.to_str())["model"]
    vocab = dict(learned["vocab"])
    vocab.update({f"<|unused_{i}|>": i for i in range(len(vocab), RELEASE_BPE_SIZE)})
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = _with_qwen_pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges)))
    for content, special in ADDED_TOKENS:  # ids follow the vocabulary's, in order: 248044, 248045, ...
        tok.add_tokens([AddedToken(content, special=special, normalized=False)])
    assert tok.token_to_id(ADDED_TOKENS[0][0]) == RELEASE_BPE_SIZE, "added tokens are not at the release's ids"
    return tok


def _with_qwen_pipeline(tok):
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_config() -> dict:
    """tokenizer_config.json as the Qwen releases write it (the chat template in its own file)."""
    added = {str(RELEASE_BPE_SIZE + i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                         "single_word": False, "special": special}
             for i, (content, special) in enumerate(ADDED_TOKENS)}
    return {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
            "additional_special_tokens": [c for c, special in ADDED_TOKENS[1:14] if special],
            "bos_token": None, "clean_up_tokenization_spaces": False, "eos_token": "<|im_end|>", "errors": "replace",
            "model_max_length": 262144, "pad_token": "<|endoftext|>", "split_special_tokens": False,
            "tokenizer_class": "Qwen2Tokenizer", "unk_token": None}


def write_tokenizer(folder: Path, chat_template: str) -> None:
    """tokenizer.json, tokenizer_config.json, vocab.json, merges.txt and chat_template.jinja (verbatim) into
    `folder`, the release's tokenizer files."""
    tok = build_tokenizer(chat_template)
    tok.save(str(folder / "tokenizer.json"))
    tok.model.save(str(folder))  # vocab.json, merges.txt
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
