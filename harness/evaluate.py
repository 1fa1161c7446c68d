"""Evaluate a Hugging Face export on a data file: the loss and perplexity over its targets and, for chat data, how
often the greedy reply is the reference reply, token for token.

    python -m harness.evaluate EXPORT --data FILE [--source jsonl|text|parquet] [--content text|chat]
                               [--seq-len N] [--batch-size N] [--max-rows N] [--device cpu|cuda]

EXPORT is a folder this harness exported (or any Qwen3.5-MoE folder of that layout: config.json, safetensors,
tokenizer.json; chat data also needs its chat template). The model is our native one (models/qwen35_moe
`from_pretrained`: fp32 on CPU, the export's bf16 on CUDA), the tokenizer the export's (harness/data/tokenizer.py).

Loss: the rows training's validation reads, through the same code (harness/validation.py's Validator over
harness/data/loader.py): text documents packed into rows of seq_len tokens, or conversations rendered by the export's
chat template packed whole into padded rows, their assistant turns the targets (docs/design.md, "Chat data"). The
token mean of the cross entropy over the targets of the first --max-rows rows (default all; in whole batches of
--batch-size rows, so a last partial batch is left out and the rows read are printed), and its exp, the perplexity.
A conversation longer than a row is left out and counted (training.chat_overlong's "drop"). The data is read (and
its errors named) before the model is loaded.

Exact match (chat): for each conversation in those rows, its last assistant turn. The prompt is the messages before
it rendered with add_generation_prompt, the reference what follows that prompt in the conversation's rendering,
through the turn's end-of-turn token. Greedy decoding reproduces the reference exactly when, at each of its positions,
the model's argmax given the prompt and the reference's earlier tokens is the reference's token: while every earlier
token agreed, greedy decoding had emitted exactly those. So one forward over prompt + reference (teacher-forced)
decides it, where generating would take one forward per token without a KV cache; generation stops at the end-of-turn
token, so tokens past the reference never count. tests/unit/test_evaluate.py checks the verdicts against transformers'
`generate(do_sample=False)`. A conversation whose prompt is not the start of its own rendering (a template that
renders the history otherwise when a generation prompt follows) has no reference to compare: counted, not compared.

The token cache is built in a temporary folder, deleted at the end. Exit codes: 0 done, 2 bad input (one `error:`
line: a missing or unloadable export, a missing or malformed data file, arguments out of range).
"""

from __future__ import annotations

import math
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from .cli_parser import OneLineParser
from .config import JobConfig, Training, Validation
from .data import sources
from .data.chat import ChatOptions, template_messages
from .data.encoders import ChatEncoder
from .data.errors import DataError
from .data_setup import chat_options

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
LOSS_CHUNK_TOKENS = 4096  # training.loss_chunk_tokens' default: the cross entropy never holds all the logits
ARGMAX_CHUNK_TOKENS = 1024  # the exact match's logits, this many positions at a time


class EvaluateError(ValueError):
    """Bad input: the message names the folder, file or argument at fault."""


@dataclass
class Evaluation:
    loss: float  # token mean of the cross entropy over the targets
    targets: int  # target tokens it is the mean over
    rows: int  # rows of seq_len tokens read
    total_rows: int  # rows the data makes
    matches: list[bool] | None = None  # chat: whether greedy decoding is exact, per conversation compared
    not_comparable: int = 0  # chat: conversations without a reference (module docstring)
    dropped: int = 0  # chat: conversations longer than a row, left out (training.chat_overlong's "drop")

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 709 else math.inf  # exp overflows a float beyond 709.78


def export_tokenizer(folder: str | Path):
    """The tokenizer of an export folder, once the folder is checked to be one whose config.json describes the weights
    it holds (read from the files' headers: nothing is allocated); EvaluateError otherwise."""
    from models.qwen35_moe import Qwen35MoeArgs

    from .data.tokenizer import build_tokenizer

    folder = Path(folder)
    if not folder.is_dir():
        raise EvaluateError(f"export folder {folder} does not exist")
    missing = [name for name in ("config.json", "tokenizer.json") if not (folder / name).is_file()]
    if missing:
        raise EvaluateError(f"{folder} is not a Hugging Face export: it has no {' and no '.join(missing)}")
    try:
        args = Qwen35MoeArgs.from_hf_config(folder)
        _check_sizes(folder, args)
        tokenizer = build_tokenizer(str(folder))
    except (OSError, ValueError, KeyError) as e:  # unreadable JSON or safetensors headers, another model's config
        raise EvaluateError(f"cannot load the export {folder}: {str(e).strip().splitlines()[0]}") from None
    if tokenizer.vocab_size > args.vocab_size:
        raise EvaluateError(f"{folder}'s tokenizer has {tokenizer.vocab_size} tokens, more than its model's "
                            f"vocab_size {args.vocab_size}: they are not one export")
    return tokenizer


def _check_sizes(folder: Path, args) -> None:
    """config.json must describe the weights the folder holds: a damaged or foreign config.json must not allocate a
    model of its sizes (nor build one: its parameters are counted from the args alone)."""
    from models.qwen35_moe.hf_checkpoint import HFCheckpointReader
    from models.qwen35_moe.sizes import parameter_counts

    reader = HFCheckpointReader(folder)
    held = sum(math.prod(reader.shape(key)) for key in reader.keys())  # noqa: SIM118 (a reader, not a dict)
    described = parameter_counts(args).total
    if described != held:
        raise ValueError(f"config.json describes {described:,} parameters but the weights hold {held:,} elements")


def load_model(folder: str | Path, device: torch.device):
    """Our native model with the export's weights (checked by `export_tokenizer` first): fp32 on CPU, where bf16
    matmuls are slow; bf16 on CUDA, the dtype training computes in there."""
    from models.qwen35_moe import from_pretrained

    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    try:
        return from_pretrained(folder, dtype=dtype, device=device).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as e:  # a damaged shard, tensor names of another model
        raise EvaluateError(f"cannot load the export {folder}: {str(e).strip().splitlines()[0]}") from None


def evaluate(export: str | Path, data: str, source: str = "jsonl", content: str = "text", seq_len: int = 2048,
             batch_size: int = 1, max_rows: int | None = None, device: str = "cpu", progress: bool = True) -> Evaluation:
    """The loss (and for chat data the exact match) of the export on `data`; see the module docstring."""
    from tqdm import tqdm  # a dependency of transformers

    from .batch import ModelInputs
    from .validation import Validator

    device = _device(device)
    tokenizer = export_tokenizer(export)
    if not Path(data).exists():
        raise EvaluateError(f"data file {data} does not exist")
    if max_rows is not None:
        batch_size = min(batch_size, max_rows)
    # Validation's settings as a run would hold them: training's row shape and content keys, this set, so many steps
    def counted_inputs(batch, mtp=False):  # the Validator calls it once a batch: the progress bar ticks
        bar.update()
        return inputs(batch, mtp=mtp)  # `inputs` and `bar` are bound below, before the Validator calls it

    with tempfile.TemporaryDirectory(prefix="harness-evaluate-") as cache_dir:
        cfg = JobConfig(training=Training(seq_len=seq_len, local_batch_size=batch_size, dataset_content=content,
                                          dataset_cache_dir=cache_dir),
                        validation=Validation(enable=True, dataset_source=source, dataset_path=str(data),
                                              steps=-1 if max_rows is None else max_rows // batch_size))
        # The data first (its cache built, its errors raised), then the model: minutes of loading for a large one
        validator = Validator(cfg, tokenizer, 0, 1, device, counted_inputs)
        model = load_model(export, device)
        inputs = ModelInputs(model, device, LOSS_CHUNK_TOKENS)
        loader = validator.loader
        readable = loader.num_rows if max_rows is None else min(max_rows, loader.num_rows)
        with tqdm(total=readable // batch_size, desc="loss", unit="batch", file=sys.stderr,
                  disable=not progress) as bar:
            result = validator.validate(model)
        evaluation = Evaluation(result["val_loss"], result["val_tokens"], loader.next_row, loader.num_rows)
        if content == "chat":
            evaluation.dropped = loader.layout.dropped
            docs = loader.layout.docs[:loader.layout.row_first[loader.next_row]].tolist()
            evaluation.matches, evaluation.not_comparable = exact_matches(
                model, tokenizer, source, str(data), chat_options(cfg).for_rows_of(seq_len), loader.cache, docs,
                device, progress)
    return evaluation


def _device(name: str) -> torch.device:
    if name == "cuda":
        if not torch.cuda.is_available():
            raise EvaluateError("--device cuda: no CUDA device is available here")
        from models.qwen35_moe.kernels import gated_delta_rule as kernels

        try:
            kernels.require_fla()
        except kernels.FlaKernelsUnavailableError as e:
            raise EvaluateError(str(e)) from None
    return torch.device(name)


def exact_matches(model, tokenizer, source: str, data: str, options: ChatOptions, cache, docs: list[int],
                  device: torch.device, progress: bool = True) -> tuple[list[bool], int]:
    """(whether greedy decoding reproduces its last assistant turn, for each conversation compared in data order; the
    number without a reference) over the token cache's documents `docs` (conversations, ascending)."""
    from tqdm import tqdm

    encoder = ChatEncoder(tokenizer, options)
    matches, not_comparable, wanted = [], 0, set(docs)
    with tqdm(total=len(wanted), desc="exact match", unit="conversation", file=sys.stderr,
              disable=not progress) as bar:
        for doc, row, ids, targets in _conversations(source, data, encoder, options):
            if doc > docs[-1]:
                break
            if doc not in wanted:
                continue
            stop = cache.doc_starts[doc + 1] if doc + 1 < len(cache.doc_starts) else len(cache.tokens)
            if cache.tokens[cache.doc_starts[doc]:stop].tolist() != ids:  # not the conversation the loss read
                raise DataError(f"{data} changed while it was evaluated (its conversation {doc + 1} is not the one "
                                f"the loss read); evaluate it again")
            reply = prompt_and_reference(encoder, row, ids, targets, options.messages_field)
            if reply is None:
                not_comparable += 1
            else:
                matches.append(greedy_reproduces(model, *reply, device))
            bar.update()
    encoder.finish()  # rows whose ids differ from transformers' own tokenization: a DataError, as in training
    return matches, not_comparable


def _conversations(source: str, data: str, encoder: ChatEncoder, options: ChatOptions):
    """(token cache document index, row, ids, target flags) of every conversation of the data, read and encoded as
    the cache build does (harness/data/cached.py, token_cache.py): its documents are the rows the encoder keeps."""
    doc = 0
    files = sources.source_files(Path(data), sources.SOURCE_SUFFIXES[source])
    for unit in sources.source_units(source, files):
        encoder.start_unit()
        rows = sources.read_unit(source, unit, options.messages_field, rows=True, max_row_bytes=options.max_row_bytes)
        for row in rows:
            encoded = row if isinstance(row, sources.Skipped) else encoder(row)
            if isinstance(encoded, sources.Skipped):
                continue
            yield doc, row.value, *encoded
            doc += 1


def prompt_and_reference(encoder: ChatEncoder, row: dict, ids: list[int], targets: list[int],
                         messages_field: str) -> tuple[list[int], list[int]] | None:
    """(prompt ids, reference ids) of a conversation's last assistant turn (the module docstring), or None where its
    generation prompt is not the start of that turn in its rendering (`ids`, `targets`: the encoder's)."""
    messages = template_messages(row[messages_field])
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    try:
        text = encoder.tok.apply_chat_template(messages[:last], tools=row.get("tools"), add_generation_prompt=True,
                                               tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses the history alone (one that wants a user query last, say)
        return None
    prompt = list(encoder.tok(text, add_special_tokens=False)["input_ids"])
    end = max(i for i, flag in enumerate(targets) if flag) + 1  # past the last target: the turn's end-of-turn token
    reference = ids[len(prompt):end]
    if ids[:len(prompt)] != prompt or not reference or not all(targets[len(prompt):end]):
        return None
    return prompt, reference


@torch.no_grad()
def greedy_reproduces(model, prompt: list[int], reference: list[int], device: torch.device) -> bool:
    """Whether greedy decoding after `prompt` emits `reference`: the argmax at each reference position, teacher-forced
    (the module docstring)."""
    ids = torch.tensor([prompt + reference[:-1]], device=device)
    labels = torch.full_like(ids, -100)
    labels[0, len(prompt) - 1:] = torch.tensor(reference, device=device)  # labels: the head skips the full logits
    hidden = model(ids, labels=labels, return_hidden=True).hidden[0, len(prompt) - 1:]
    picks = torch.cat([model.lm_head(hidden[i:i + ARGMAX_CHUNK_TOKENS]).argmax(-1)
                       for i in range(0, len(hidden), ARGMAX_CHUNK_TOKENS)])
    return picks.tolist() == reference


def _positive(name: str, text: str) -> int:
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise EvaluateError(f"{name} {text!r} is not a positive integer")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m harness.evaluate", help_command="python -m harness.evaluate --help",
                           description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="a Hugging Face export folder of this harness (<dump_folder>/hf)")
    parser.add_argument("--data", required=True, help="the data file (or folder of such files) to evaluate on")
    parser.add_argument("--source", default="jsonl", choices=("jsonl", "text", "parquet"),
                        help="how the data is stored, as training.dataset_source (default jsonl)")
    parser.add_argument("--content", default="text", choices=("text", "chat"),
                        help="what a row holds, as training.dataset_content: documents or conversations (default text)")
    parser.add_argument("--seq-len", default="2048", help="tokens per row (default 2048)")
    parser.add_argument("--batch-size", default="1", help="rows per forward (default 1)")
    parser.add_argument("--max-rows", default=None, help="evaluate the first N rows only (default all)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="default cpu")
    args = parser.parse_args(argv)
    try:
        seq_len = _positive("--seq-len", args.seq_len)
        batch_size = _positive("--batch-size", args.batch_size)
        max_rows = None if args.max_rows is None else _positive("--max-rows", args.max_rows)
        result = evaluate(args.export, args.data, args.source, args.content, seq_len, batch_size, max_rows,
                          args.device)
    except (EvaluateError, DataError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"loss {result.loss:.4f}  perplexity {result.perplexity:.4f}  over {result.targets:,} target tokens in "
          f"{result.rows:,} of {result.total_rows:,} rows of {seq_len} tokens")
    if result.dropped:
        print(f"{result.dropped:,} conversations longer than a row left out (a longer --seq-len keeps them)")
    if result.matches is not None:
        exact = sum(result.matches)
        fraction = f"{exact / len(result.matches):.4f}" if result.matches else "n/a"
        unmatched = f"; {result.not_comparable} without a reference" if result.not_comparable else ""
        print(f"exact match {fraction}  ({exact} of {len(result.matches)} conversations{unmatched})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
