"""Write multi-turn chat conversations as long as users' (1-4k tokens each by default), sized with a given tokenizer.

The debug chat corpus (make_debug_chat.py) holds conversations under 100 tokens, so a packed 4096-token row holds
dozens of them and attention and Gated DeltaNet see only short documents. These are what a fine-tune on real
assistant data packs instead: each conversation has 2-6 exchanges whose user turns carry a passage of words and a
task on it (reverse, sort, repeat, count), the assistant's reply the task's answer, some with a system prompt; its
length in tokens (its turns' contents, counted with `--tokenizer`, plus a few tokens of template per turn) is drawn
uniformly from [--min-tokens, --max-tokens]. Deterministic: the same seed and tokenizer write the same bytes.

    python scripts/make_long_chat.py --tokenizer /dev/shm/base --train 2000 --out /dev/shm/long-chat
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.cli_parser import OneLineParser  # noqa: E402
from scripts.make_debug_chat import SYSTEMS, WORDS  # noqa: E402

TEMPLATE_TOKENS = 5  # <|im_start|>, the role, its newline, <|im_end|>, the newline after it
TASKS = {
    "reverse the order of these words": lambda words: " ".join(reversed(words)),
    "sort these words alphabetically": lambda words: " ".join(sorted(words)),
    "repeat these words": lambda words: " ".join(words),
    "count how often each word occurs": lambda words: ", ".join(f"{w}: {words.count(w)}" for w in sorted(set(words))),
}


def conversation(r: random.Random, target: int, count_tokens) -> tuple[dict, int]:
    """One conversation of about `target` tokens (at least one exchange) and its token count."""
    messages, used = [], 0
    if r.random() < 0.3:
        messages.append({"role": "system", "content": r.choice(SYSTEMS)})
        used += count_tokens(messages[-1]["content"]) + TEMPLATE_TOKENS
    exchanges = r.randint(2, 6)
    for turn in range(exchanges):
        budget = (target - used) // (exchanges - turn)  # tokens left for this exchange
        task = r.choice(sorted(TASKS))
        words, fitted, step = [r.choice(WORDS)], None, 1  # grown while the exchange stays within its budget
        while True:
            user, reply = f"{task}: {' '.join(words)}", TASKS[task](words)
            cost = count_tokens(user) + count_tokens(reply) + 2 * TEMPLATE_TOKENS
            if fitted is None or cost <= budget:
                fitted, step = (words, user, reply, cost), max((budget - cost) // 8, 1)
            elif step == 1:
                break
            else:
                step //= 2  # overshot: add fewer words to the last that fitted
            words = fitted[0] + [r.choice(WORDS) for _ in range(step)]
        _, user, reply, cost = fitted
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
        used += cost
    return {"messages": messages}, used


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", required=True, help="folder with tokenizer.json (the base model's)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--val", type=int, default=20)
    ap.add_argument("--min-tokens", type=int, default=1000)
    ap.add_argument("--max-tokens", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    problems = [f"--{n} must be 0 or more, got {v}" for n, v in (("train", args.train), ("val", args.val)) if v < 0]
    if not 0 < args.min_tokens <= args.max_tokens:
        problems.append(f"--min-tokens {args.min_tokens} and --max-tokens {args.max_tokens}: need 0 < min <= max")
    tokenizer_file = Path(args.tokenizer) / "tokenizer.json"
    if not tokenizer_file.is_file():
        problems.append(f"no tokenizer.json in {args.tokenizer}")
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_file))

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False).ids)

    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        r = random.Random(args.seed)
        for name, count in (("train.jsonl", args.train), ("val.jsonl", args.val)):
            lengths = []
            with open(out / name, "w", encoding="utf-8", newline="\n") as f:
                for _ in range(count):
                    record, tokens = conversation(r, r.randint(args.min_tokens, args.max_tokens), count_tokens)
                    f.write(json.dumps(record) + "\n")
                    lengths.append(tokens)
            lengths.sort()
            summary = (f"tokens min {lengths[0]}, median {lengths[len(lengths) // 2]}, max {lengths[-1]}"
                       if lengths else "empty")
            print(f"wrote {count} conversations ({summary}) to {out / name}")
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
