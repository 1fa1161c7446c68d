"""Generate data/debug_chat/: a byte tokenizer with a chat template, and a synthetic chat corpus for debug_sft.toml.

tokenizer/  the built-in byte tokenizer (harness/data/tokenizer.py: bytes 0..255, <|bos|> 256, <|eos|> 257) with
            <|im_start|>, <|im_end|>, <think>, </think>, <tool_call>, </tool_call> added as special tokens (258..263),
            written as tokenizer.json + tokenizer_config.json; the config carries a small Qwen-style (ChatML) chat
            template, EOS <|im_end|> (where generation stops) and no BOS, as Qwen's tokenizers have none.
train.jsonl, val.jsonl
            short conversations `{"messages": [...]}` a tiny model learns in a few hundred CPU steps: reverse a
            word, upper-case a word, add two small numbers, a fixed greeting; some with a system prompt, some of
            two exchanges, some with reasoning_content, some calling a tool (`tools` given, the reply read from a
            tool turn).
Deterministic: the same seed writes the same bytes. Needs only the standard library and `tokenizers`.

    python scripts/make_debug_chat.py [--seed 1234] [--train 4000] [--val 200] [--out data/debug_chat]
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.cli_parser import OneLineParser  # noqa: E402
from harness.data.tokenizer import ByteTokenizer  # noqa: E402

SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
# Qwen-style (ChatML), kept small: every turn `<|im_start|>role\n...<|im_end|>\n`; an assistant turn holds its
# reasoning in <think> and its tool calls as JSON in <tool_call>; tool results come back in a user turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- if message.content is string %}{{- message.content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set call = call.function if call.function is defined else call %}"
    "{{- '<tool_call>\\n' + {'name': call.name, 'arguments': call.arguments} | tojson + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WORDS = ("apple bread chair dance eagle flame grape house input jelly kite lemon mango night ocean piano queen "
         "river stone tiger umbra voice water xenon yacht zebra amber blaze cloud drift ember frost glow haze "
         "iris jade koala lunar maple nova orbit pearl quill raven solar tulip unity vivid willow yield zest "
         "cat dog sun moon star tree leaf rock sand wave bird fish frog wolf bear lion owl bee ant fox").split()
SYSTEMS = ["You are a terse assistant.", "Answer in as few words as possible.", "You are a helpful assistant."]
TOOLS = [{"type": "function", "function": {"name": "get_time", "description": "The current time in a city",
                                          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                         "required": ["city"]}}}]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Quito", "Perth"]


def exchange(r: random.Random) -> tuple[str, str, str | None]:
    """(user, assistant, reasoning or None)."""
    kind = r.randrange(4)
    if kind == 0:
        word = r.choice(WORDS)
        return f"reverse this word: {word}", word[::-1], "Read the letters from last to first." if r.random() < 0.2 else None
    if kind == 1:
        word = r.choice(WORDS)
        return f"uppercase: {word}", word.upper(), None
    if kind == 2:
        a, b = r.randrange(10), r.randrange(10)
        return f"what is {a} plus {b}?", str(a + b), f"{a} + {b} = {a + b}." if r.random() < 0.3 else None
    return "say hello", "Hello! How can I help?", None


def conversation(r: random.Random) -> dict:
    messages = [{"role": "system", "content": r.choice(SYSTEMS)}] if r.random() < 0.3 else []
    if r.random() < 0.1:  # a tool call, its result, the answer
        city, time = r.choice(CITIES), f"{r.randrange(24):02d}:{r.choice(['00', '15', '30', '45'])}"
        messages += [{"role": "user", "content": f"what time is it in {city}?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"type": "function", "function": {"name": "get_time", "arguments": {"city": city}}}]},
                     {"role": "tool", "content": time},
                     {"role": "assistant", "content": f"It is {time} in {city}."}]
        return {"messages": messages, "tools": TOOLS}
    for _ in range(2 if r.random() < 0.25 else 1):
        user, reply, reasoning = exchange(r)
        messages.append({"role": "user", "content": user})
        messages.append({"role": "assistant", "content": reply, **({"reasoning_content": reasoning} if reasoning else {})})
    return {"messages": messages}


def write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ByteTokenizer().save_pretrained(tmp)
        tok = Tokenizer.from_file(str(Path(tmp) / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    spec = json.loads(tok.to_str())
    spec["post_processor"] = None  # no BOS: chat rows are the template's tokens, as for Qwen's tokenizers
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|eos|>", "unk_token": None, "split_special_tokens": False,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=4000, help="conversations in train.jsonl")
    ap.add_argument("--val", type=int, default=200, help="conversations in val.jsonl")
    ap.add_argument("--out", default=str(REPO / "data" / "debug_chat"))
    args = ap.parse_args(argv)
    counts = (("train", args.train), ("val", args.val))
    negative = [f"--{flag} must be 0 or more, got {n}" for flag, n in counts if n < 0]
    if negative:
        print(f"error: {'; '.join(negative)}", file=sys.stderr)
        return 2
    out = Path(args.out)
    try:
        write_tokenizer(out / "tokenizer")
        r = random.Random(args.seed)
        for name, count in (("train.jsonl", args.train), ("val.jsonl", args.val)):
            with open(out / name, "w", encoding="utf-8", newline="\n") as f:
                for _ in range(count):
                    f.write(json.dumps(conversation(r)) + "\n")
            print(f"wrote {count} conversations, {(out / name).stat().st_size} bytes to {out / name}")
    except OSError as e:  # an output folder that cannot be made or written
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
