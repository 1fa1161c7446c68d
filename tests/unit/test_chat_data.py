"""Chat rows (harness/data/chat.py): the official Qwen3.5 template renders them, the targets are exactly the tokens it
emits for assistant turns, the ids are apply_chat_template's; malformed rows are counted and left out; the cache keeps
a target flag per token, checked like the tokens. Packing the rows: test_chat_packing.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from harness.data import token_cache
from harness.data.chat import ChatOptions, assistant_spans
from harness.data.encoders import ChatEncoder
from harness.data.errors import DataError
from harness.data.loader import build_dataloader
from harness.data.sources import Row, Skipped
from harness.data.token_cache import META_FILE, TARGETS_FILE, open_cache
from harness.data.tokenizer import HFTokenizer
from tests.runs import write_rows

REPO = Path(__file__).resolve().parents[2]
DEBUG_CHAT = REPO / "data" / "debug_chat"
QWEN35_TEMPLATE = (REPO / "tests" / "data" / "qwen35_chat_template.jinja").read_text()
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# Each: (row, the text of each run of target tokens, written by hand from the Qwen3.5 template's rules)
CONVERSATIONS = {
    "multi_turn_reasoning_before_the_last_query_is_dropped": (
        {"messages": [{"role": "system", "content": "Be brief."},
                      {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4", "reasoning_content": "add them"},
                      {"role": "user", "content": "and 3+3?"},
                      {"role": "assistant", "content": "6", "reasoning_content": "add again"}]},
        ["4<|im_end|>", "<think>\nadd again\n</think>\n\n6<|im_end|>"]),
    "tool_call_and_answer_after_the_query_keep_their_reasoning": (
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
                       "tool_calls": [{"type": "function",
                                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                      {"role": "tool", "content": "sunny, 21 C"},
                      {"role": "assistant", "content": "It is sunny.", "reasoning_content": "The tool says so."}],
         "tools": TOOLS},
        ["<think>\nNeed the tool.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n</function>\n</tool_call><|im_end|>",
         "<think>\nThe tool says so.\n</think>\n\nIt is sunny.<|im_end|>"]),
    "reasoning_inline_in_the_content_is_parsed_and_kept_on_the_last_turn": (
        {"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nhello there"},
                      {"role": "user", "content": "bye"},
                      {"role": "assistant", "content": "<think>a wave</think>bye!"}]},
        ["hello there<|im_end|>", "<think>\na wave\n</think>\n\nbye!<|im_end|>"]),
    "content_and_a_tool_call_without_reasoning": (
        {"messages": [{"role": "system", "content": "Use tools."},
                      {"role": "user", "content": "Paris and Rome?"},
                      {"role": "assistant", "content": "Checking both.",
                       "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                                      {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                      {"role": "tool", "content": "sunny"},
                      {"role": "tool", "content": "rain"},
                      {"role": "assistant", "content": "Paris sunny, Rome rain."}],
         "tools": TOOLS},
        ["<think>\n\n</think>\n\nChecking both.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
         "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n"
         "</parameter>\n</function>\n</tool_call><|im_end|>",
         "<think>\n\n</think>\n\nParis sunny, Rome rain.<|im_end|>"]),
}


# -- tokenizers with the ChatML special tokens ----------------------------------------------------------------------


def byte_tokenizer(folder: Path, template: str | None = QWEN35_TEMPLATE) -> Path:
    """The debug chat tokenizer (byte-level, ChatML specials), with `template` as its chat_template.jinja."""
    shutil.copytree(DEBUG_CHAT / "tokenizer", folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder


def bpe_tokenizer(folder: Path, template: str = QWEN35_TEMPLATE) -> Path:
    """A small byte-level BPE with merges in the Qwen3.5 layout, so that tokens span several characters."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    texts = [QWEN35_TEMPLATE] + [json.dumps(row) for row, _ in CONVERSATIONS.values()] * 5
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module", params=["byte", "bpe"])
def qwen35_tokenizer(request, tmp_path_factory) -> HFTokenizer:
    make = byte_tokenizer if request.param == "byte" else bpe_tokenizer
    return HFTokenizer(str(make(tmp_path_factory.mktemp(request.param) / "tok")))


def row_of(value: dict, line: int = 1) -> Row:
    return Row(value, lambda: f"chats.jsonl:{line}")


def target_runs(ids: list[int], targets: list[int], tok) -> list[str]:
    """The text of each run of consecutive target tokens."""
    runs, run = [], []
    for token, flag in zip(ids + [None], targets + [0]):
        if flag:
            run.append(token)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


# -- the mask on the official Qwen3.5 template ----------------------------------------------------------------------


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_qwen35_targets_are_the_assistant_turns_and_the_ids_are_apply_chat_templates(qwen35_tokenizer, name):
    row, expected_runs = CONVERSATIONS[name]
    encoder = ChatEncoder(qwen35_tokenizer, ChatOptions(), check_every=1)
    ids, targets = encoder(row_of(row))
    encoder.finish()  # every conversation checked: no row differs
    reference = encoder.tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True)
    assert ids == list(reference["input_ids"])
    text = encoder.tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=False)
    assert encoder.tok.decode(ids) == text  # the whole rendering, nothing added or lost
    assert target_runs(ids, targets, encoder.tok) == expected_runs
    # Headers, system, user and tool turns are never targets.
    untargeted = encoder.tok.decode([i for i, t in zip(ids, targets) if not t])
    assert untargeted.count("<|im_start|>assistant\n") == sum(m["role"] == "assistant" for m in row["messages"])
    for message in row["messages"]:
        if message["role"] in ("user", "tool") and message["content"]:
            assert message["content"] in untargeted


def test_assistant_spans_run_from_the_header_through_the_closing_marker():
    text = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\nopen"
    assert [text[a:b] for a, b in assistant_spans(text)] == ["yo<|im_end|>", "open"]


def test_chat_targets_all_trains_on_every_token(qwen35_tokenizer):
    row, _ = CONVERSATIONS["tool_call_and_answer_after_the_query_keep_their_reasoning"]
    ids, targets = ChatEncoder(qwen35_tokenizer, ChatOptions(targets="all"))(row_of(row))
    assert targets == [1] * len(ids)


def test_every_check_every_th_conversation_of_a_unit_is_checked(qwen35_tokenizer, monkeypatch):
    encoder = ChatEncoder(qwen35_tokenizer, ChatOptions(), check_every=3)
    checked = []
    monkeypatch.setattr(encoder, "_check", lambda row, *args: checked.append(row.locate()))
    row, _ = CONVERSATIONS["multi_turn_reasoning_before_the_last_query_is_dropped"]
    for unit in range(2):
        encoder.start_unit()
        for line in range(1, 8):
            encoder(row_of(row, line))
    assert checked == ["chats.jsonl:1", "chats.jsonl:4", "chats.jsonl:7"] * 2


def test_ids_that_differ_from_apply_chat_template_are_named_in_one_error(qwen35_tokenizer, monkeypatch):
    encoder = ChatEncoder(qwen35_tokenizer, ChatOptions(), check_every=1)
    real = type(encoder.tok).apply_chat_template

    def off_by_one(self, messages, tools=None, tokenize=True, **kwargs):  # a tokenizer setting we do not follow
        out = real(self, messages, tools=tools, tokenize=tokenize, **kwargs)
        if tokenize:
            out["input_ids"] = out["input_ids"][:5] + [out["input_ids"][5] + 1] + out["input_ids"][6:]
        return out

    monkeypatch.setattr(type(encoder.tok), "apply_chat_template", off_by_one)
    for line, (row, _) in enumerate(CONVERSATIONS.values(), 1):
        encoder(row_of(row, line))
    with pytest.raises(DataError, match=r"token ids of 4 conversations differ from transformers' apply_chat_template"
                                        r".*chats\.jsonl:1 at token 5 .*chats\.jsonl:4 at token 5"):
        encoder.finish()


# -- rows that cannot be trained on -----------------------------------------------------------------------------------


GOOD = CONVERSATIONS["multi_turn_reasoning_before_the_last_query_is_dropped"][0]
MALFORMED = {  # row: (what the reason says)
    "no_assistant": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant turn"),
    "unknown_role": ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
                     "messages[1] has role 'bot'"),
    "content_type": ({"messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}]},
                     "messages[0] has content that is a number"),
    "not_a_list": ({"messages": "hi there"}, "'messages' is a string, not a list of messages"),
    "chatml_marker": ({"messages": [{"role": "user", "content": "hi<|im_end|>"}, {"role": "assistant", "content": "x"}]},
                      "messages[0] spells the ChatML marker <|im_end|>"),
    "template_refuses": ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]},
                         "the chat template refused it (No user query found in messages.)"),
    "tool_calls_type": ({"messages": [{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "x", "tool_calls": "call it"}]},
                        "messages[1] has tool_calls that are not a list of objects"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_conversation_is_skipped_with_its_reason(qwen35_tokenizer, case):
    row, reason = MALFORMED[case]
    skipped = ChatEncoder(qwen35_tokenizer, ChatOptions())(row_of(row, 9))
    assert isinstance(skipped, Skipped) and skipped.locate() == "chats.jsonl:9"
    assert reason in skipped.reason


def chat_loader(source: Path, tok, cache_dir: Path, seq_len: int = 512, **options):
    return build_dataloader("jsonl", str(source), "text", tok, seq_len, 1, cache_dir=cache_dir, data_format="chat",
                            chat=ChatOptions(**options))


def test_malformed_rows_are_counted_and_named_once_and_a_set_of_only_those_is_an_error(tmp_path, caplog):
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok")))
    bad = [row for row, _ in MALFORMED.values()]
    source = write_rows(tmp_path / "chats.jsonl", [GOOD, bad[0], GOOD, *bad[1:], GOOD])
    with caplog.at_level(logging.WARNING):
        loader = chat_loader(source, tok, tmp_path / "cache")
    assert loader.cache.meta["skipped_rows"] == {"count": len(bad), "first": f"{source}:2: no assistant turn"}
    assert len(loader.cache.doc_starts) == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"data: {len(bad)} rows of the dataset are conversations that cannot be trained on and were "
                        f"left out (the first: {source}:2: no assistant turn)"]
    only_bad = write_rows(tmp_path / "bad.jsonl", bad)
    with pytest.raises(DataError, match=rf"chat jsonl dataset .*bad\.jsonl holds no conversations: all its {len(bad)} "
                                        rf"rows are conversations that cannot be trained on \(the first: "
                                        rf".*bad\.jsonl:1: no assistant turn\)"):
        chat_loader(only_bad, tok, tmp_path / "cache")


def test_a_file_that_is_not_chat_data_names_file_and_line(tmp_path):
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok")))
    source = tmp_path / "chats.jsonl"
    source.write_text(json.dumps(GOOD) + "\n" + json.dumps({"text": "plain"}) + "\n")
    with pytest.raises(DataError, match=r"chats\.jsonl:2: no field 'messages' \(the row has 'text'\); set "
                                        r"training\.chat_messages_field"):
        chat_loader(source, tok, tmp_path / "cache")
    source.write_text(json.dumps(GOOD) + "\n" + '{"messages": [\n')
    with pytest.raises(DataError, match=r"chats\.jsonl:2: not a JSON object"):
        chat_loader(source, tok, tmp_path / "cache")
    with pytest.raises(DataError, match="not from text files"):
        build_dataloader("text", str(source), "text", tok, 64, 1, cache_dir=tmp_path / "c", data_format="chat")


def test_a_template_without_chatml_markers_is_not_qwen_style(tmp_path):
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok", plain)))
    source = write_rows(tmp_path / "chats.jsonl", [GOOD])
    with pytest.raises(DataError, match=r"chat template of .*tok is not Qwen-style \(ChatML\): its rendering of "
                                        r".*chats\.jsonl:1 holds no '<\|im_start\|>assistant\\n' header"):
        chat_loader(source, tok, tmp_path / "cache")
    loader = chat_loader(source, tok, tmp_path / "cache", targets="all")  # no spans needed
    assert loader.cache.targets.all()


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok", template=None)))
    with pytest.raises(DataError, match=r"tok has no chat template \(neither chat_template.jinja nor a chat_template "
                                        r"in tokenizer_config.json\)"):
        ChatEncoder(tok, ChatOptions())


# -- the cache: targets.bin beside the tokens ---------------------------------------------------------------------------


@pytest.fixture
def chat_cache(tmp_path):
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok")))
    source = write_rows(tmp_path / "chats.jsonl", [row for row, _ in CONVERSATIONS.values()] * 3)
    return tok, source, chat_loader(source, tok, tmp_path / "cache").cache


def test_the_cache_holds_one_target_flag_per_token(chat_cache):
    tok, source, cache = chat_cache
    encoder = ChatEncoder(tok, ChatOptions())
    rows = [json.loads(line) for line in source.read_text().splitlines()]
    want_ids, want_targets = [], []
    for row in rows:
        ids, targets = encoder(row_of(row))
        want_ids += ids
        want_targets += targets
    assert cache.tokens.tolist() == want_ids and cache.targets.tolist() == want_targets
    assert (cache.folder / TARGETS_FILE).stat().st_size == len(want_ids)
    meta = json.loads((cache.folder / META_FILE).read_text())
    assert meta["targets"]["num_targets"] == sum(want_targets) and meta["source"]["format"] == "chat"
    assert cache.folder.name.startswith("chat-jsonl-v2-")


@pytest.mark.parametrize("damage, message", [
    ("flip", "targets.bin does not match its sha256"),
    ("two", "targets.bin holds the value 2 where only 0 and 1 belong"),
    ("truncate", "targets.bin has .* bytes where meta.json records"),
])
def test_a_damaged_targets_file_is_caught_by_the_quick_check(chat_cache, damage, message):
    _, _, cache = chat_cache
    flags = bytearray((cache.folder / TARGETS_FILE).read_bytes())
    if damage == "flip":
        flags[len(flags) // 2] ^= 1
    elif damage == "two":
        flags[3] = 2
    else:
        flags = flags[:-1]
    (cache.folder / TARGETS_FILE).write_bytes(bytes(flags))
    with pytest.raises(DataError, match=f"{cache.folder.name} is damaged: {message}"):
        open_cache(cache.folder, cache.vocab_size)


def test_the_cache_key_holds_the_template_and_the_chat_keys(chat_cache, tmp_path):
    tok, source, cache = chat_cache
    folders = {cache.folder}
    folders.add(chat_loader(source, tok, tmp_path / "cache", targets="all").cache.folder)
    folders.add(chat_loader(source, tok, tmp_path / "cache").cache.folder)  # the same again: reused
    (Path(tok.path).parent / "chat_template.jinja").write_text(QWEN35_TEMPLATE.replace("<tools>", "<functions>"))
    folders.add(chat_loader(source, tok, tmp_path / "cache").cache.folder)
    assert len(folders) == 3 and all(f.parent == tmp_path / "cache" for f in folders)


def test_a_new_transformers_version_builds_a_new_chat_cache_of_the_same_stream(chat_cache, tmp_path, monkeypatch):
    """The template is rendered by transformers' apply_chat_template: another version may render it otherwise, so it
    keys a cache of its own; the tokens being the same, so is the stream id a saved data position names."""
    import transformers

    tok, source, cache = chat_cache
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".post1")
    upgraded = chat_loader(source, tok, tmp_path / "cache").cache
    assert upgraded.folder != cache.folder and upgraded.stream_id == cache.stream_id


def test_a_flag_flipped_outside_the_sample_is_caught_by_the_full_check(tmp_path, monkeypatch):
    monkeypatch.setattr(token_cache, "SAMPLE_BLOCKS", 2)
    monkeypatch.setattr(token_cache, "SAMPLE_BLOCK_TOKENS", 16)  # a sample of 32 tokens: the middle is outside
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok")))
    source = write_rows(tmp_path / "chats.jsonl", [row for row, _ in CONVERSATIONS.values()] * 3)
    cache = chat_loader(source, tok, tmp_path / "cache").cache
    flags = bytearray((cache.folder / TARGETS_FILE).read_bytes())
    flags[len(flags) // 2] ^= 1
    (cache.folder / TARGETS_FILE).write_bytes(bytes(flags))
    assert open_cache(cache.folder, cache.vocab_size, "quick").targets[len(flags) // 2] == flags[len(flags) // 2]
    with pytest.raises(DataError, match="targets.bin does not match its sha256"):
        open_cache(cache.folder, cache.vocab_size, "full")


def test_parquet_chat_rows_give_the_tokens_and_targets_of_the_same_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tok = HFTokenizer(str(byte_tokenizer(tmp_path / "tok")))
    rows = [row for row, _ in CONVERSATIONS.values()]
    # Parquet gives every row every key of the schema: a null where a row (or a message) lacks one, rendered as absent
    table = pa.Table.from_pylist([{**row, "tools": row.get("tools")} for row in rows])
    pq.write_table(table, tmp_path / "chats.parquet", row_group_size=2)
    from_parquet = build_dataloader("parquet", str(tmp_path / "chats.parquet"), "text", tok, 512, 1,
                                    cache_dir=tmp_path / "cache", data_format="chat").cache
    from_jsonl = chat_loader(write_rows(tmp_path / "chats.jsonl", rows), tok, tmp_path / "cache").cache
    assert from_parquet.tokens.tolist() == from_jsonl.tokens.tolist()
    assert from_parquet.targets.tolist() == from_jsonl.targets.tolist()


# -- what the template is given: text parts joined, tool-call arguments as objects ------------------------------------


def debug_template_tokenizer() -> HFTokenizer:
    """The shipped debug chat tokenizer: its template renders string content only, and tool-call arguments with
    tojson."""
    return HFTokenizer(str(DEBUG_CHAT / "tokenizer"))


def with_parts(row: dict) -> dict:
    """`row` with every string content given as text parts (cut in two, as a client may send them)."""
    def parts(text):
        return [{"type": "text", "text": text[: len(text) // 2]}, {"type": "text", "text": text[len(text) // 2:]}]
    return {**row, "messages": [{**m, "content": parts(m["content"]) if isinstance(m["content"], str) else m["content"]}
                                for m in row["messages"]]}


@pytest.mark.parametrize("name", CONVERSATIONS)
def test_text_parts_give_the_ids_the_official_template_gives_them(qwen35_tokenizer, name):
    row, _ = CONVERSATIONS[name]
    encoder = ChatEncoder(qwen35_tokenizer, ChatOptions(), check_every=1)
    ids, targets = encoder(row_of(with_parts(row)))
    encoder.finish()
    official = encoder.tok.apply_chat_template(with_parts(row)["messages"], tools=row.get("tools"), tokenize=True)
    assert ids == list(official["input_ids"]) and (ids, targets) == encoder(row_of(row))


def test_text_parts_are_rendered_by_a_template_that_renders_strings_only():
    encoder = ChatEncoder(debug_template_tokenizer(), ChatOptions(), check_every=1)
    row = {"messages": [{"role": "user", "content": "reverse abc"}, {"role": "assistant", "content": "cba"}]}
    got = encoder(row_of(with_parts(row)))
    encoder.finish()
    assert got == encoder(row_of(row))  # the reply "cba" is trained on, not an empty answer


def test_an_assistant_turn_the_template_renders_empty_is_left_out(tmp_path):
    misspelt = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.text }}<|im_end|>\n{% endfor %}")  # no content
    encoder = ChatEncoder(HFTokenizer(str(byte_tokenizer(tmp_path / "tok", misspelt))), ChatOptions())
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    skipped = encoder(row_of(row, 4))
    assert isinstance(skipped, Skipped) and skipped.locate() == "chats.jsonl:4"
    assert skipped.reason == ("the chat template rendered messages[1] (assistant) empty, though it has content: "
                              "the template does not render it")
    assert not isinstance(encoder(row_of({"messages": [*row["messages"][:1], {"role": "assistant", "content": ""}]})),
                          Skipped)  # an empty reply rendered empty is what the row says


def tool_call_row(arguments) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                         {"role": "tool", "content": "sunny"},
                         {"role": "assistant", "content": "Sunny."}], "tools": TOOLS}


@pytest.mark.parametrize("template", ["official", "debug"])
def test_tool_call_arguments_given_as_a_json_string_render_as_the_object(qwen35_tokenizer, template):
    tok = qwen35_tokenizer if template == "official" else debug_template_tokenizer()
    encoder = ChatEncoder(tok, ChatOptions(), check_every=1)
    as_object = encoder(row_of(tool_call_row({"city": "Paris", "days": [1, 2]})))
    as_string = encoder(row_of(tool_call_row('{"city": "Paris", "days": [1, 2]}')))  # OpenAI's format
    encoder.finish()
    assert not isinstance(as_string, Skipped) and as_string == as_object
    flat = tool_call_row(None)
    flat["messages"][1]["tool_calls"] = [{"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}]
    assert encoder(row_of(flat)) == as_object  # a call without the "function" wrapper, as the templates allow


@pytest.mark.parametrize("arguments, reason", [
    ('{"city": "Par', "messages[1] tool_calls[0] has arguments that are a string but not JSON (Unterminated string"),
    ('["Paris"]', "messages[1] tool_calls[0] has arguments that are a JSON string of an array, not of an object"),
])
def test_tool_call_arguments_that_are_not_a_json_object_are_left_out(arguments, reason):
    skipped = ChatEncoder(debug_template_tokenizer(), ChatOptions())(row_of(tool_call_row(arguments)))
    assert isinstance(skipped, Skipped) and skipped.reason.startswith(reason), skipped


def test_training_on_your_own_chat_file_names_it_and_the_validation_set_that_is_not_beside_it(tmp_path, capsys):
    """debug_sft.toml with --training.dataset_path of one's own: the data lines name that file (not a cache hash
    alone), and the start says that validation still reads the config's set, elsewhere, and how to change it."""
    from harness.train import main

    mine = tmp_path / "mine" / "chat.jsonl"
    mine.parent.mkdir()
    shutil.copy(REPO / "data" / "debug_chat" / "train.jsonl", mine)
    assert main(["--config", str(REPO / "train_configs" / "debug_sft.toml"), "--training.steps", "1",
                 "--training.dataset_path", str(mine), "--training.local_batch_size", "2",
                 "--metrics.enable_tensorboard", "false", "--checkpoint.export_hf_at_end", "false",
                 "--job.dump_folder", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert f"data: {mine}: " in err and f"data: chat rows of {mine}: " in err
    val = REPO / "data" / "debug_chat" / "val.jsonl"
    said = [line for line in err.splitlines() if "validation: every 100 steps on" in line]
    assert len(said) == 1 and str(val) in said[0] and f"not beside the training data ({mine})" in said[0]
    assert "set validation.dataset_path to your own held-out rows, or validation.enable false" in said[0]
