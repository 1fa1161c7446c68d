"""`python -m harness.evaluate` against transformers on the same export: the loss over the same targets, computed by
hand from AutoModelForCausalLM's logits with rows, documents and targets found independently of the harness (text
documents packed into rows, chat conversations and their assistant turns), and the exact-match verdicts against
transformers' own `generate(do_sample=False)`; bad input exits 2 with one `error:` line."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from harness.checkpoint.hf_weights import export_hf
from harness.data.tokenizer import HFTokenizer
from harness.evaluate import evaluate, main
from models.qwen35_moe import get_flavor
from tests.builders import initialized_model
from tests.hf_reference import force_transformers_torch_kernels
from tests.runs import write_rows

REPO = Path(__file__).resolve().parents[2]
CHAT_TOKENIZER = REPO / "data" / "debug_chat" / "tokenizer"  # byte-level, ChatML specials, a chat template
HELLO = [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "Hello!"}]
COUNT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count to three"},
         {"role": "assistant", "content": "1 2 3"}, {"role": "user", "content": "and back"},
         {"role": "assistant", "content": "3 2 1"}]
TAUGHT = [HELLO, COUNT]
# The taught ones, the taught prompt with another reply, an untaught one: greedy decoding reproduces some, not others
CONVERSATIONS = [HELLO, COUNT, [HELLO[0], {"role": "assistant", "content": "Goodbye."}],
                 [{"role": "user", "content": "reverse: stone"}, {"role": "assistant", "content": "enots"}]]
DOCUMENTS = ["The quick brown fox jumps over the lazy dog.", "Pack my box with five dozen liquor jugs.",
             "How vexingly quick daft zebras jump!", "Sphinx of black quartz, judge my vow.", "Hi.",
             "The five boxing wizards jump quickly, and a long document runs past the end of its row."]
# Our model and transformers', both fp32 on the same weights, agree to fp32 rounding (test_hf_parity.py): the losses
# here (means over 34 and 219 targets) measured 2e-8 apart, relative. 1e-6 (8 fp32 ulps) leaves room for another
# summation order; one token, target or document boundary taken otherwise moves a mean of cross entropies of 1 to 6
# nats by 1e-3 or more.
LOSS_RTOL = 1e-6


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The debug model fitted to TAUGHT (every token, 40 AdamW steps at 3e-3: greedy decoding gives both replies
    from 30 steps on, measured), exported in fp32 with the debug chat tokenizer and its template."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(str(CHAT_TOKENIZER))
    args = get_flavor("debugmodel")
    model = initialized_model(args, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rows = [torch.tensor([_rendered(tok, messages)]) for messages in TAUGHT]
    for _ in range(40):
        optimizer.zero_grad()
        for ids in rows:
            labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
            (model(ids, labels=labels).ce_sum / (ids.shape[1] - 1)).backward()
        optimizer.step()
    folder = tmp_path_factory.mktemp("evaluate") / "hf"
    export_hf(model, args, str(folder), torch.float32, tokenizer=HFTokenizer(str(CHAT_TOKENIZER)))
    return folder


@pytest.fixture
def reference(export, monkeypatch):
    """transformers' model and tokenizer of the export (its torch kernels on CPU even where FLA is installed)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    force_transformers_torch_kernels(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    return model, PreTrainedTokenizerFast.from_pretrained(str(export))


def _rendered(tok, messages: list[dict], **kwargs) -> list[int]:
    return list(tok.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"])


@torch.no_grad()
def _ce(model, inputs: list[int], targets: list[int | None]) -> tuple[float, int]:
    """(summed cross entropy, count) of transformers' logits on `inputs`, one document, at each position whose
    target is not None."""
    logits = model(torch.tensor([inputs])).logits[0].double()
    keep = [i for i, t in enumerate(targets) if t is not None]
    return F.cross_entropy(logits[keep], torch.tensor([targets[i] for i in keep], dtype=torch.long),
                           reduction="sum").item(), len(keep)


def _text_rows_reference(model, tok, seq_len: int) -> list[tuple[float, int]]:
    """(summed cross entropy, targets) per row of DOCUMENTS packed as training does: each document's tokens and EOS
    one stream, row k its window [k L, k L + L]; a document starting inside a row (or the row itself) is run on its
    own, no label predicts a document's first token."""
    stream, starts = [], set()
    for doc in DOCUMENTS:
        starts.add(len(stream))
        stream += tok(doc, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    rows = []
    for k in range((len(stream) - 1) // seq_len):
        lo = k * seq_len
        cuts = sorted({0, *(s - lo for s in starts if lo < s < lo + seq_len)}) + [seq_len]
        total, count = 0.0, 0
        for a, b in itertools.pairwise(cuts):
            targets = [None if lo + i + 1 in starts else stream[lo + i + 1] for i in range(a, b)]
            ce, n = _ce(model, stream[lo + a: lo + b], targets)
            total, count = total + ce, count + n
        rows.append((total, count))
    return rows


def test_text_loss_is_transformers_cross_entropy_over_the_packed_rows(export, reference, tmp_path):
    model, tok = reference
    data = write_rows(tmp_path / "docs.jsonl", [{"text": d} for d in DOCUMENTS])
    rows = _text_rows_reference(model, tok, seq_len=32)
    assert len(rows) >= 4  # several rows, documents crossing them

    whole = evaluate(export, str(data), "jsonl", "text", seq_len=32, batch_size=1, progress=False)
    assert (whole.rows, whole.total_rows, whole.targets) == (len(rows), len(rows), sum(n for _, n in rows))
    assert whole.loss == pytest.approx(sum(ce for ce, _ in rows) / whole.targets, rel=LOSS_RTOL)
    assert whole.matches is None

    # --max-rows 3 in batches of 2: the first whole batch, rows 0 and 1
    first = evaluate(export, str(data), "jsonl", "text", seq_len=32, batch_size=2, max_rows=3, progress=False)
    assert first.rows == 2
    assert first.loss == pytest.approx(sum(ce for ce, _ in rows[:2]) / sum(n for _, n in rows[:2]), rel=LOSS_RTOL)


def _assistant_targets(tok, ids: list[int]) -> list[int | None]:
    """Per position i, the token i + 1 where it belongs to an assistant turn (after `<|im_start|>assistant\\n`,
    through its `<|im_end|>`), else None: found on the token ids, not on the rendered text as the harness does."""
    header = tok.convert_tokens_to_ids(["<|im_start|>"]) + tok("assistant\n", add_special_tokens=False)["input_ids"]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    inside, flags = False, []
    for i, token in enumerate(ids):
        flags.append(inside)
        if ids[max(i - len(header) + 1, 0): i + 1] == header:
            inside = True
        elif token == end:
            inside = False
    return [ids[i + 1] if flags[i + 1] else None for i in range(len(ids) - 1)]


def _greedy_is_exact(model, tok, messages: list[dict]) -> bool:
    """transformers' generate(do_sample=False) after the prompt of the last assistant turn, against that turn's
    tokens in the whole conversation's rendering through its `<|im_end|>`."""
    prompt = _rendered(tok, messages[:-1], add_generation_prompt=True)
    whole = _rendered(tok, messages)
    assert whole[:len(prompt)] == prompt
    end = whole.index(tok.convert_tokens_to_ids("<|im_end|>"), len(prompt))
    reference = whole[len(prompt): end + 1]
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=len(reference) + 4, do_sample=False)
    return out[0, len(prompt):].tolist()[:len(reference)] == reference


def test_chat_loss_and_exact_match_are_transformers(export, reference, tmp_path):
    model, tok = reference
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    result = evaluate(export, str(data), "jsonl", "chat", seq_len=128, batch_size=1, progress=False)

    sums = [_ce(model, ids[:-1], _assistant_targets(tok, ids)) for ids in (_rendered(tok, m) for m in CONVERSATIONS)]
    assert result.targets == sum(n for _, n in sums)
    assert result.loss == pytest.approx(sum(ce for ce, _ in sums) / result.targets, rel=LOSS_RTOL)

    verdicts = [_greedy_is_exact(model, tok, m) for m in CONVERSATIONS]
    assert result.matches == verdicts
    assert verdicts[:2] == [True, True] and False in verdicts  # taught replies match, others do not
    assert (result.not_comparable, result.dropped) == (0, 0)


def test_the_command_prints_loss_perplexity_and_exact_match(export, tmp_path, capsys):
    data = write_rows(tmp_path / "chat.jsonl", [{"messages": m} for m in CONVERSATIONS])
    assert main([str(export), "--data", str(data), "--content", "chat", "--seq-len", "128", "--batch-size", "2"]) == 0
    out, err = capsys.readouterr()
    result = evaluate(export, str(data), "jsonl", "chat", seq_len=128, batch_size=2, progress=False)
    assert out.splitlines()[0].startswith(f"loss {result.loss:.4f}  perplexity {result.perplexity:.4f}  over "
                                          f"{result.targets:,} target tokens in {result.rows} of")
    assert out.splitlines()[1] == f"exact match {sum(result.matches) / 4:.4f}  ({sum(result.matches)} of 4 conversations)"
    assert "exact match: 100%" in err  # the progress bars


def _foreign_config(export: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "resized"
    shutil.copytree(export, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 4096}))
    return folder


@pytest.mark.parametrize("case, message", [
    ("missing export", "does not exist"),
    ("not an export", "is not a Hugging Face export: it has no config.json"),
    ("config of other sizes", "but the weights hold"),
    ("missing data", "data file"),
    ("not JSON", "bad.jsonl:2: not a JSON object"),
    ("chat from text", "not from text files"),
    ("seq len 0", "--seq-len '0' is not a positive integer"),
    ("unknown source", "invalid choice"),
])
def test_bad_input_is_one_error_line_and_exit_2(export, tmp_path, capsys, case, message):
    data = write_rows(tmp_path / "docs.jsonl", [{"text": d} for d in DOCUMENTS])
    argv = {
        "missing export": [str(tmp_path / "nothing"), "--data", str(data)],
        "not an export": [str(tmp_path), "--data", str(data)],
        "config of other sizes": [str(_foreign_config(export, tmp_path)), "--data", str(data)],
        "missing data": [str(export), "--data", str(tmp_path / "none.jsonl")],
        "not JSON": [str(export), "--data", str(tmp_path / "bad.jsonl")],
        "chat from text": [str(export), "--data", str(data), "--source", "text", "--content", "chat"],
        "seq len 0": [str(export), "--data", str(data), "--seq-len", "0"],
        "unknown source": [str(export), "--data", str(data), "--source", "hf"],
    }[case]
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": cut\n')
    try:
        code = main(argv)
    except SystemExit as e:  # the argument parser's refusal
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and message in err, err
