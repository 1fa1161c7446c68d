"""Chat rows: a conversation rendered by the tokenizer's own chat template, and which of its tokens are targets.

A row is a record `{"messages": [{"role": ..., "content": ...}, ...], "tools": [...] (optional)}` (the messages
field is training.chat_messages_field). Roles are system, user, assistant and tool; an assistant message may carry
`reasoning_content` and `tool_calls`; content is a string, null, or a list of {"type": "text", "text": ...} parts.
A tool call is {"function": {"name", "arguments"}} or {"name", "arguments"}; its arguments an object, or a string of
a JSON object (OpenAI's format).

Rendering. transformers' `apply_chat_template` renders the row (tools included) with the template transformers
itself loads from the tokenizer folder (model.tokenizer_path: chat_template.jinja, else tokenizer_config.json's
chat_template), on a PreTrainedTokenizerFast of that folder: tokenizer.json as written, the ids HFTokenizer gives.
The template is given the messages as the official Qwen3.5 template expects them (`template_messages`): text parts
joined into one string, which is what that template renders for them, so a template that renders strings only gives
the same tokens; arguments given as a JSON string parsed into the object that template iterates over (one that
prints them with tojson would otherwise print the string quoted, a second encoding). Arguments that are not the JSON
of an object are a malformed row. The rendered text is then tokenized with offsets, the same call
`apply_chat_template(..., tokenize=True)` makes.

Targets (training.chat_targets = "assistant"): exactly the tokens the template emits for assistant turns, found
from the rendered text's character spans. Each assistant turn runs from the end of its header `<|im_start|>assistant\n`
through its closing `<|im_end|>` inclusive: its content, the `<think>...</think>` block where the template keeps it
(the Qwen3.5 template drops the reasoning of assistant turns before the last user query), its `<tool_call>` blocks
and the end token are targets; headers, system, user and tool-response turns are not. A token is a target when its
first character lies in such a span. "all": every token of the rendered conversation is a target.

Checks, each conversation: the structure above (a row that breaks it, has no assistant turn, spells a ChatML marker
in its text, that the template refuses, or whose rendering holds a lone surrogate, is left out: `Skipped` with the
reason, counted by the cache build and reported in one line naming the first); the rendered text has as many
assistant turns as the row has assistant messages, none of them empty (but its closing `<|im_end|>`) where its
message has content or tool calls: a template that does not render them would train an empty answer. Every
CHECK_EVERY-th conversation of a work unit (the first included) is also rendered and tokenized again by
`apply_chat_template(..., tokenize=True)`, and its ids must be ours: the encoder names every row that differs
(where, and the first differing token) in one DataError once the rank has read its units. Rendering and tokenizing
take about 0.21 ms a conversation of ~200 tokens on one CPU core (the Qwen3.5 template); checking every conversation
adds 85% to that, every 16th 5%. A template whose rendering holds no `<|im_start|>assistant\n` header is not
Qwen-style (ChatML): its spans cannot be found, a DataError. A row larger than ChatOptions.max_row_bytes never gets
here: its reader leaves it out unread (harness/data/sources.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
ASSISTANT_HEADER = f"{TURN_START}assistant\n"
ROLES = ("system", "user", "assistant", "tool")
CHECK_EVERY = 16  # every 16th conversation of a work unit is checked against apply_chat_template(tokenize=True)
TEMPLATE_FILE, TEMPLATES_FOLDER, CONFIG_FILE = "chat_template.jinja", "additional_chat_templates", "tokenizer_config.json"


ROW_BYTES_PER_TOKEN = 16  # the default limit of a row's size: this many bytes a token of a row of seq_len + 1
# How this module turns rows into tokens around the template (template_messages, the rows it leaves out); a cache's
# key holds it, so a change of these rules builds a new cache. 2: text parts joined, arguments parsed, rows without
# a target or with an empty assistant turn left out.
ENCODING_RULES = 2


@dataclass(frozen=True)
class ChatOptions:
    """The training section's chat keys (harness/config/schema.py, Training)."""

    messages_field: str = "messages"
    targets: str = "assistant"  # "assistant" | "all"
    overlong: str = "drop"  # "drop" | "truncate": a conversation longer than seq_len + 1 tokens (chat_packing.py)
    max_row_bytes: int = -1  # a larger row is left out unread (harness/data/sources.py); -1: see row_byte_limit

    def for_rows_of(self, seq_len: int) -> ChatOptions:
        """These options with the row limit resolved for rows of seq_len + 1 tokens."""
        limit = self.max_row_bytes if self.max_row_bytes > 0 else ROW_BYTES_PER_TOKEN * (seq_len + 1)
        return replace(self, max_row_bytes=limit)


# ---------------------------------------------------------------------------------------------------------------
# The template, read without transformers (the cache key and the launch checks need it, not the renderer)


def tokenizer_folder(tokenizer_path: str) -> Path:
    """The folder of a Hugging Face tokenizer given as model.tokenizer_path (the folder, or its tokenizer.json)."""
    path = Path(tokenizer_path)
    return path if path.is_dir() else path.parent


def chat_template_problem(tokenizer_path: str) -> str | None:
    """Why chat rows cannot be rendered with the tokenizer at `tokenizer_path`, or None when they can."""
    if not tokenizer_path:
        return ("training.dataset_content = 'chat' renders conversations with the tokenizer's chat template, and the "
                "built-in byte tokenizer has none: set model.tokenizer_path to a tokenizer folder with a chat "
                "template (data/debug_chat/tokenizer is the byte tokenizer with one)")
    path = Path(tokenizer_path)
    if path.is_file() and path.name != "tokenizer.json":
        return (f"model.tokenizer_path {tokenizer_path!r} names a file; chat data needs the tokenizer folder (its "
                f"tokenizer.json and chat template), as transformers loads it")
    if not chat_template_sources(tokenizer_path):
        folder = tokenizer_folder(tokenizer_path)
        return (f"the tokenizer folder {folder} has no chat template (neither {TEMPLATE_FILE} nor a chat_template in "
                f"{CONFIG_FILE}), which training.dataset_content = 'chat' renders conversations with")
    return None


def chat_template_sources(tokenizer_path: str) -> dict[str, object]:
    """Every chat template of the folder as transformers finds them ({} when there is none): chat_template.jinja,
    additional_chat_templates/*.jinja, tokenizer_config.json's chat_template (a string or named templates)."""
    folder, sources = tokenizer_folder(tokenizer_path), {}
    if (folder / TEMPLATE_FILE).is_file():
        sources[TEMPLATE_FILE] = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if (folder / TEMPLATES_FOLDER).is_dir():
        for file in sorted((folder / TEMPLATES_FOLDER).glob("*.jinja")):
            sources[f"{TEMPLATES_FOLDER}/{file.name}"] = file.read_text(encoding="utf-8")
    if (folder / CONFIG_FILE).is_file():
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        if config.get("chat_template"):
            sources[f"{CONFIG_FILE}:chat_template"] = config["chat_template"]
    return sources


def chat_identity(tokenizer_path: str, options: ChatOptions) -> dict:
    """What a chat cache's key hashes beside the files and the tokenizer: the chat keys (with the resolved row limit),
    the template text, ENCODING_RULES, and the versions of what renders it (transformers' apply_chat_template on
    jinja2): an upgrade builds a new cache. Its
    stream id comes from the tokens themselves, so a run resumes on the new cache where they are unchanged."""
    import jinja2
    import transformers

    templates = json.dumps(chat_template_sources(tokenizer_path), sort_keys=True)
    return {"format": "chat", "messages_field": options.messages_field, "chat_targets": options.targets,
            "max_row_bytes": options.max_row_bytes, "encoding_rules": ENCODING_RULES,
            "chat_template_sha256": hashlib.sha256(templates.encode()).hexdigest(),
            "renderer": {"transformers": transformers.__version__, "jinja2": jinja2.__version__}}


# ---------------------------------------------------------------------------------------------------------------
# Structure


def _json_type(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number"}
    return names.get(type(value), "null")


def _texts(message: dict) -> list[str]:
    content = message.get("content")
    content = "".join(part.get("text") or "" for part in content) if isinstance(content, list) else content
    return [t for t in [content, message.get("reasoning_content")] if isinstance(t, str)]


def _call_function(call: dict) -> dict:
    """What a template reads of a tool call: its "function" object, or the call itself (the templates take both)."""
    return call["function"] if isinstance(call.get("function"), dict) else call


def _arguments_problem(call: dict) -> str | None:
    """Why a tool call's arguments given as a string (OpenAI's format) cannot be given to the template as the
    object it expects, or None."""
    arguments = _call_function(call).get("arguments")
    if not isinstance(arguments, str):
        return None
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError as e:
        return f"arguments that are a string but not JSON ({e.msg} at column {e.pos + 1})"
    except (ValueError, RecursionError):  # too deep, or an integer Python does not read
        return "arguments that are a string of JSON Python does not read"
    if not isinstance(parsed, dict):
        return f"arguments that are a JSON string of {_json_type(parsed)}, not of an object"
    return None


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the template is given them: a content of text parts joined into one string (what the
    official Qwen3.5 template renders for it, so a template that renders strings only gives the same tokens), and
    tool-call arguments given as a JSON string (OpenAI's format) parsed into the object the template expects (the
    Qwen3.5 template iterates over its items; one that prints it with tojson would print the string quoted)."""
    given = []
    for message in messages:
        message = dict(message)
        if isinstance(message.get("content"), list):
            message["content"] = "".join(part["text"] for part in message["content"])
        if message.get("tool_calls"):
            message["tool_calls"] = [_with_parsed_arguments(call) for call in message["tool_calls"]]
        given.append(message)
    return given


def _with_parsed_arguments(call: dict) -> dict:
    if isinstance(call.get("function"), dict):
        function = call["function"]
        if isinstance(function.get("arguments"), str):
            return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}
    elif isinstance(call.get("arguments"), str):
        return {**call, "arguments": json.loads(call["arguments"])}
    return call


def has_content(message: dict) -> bool:
    return bool(isinstance(message.get("content"), str) and message["content"].strip() or message.get("tool_calls"))


def conversation_problem(row: dict, messages_field: str) -> str | None:
    """Why `row` is not a conversation this harness trains on, or None."""
    messages = row.get(messages_field)
    if not isinstance(messages, list):
        return f"{messages_field!r} is {_json_type(messages)}, not a list of messages"
    if not messages:
        return f"{messages_field!r} holds no messages"
    for i, message in enumerate(messages):
        where = f"{messages_field}[{i}]"
        if not isinstance(message, dict):
            return f"{where} is {_json_type(message)}, not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"{where} has role {role!r}; the roles are {', '.join(ROLES)}"
        content = message.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                return f"{where} has a content part that is not {{\"type\": \"text\", \"text\": ...}} (text only)"
        elif content is not None and not isinstance(content, str):
            return f"{where} has content that is {_json_type(content)}, not a string"
        if message.get("reasoning_content") is not None and not isinstance(message["reasoning_content"], str):
            return f"{where} has reasoning_content that is {_json_type(message['reasoning_content'])}, not a string"
        calls = message.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            return f"{where} has tool_calls that are not a list of objects"
        for j, call in enumerate(calls or []):
            if problem := _arguments_problem(call):
                return f"{where} tool_calls[{j}] has {problem}"
        for marker in (TURN_START, TURN_END):
            if any(marker in text for text in _texts(message)):  # it would open or close a turn of its own
                return f"{where} spells the ChatML marker {marker} in its text"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    tools = row.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "'tools' is not a list of objects"
    return None


# ---------------------------------------------------------------------------------------------------------------
# Spans and mask


def assistant_spans(text: str) -> list[tuple[int, int]]:
    """Character spans [start, stop) of the assistant turns of a rendered conversation: from the end of each
    `<|im_start|>assistant\\n` header through its closing `<|im_end|>` inclusive (an unclosed turn runs to the
    end)."""
    spans, pos = [], 0
    while (header := text.find(ASSISTANT_HEADER, pos)) >= 0:
        start = header + len(ASSISTANT_HEADER)
        end = text.find(TURN_END, start)
        stop = len(text) if end < 0 else end + len(TURN_END)
        spans.append((start, stop))
        pos = stop
    return spans


def target_mask(offsets, spans: list[tuple[int, int]]) -> list[int]:
    """1 for each token whose first character (its offset's start) lies in a span, else 0."""
    if not spans:
        return [0] * len(offsets)
    starts = np.fromiter((start for start, _ in offsets), dtype=np.int64, count=len(offsets))
    span_starts = np.array([s for s, _ in spans], dtype=np.int64)
    span_stops = np.array([s for _, s in spans], dtype=np.int64)
    i = np.searchsorted(span_starts, starts, side="right") - 1  # the last span starting at or before the token
    inside = (i >= 0) & (starts < span_stops[np.maximum(i, 0)])
    return inside.astype(np.uint8).tolist()


# ---------------------------------------------------------------------------------------------------------------
