"""The HF export carries the run's tokenizer: AutoTokenizer on the folder gives the ids the run trained on,
config.json names the same BOS / EOS, and every file is readable by others."""

from __future__ import annotations

import contextlib
import json
import os
import stat
import unicodedata

import pytest
import torch

from harness.checkpoint.errors import CheckpointError
from harness.checkpoint.hf_weights import export_hf
from harness.data.tokenizer import ByteTokenizer, HFTokenizer
from models.qwen35_moe import get_flavor
from tests.builders import initialized_model

TEXTS = [
    "Hello, world.",
    "  leading and trailing spaces  ",
    "héllo wörld, ça va? Ñandú",  # precomposed accents
    "日本語のテキスト，中文。한국어",
    "emoji 🎉👩‍👩‍👧 and a flag 🇫🇷",
    "lines\nand\r\nwindows\tand tabs\n\n",
    "text that spells <|bos|>, <|eos|>, <s> and </s>",
    "",
]


def _every_utf8_byte() -> str:
    """Text whose UTF-8 holds every byte UTF-8 can produce (all but C0, C1, F5..FF): ASCII, every 2-byte
    lead and continuation byte, and one character per 3- and 4-byte lead byte."""
    chars = [*map(chr, range(0x800)), chr(0x800), *map(chr, range(0x1000, 0x10000, 0x1000)),
             *map(chr, (0x10000, 0x40000, 0x80000, 0xC0000, 0x100000))]
    return " ".join(chars)


@pytest.fixture(scope="module")
def model_and_args():
    args = get_flavor("debugmodel")
    return initialized_model(args), args


def _export(model_and_args, folder, tokenizer):
    model, args = model_and_args
    export_hf(model, args, str(folder), torch.float32, tokenizer=tokenizer)
    return folder


@pytest.fixture(scope="module")
def byte_export(model_and_args, tmp_path_factory):
    return _export(model_and_args, tmp_path_factory.mktemp("byte") / "hf", ByteTokenizer())


def _config(folder) -> dict:
    return json.loads((folder / "config.json").read_text())


# -- built-in byte tokenizer -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokenizer_export_round_trips_through_autotokenizer(byte_export, text):
    from transformers import AutoTokenizer

    ours, theirs = ByteTokenizer(), AutoTokenizer.from_pretrained(byte_export)
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode(text)
    assert theirs.decode(ids) == text
    assert theirs(text)["input_ids"] == [ours.bos_id, *ours.encode(text)]  # BOS first, as in training documents


def test_byte_tokenizer_export_has_bos_256_and_eos_257(byte_export):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(byte_export)
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert len(tok) == ByteTokenizer.vocab_size  # no token beyond BOS/EOS (e.g. a default unk or pad) was added
    assert tok.decode([256, 72, 105, 257], skip_special_tokens=True) == "Hi"


def test_byte_tokenizer_export_covers_every_utf8_byte(byte_export):
    """transformers loads a qwen3_5_moe_text checkpoint's tokenizer as Qwen3_5Tokenizer, which NFC-normalises
    first: AutoTokenizer equals ByteTokenizer on NFC text. tokenizer.json itself (PreTrainedTokenizerFast) is
    exact on any text."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    text = _every_utf8_byte()
    assert text != unicodedata.normalize("NFC", text)  # it holds decomposable characters, so both claims are tested
    ours = ByteTokenizer()
    nfc = unicodedata.normalize("NFC", text)
    assert set(ours.encode(nfc)) == set(range(256)) - {0xC0, 0xC1, *range(0xF5, 256)}

    auto = AutoTokenizer.from_pretrained(byte_export)
    assert auto(text, add_special_tokens=False)["input_ids"] == ours.encode(nfc)
    assert auto.decode(ours.encode(text)) == text

    exact = PreTrainedTokenizerFast.from_pretrained(byte_export)
    assert exact(text, add_special_tokens=False)["input_ids"] == ours.encode(text)
    assert exact.decode(ours.encode(text)) == text


def test_byte_tokenizer_export_config_carries_bos_and_eos(byte_export):
    config = _config(byte_export)
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)


# -- a Hugging Face tokenizer folder -----------------------------------------------------------------------------------


def make_qwen_style_tokenizer(folder) -> None:
    """A small byte-level BPE in the Qwen3.5 layout (NFC, transformers' Qwen3.5 split regex, ByteLevel), trained
    here, with the side files of a real tokenizer folder and, beside them, files that are not the tokenizer's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False)
    tok.train_from_iterator(TEXTS * 20 + ["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    template = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    (folder / "chat_template.jinja").write_text(template)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text(template)
    (folder / "config.json").write_text("{}")  # the source model's: the export writes its own
    (folder / "model.safetensors").write_bytes(b"weights")
    os.chmod(folder / "tokenizer.json", 0o600)  # a private source file still exports readable


def test_hf_tokenizer_folder_is_copied_and_autotokenizer_gives_our_ids(model_and_args, tmp_path):
    from transformers import AutoTokenizer

    make_qwen_style_tokenizer(tmp_path / "tok")
    ours = HFTokenizer(str(tmp_path / "tok"))
    folder = _export(model_and_args, tmp_path / "hf", ours)

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "additional_chat_templates/tool_use.jinja"):
        assert (folder / name).read_bytes() == (tmp_path / "tok" / name).read_bytes(), name
    assert (folder / "model.safetensors").read_bytes() != b"weights"  # the export's weights, not the source's
    assert stat.S_IMODE((folder / "tokenizer.json").stat().st_mode) & stat.S_IROTH
    assert _config(folder)["model_type"] == "qwen3_5_moe_text"  # the export's config.json, not the source's

    theirs = AutoTokenizer.from_pretrained(folder)
    for text in [*TEXTS, "the quick brown fox"]:
        ids = theirs(text, add_special_tokens=False)["input_ids"]
        assert ids == ours.encode(text), text
        assert theirs.decode(ids) == ours.decode(ids)
    assert (theirs.bos_token_id, theirs.eos_token_id) == (ours.bos_id, ours.eos_id) == (None, 2)
    assert theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>hi<|im_end|>"
    config = _config(folder)
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, 2)


def test_hf_tokenizer_file_is_exported_as_tokenizer_json(model_and_args, tmp_path):
    """model.tokenizer_path may name the tokenizer.json file itself, under any name; the export holds it under
    the standard name, and tokenizer.json as written (PreTrainedTokenizerFast) gives our ids for any model type
    (here WordLevel, which transformers' Qwen3_5Tokenizer would rebuild as a BPE)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "words.json"))
    ours = HFTokenizer(str(tmp_path / "words.json"))
    folder = _export(model_and_args, tmp_path / "hf", ours)

    assert (folder / "tokenizer.json").read_bytes() == (tmp_path / "words.json").read_bytes()
    theirs = PreTrainedTokenizerFast.from_pretrained(folder)
    text = "hello world nope"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ours.encode(text) == [1, 2, 0]
    config = _config(folder)
    assert (config["bos_token_id"], config["eos_token_id"]) == (None, None)  # no specials: None stays None


# -- the folder ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def test_export_files_are_0644_and_folders_0755_less_the_umask(model_and_args, tmp_path):
    make_qwen_style_tokenizer(tmp_path / "tok")  # it has a subfolder
    with umask(0o027):
        folder = _export(model_and_args, tmp_path / "hf", HFTokenizer(str(tmp_path / "tok")))
    assert sorted(p.name for p in folder.iterdir()) == [
        "additional_chat_templates", "chat_template.jinja", "config.json", "generation_config.json",
        "model.safetensors", "qwen35_titan_export.json", "special_tokens_map.json", "tokenizer.json",
        "tokenizer_config.json"]
    for path in folder.rglob("*"):
        expected = 0o750 if path.is_dir() else 0o640  # 0755 / 0644 less umask 027: the group reads, others don't
        assert stat.S_IMODE(path.stat().st_mode) == expected, path.name
    assert stat.S_IMODE(folder.stat().st_mode) == 0o750


def test_export_files_are_readable_by_all_under_the_usual_umask(model_and_args, tmp_path):
    with umask(0o022):
        folder = _export(model_and_args, tmp_path / "hf", ByteTokenizer())
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "qwen35_titan_export.json", "tokenizer.json",
        "tokenizer_config.json"]
    for path in folder.iterdir():
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & stat.S_IRGRP and mode & stat.S_IROTH, f"{path.name}: {oct(mode)}"


def test_tokenizer_files_are_published_with_the_weights_or_not_at_all(model_and_args, tmp_path):
    """The tokenizer is written into the temporary folder before the rename: a failure there leaves the
    previous export (here none) under the final name, never weights without their tokenizer."""

    class BrokenTokenizer(ByteTokenizer):
        def save_pretrained(self, folder):
            (folder / "tokenizer.json").write_text("{")
            raise OSError("disk full")

    with pytest.raises(CheckpointError, match="disk full"):  # train.py: one error line, exit 2
        _export(model_and_args, tmp_path / "hf", BrokenTokenizer())
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
    (tmp_path / "hf.tmp").mkdir()  # as an export killed midway leaves it
    folder = _export(model_and_args, tmp_path / "hf", ByteTokenizer())  # the leftover .tmp is no obstacle
    assert (folder / "tokenizer.json").is_file() and not (tmp_path / "hf.tmp").exists()
