"""Generate data/debug_corpus/train.jsonl: ~1 MB of English-like documents for the embedded default config.

Documents are composed from templates and word lists with regularities a tiny model learns in minutes: a fixed
"world" (every animal always has the same home, food, colour and sound), arithmetic with correct answers,
numbered recipe steps, letters with a fixed opening and closing, and short stories. Deterministic: the same
seed writes the same bytes. Stdlib only (and the project's argument parser, itself stdlib only).

    python scripts/make_debug_corpus.py [--seed 1234] [--target-bytes 1000000] [--out data/debug_corpus]
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.cli_parser import OneLineParser  # noqa: E402

NAMES = ["Anna", "Ben", "Clara", "David", "Ella", "Finn", "Grace", "Hugo", "Ivy", "Jack", "Lena", "Max",
         "Nora", "Oscar", "Paula", "Quinn", "Rosa", "Sam", "Tara", "Victor", "Wendy", "Yusuf", "Zoe", "Milo"]
# The fixed world: facts about an animal never change between documents, so they can be memorised.
ANIMALS = {
    "cat": ("house", "fish", "grey", "meows"), "dog": ("yard", "bones", "brown", "barks"),
    "cow": ("field", "grass", "black and white", "moos"), "duck": ("pond", "bread", "yellow", "quacks"),
    "owl": ("tree", "mice", "brown", "hoots"), "frog": ("pond", "flies", "green", "croaks"),
    "horse": ("stable", "hay", "white", "neighs"), "sheep": ("meadow", "clover", "white", "bleats"),
    "lion": ("savanna", "meat", "golden", "roars"), "bee": ("hive", "nectar", "yellow", "buzzes"),
    "mouse": ("barn", "cheese", "grey", "squeaks"), "wolf": ("forest", "deer", "grey", "howls"),
    "pig": ("farm", "apples", "pink", "oinks"), "goat": ("hill", "leaves", "white", "bleats"),
    "fox": ("den", "berries", "red", "yips"), "bear": ("cave", "honey", "brown", "growls"),
}
PLACES = ["village", "city", "forest", "valley", "island", "town", "garden", "castle", "harbor", "mountain"]
ADJS = ["small", "old", "quiet", "busy", "bright", "cold", "warm", "green", "tall", "happy", "sleepy", "kind"]
OBJECTS = ["key", "book", "hat", "box", "lamp", "map", "ball", "shell", "coin", "kite", "bell", "ring"]
LANDMARKS = ["river", "bridge", "old tree", "market", "school", "well", "gate", "hill", "lake", "church"]
VERBS = ["read", "sing", "run", "paint", "swim", "cook", "dance", "draw", "walk", "play", "write", "climb"]
TIMES = ["morning", "evening", "afternoon", "day", "night", "weekend"]
FEELINGS = ["happy", "surprised", "curious", "proud", "tired", "glad", "calm", "excited"]
DISHES = {
    "pancakes": ["flour", "milk", "eggs", "butter", "sugar"], "tomato soup": ["tomatoes", "onions", "salt", "water"],
    "fruit salad": ["apples", "bananas", "grapes", "honey"], "bread": ["flour", "water", "yeast", "salt"],
    "rice pudding": ["rice", "milk", "sugar", "cinnamon"], "omelette": ["eggs", "cheese", "butter", "salt"],
}
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven",
                "twelve"]


def story(r: random.Random) -> str:
    name, friend = r.sample(NAMES, 2)
    animal = r.choice(list(ANIMALS))
    home, food, colour, sound = ANIMALS[animal]
    obj, landmark = r.choice(OBJECTS), r.choice(LANDMARKS)
    s = [f"Once upon a time, in a {r.choice(ADJS)} {r.choice(PLACES)}, there lived a {colour} {animal} named {name}.",
         f"{name} lived in the {home} and loved to eat {food}.",
         f"Every {r.choice(TIMES)}, {name} liked to {r.choice(VERBS)} with a friend named {friend}."]
    for _ in range(r.randint(0, 24)):
        s.append(r.choice([
            f"One day, {name} found a {r.choice(ADJS)} {obj} near the {landmark}.",
            f"{name} {sound} loudly, and {friend} came running.",
            f"\"Look at this {obj}!\" said {name}. {friend} was {r.choice(FEELINGS)}.",
            f"They walked to the {r.choice(LANDMARKS)} and talked about the {obj}.",
            f"{friend} wanted to {r.choice(VERBS)}, but {name} wanted to {r.choice(VERBS)}.",
            f"After a while, they were {r.choice(FEELINGS)} and went back to the {home}.",
        ]))
    s.append(f"In the end, {name} and {friend} kept the {obj} in the {home}. The end.")
    return " ".join(s)


def facts(r: random.Random) -> str:
    lines = []
    for animal in r.sample(list(ANIMALS), r.randint(1, 10)):
        home, food, colour, sound = ANIMALS[animal]
        lines.append(f"The {animal} is {colour}. The {animal} lives in the {home}. "
                     f"The {animal} eats {food}. The {animal} {sound}.")
    return "Facts about animals.\n" + "\n".join(lines)


def arithmetic(r: random.Random) -> str:
    lines = []
    for _ in range(r.randint(3, 40)):
        a, b = r.randint(0, 20), r.randint(0, 20)
        if r.random() < 0.5:
            lines.append(f"Question: What is {a} plus {b}? Answer: {a + b}.")
        else:
            a, b = max(a, b), min(a, b)
            lines.append(f"Question: What is {a} minus {b}? Answer: {a - b}.")
    return "\n".join(lines)


def recipe(r: random.Random) -> str:
    dish = r.choice(list(DISHES))
    items = DISHES[dish]
    lines = [f"How to make {dish}.", "You need:"]
    lines += [f"- {NUMBER_WORDS[r.randint(1, 4)]} cups of {item}" for item in items]
    steps = [f"Put the {items[0]} in a bowl.", *[f"Add the {item} and stir." for item in items[1:]],
             f"Cook for {r.choice([5, 10, 15, 20, 30])} minutes.", f"Serve the {dish} warm."]
    lines += [f"Step {i}: {step}" for i, step in enumerate(steps, 1)]
    return "\n".join(lines)


def letter(r: random.Random) -> str:
    sender, to = r.sample(NAMES, 2)
    animal = r.choice(list(ANIMALS))
    body = [f"I hope you are well. Today I went to the {r.choice(LANDMARKS)} with my {animal}.",
            f"We saw a {r.choice(ADJS)} {r.choice(OBJECTS)} and I was {r.choice(FEELINGS)}."]
    for _ in range(r.randint(0, 6)):
        body.append(f"Tomorrow I will {r.choice(VERBS)} in the {r.choice(PLACES)}. "
                    f"My {animal} will stay in the {ANIMALS[animal][0]}.")
    return f"Dear {to},\n" + " ".join(body) + f"\nSee you soon,\n{sender}"


def counting(r: random.Random) -> str:
    start = r.randint(1, 50)
    n = r.randint(20, 150)
    return f"Counting from {start}: " + ", ".join(str(i) for i in range(start, start + n)) + "."


KINDS = [story, story, story, facts, arithmetic, recipe, letter, counting]


def generate(seed: int, target_bytes: int) -> list[str]:
    r = random.Random(seed)
    docs, size = [], 0
    while size < target_bytes:
        doc = r.choice(KINDS)(r)[:2000]  # documents stay within 100..2000 characters
        if len(doc) < 100:
            continue
        docs.append(doc)
        size += len(json.dumps({"text": doc})) + 1
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--target-bytes", type=int, default=1_000_000)
    ap.add_argument("--out", default=str(REPO / "data" / "debug_corpus"))
    args = ap.parse_args(argv)
    if args.target_bytes < 1:
        print(f"error: --target-bytes must be positive, got {args.target_bytes}", file=sys.stderr)
        return 2
    out = Path(args.out)
    docs = generate(args.seed, args.target_bytes)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "train.jsonl", "w", encoding="utf-8", newline="\n") as f:
            for doc in docs:
                f.write(json.dumps({"text": doc}) + "\n")
    except OSError as e:  # an output folder that cannot be made or written
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {len(docs)} documents, {(out / 'train.jsonl').stat().st_size} bytes to {out / 'train.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
