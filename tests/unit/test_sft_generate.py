"""Chat fine-tuning end to end on CPU, as a user ships it: train_configs/debug_sft.toml trains the debug model on the
debug chat corpus, and transformers, from the export alone (weights, tokenizer, chat template), renders a new
conversation with `apply_chat_template(..., add_generation_prompt=True)` and `generate`s the reply the corpus taught,
closed by the template's end token. Then a LoRA fine-tune of that export learns a reply the corpus never had: its
merged export and its PEFT adapter on the base give that reply the same likelihood, far above the base's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from harness.train import main
from tests.hf_reference import force_transformers_torch_kernels
from tests.runs import losses, write_rows

REPO = Path(__file__).resolve().parents[2]
GREETING = "Hello! How can I help?"  # the corpus's reply to "say hello" (scripts/make_debug_chat.py)
FAREWELL = [{"role": "user", "content": "say goodbye"}, {"role": "assistant", "content": "Goodbye! See you soon."}]
QUIET = ["--validation.enable", "false", "--metrics.enable_tensorboard", "false"]


@pytest.fixture(scope="module")
def chat_export(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft") / "out"
    # 60 steps of 256-token rows learn the fixed greeting (300 of 512, the config's, also the word tasks' format)
    assert main(["--config", str(REPO / "train_configs" / "debug_sft.toml"), "--training.steps", "60", *QUIET,
                 "--training.seq_len", "256", "--job.dump_folder", str(out)]) == 0
    return out / "hf"


def test_the_export_of_a_chat_fine_tune_answers_as_the_data_taught(chat_export, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_export)
    force_transformers_torch_kernels(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(chat_export).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "say hello"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")  # the template's own prompt
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    reply = generated[0, prompt["input_ids"].shape[1]:]
    # The reply, then the end-of-turn token, which the template names as EOS: generation stops there.
    assert tokenizer.decode(reply) == GREETING + "<|im_end|>"
    assert reply[-1].item() == tokenizer.convert_tokens_to_ids("<|im_end|>") == model.generation_config.eos_token_id


def reply_nll(model, tokenizer) -> float:
    """The mean negative log-likelihood of FAREWELL's reply tokens (and <|im_end|>) after its prompt, both rendered by
    the chat template."""
    prompt = tokenizer.apply_chat_template(FAREWELL[:1], add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"]
    whole = tokenizer(tokenizer.apply_chat_template(FAREWELL, tokenize=False).rstrip("\n"),
                      return_tensors="pt")["input_ids"]
    assert torch.equal(whole[:, :prompt.shape[1]], prompt)
    with torch.no_grad():
        logits = model(whole).logits[0, :-1].float()
    targets = whole[0, 1:]
    nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return nll[prompt.shape[1] - 1:].mean().item()


def test_a_lora_fine_tune_of_the_export_learns_a_new_reply_merged_and_as_a_peft_adapter(chat_export, tmp_path,
                                                                                       monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rows = write_rows(tmp_path / "farewell.jsonl", [{"messages": FAREWELL}] * 200)
    out = tmp_path / "lora"
    assert main(["--config", str(REPO / "train_configs" / "debug_sft.toml"), "--training.steps", "30", *QUIET,
                 "--training.seq_len", "256", "--training.dataset_path", str(rows),
                 "--checkpoint.initial_load_hf", str(chat_export),
                 "--lora.enable", "true", "--optimizer.lr", "1e-2", "--job.dump_folder", str(out)]) == 0
    curve = losses(out)
    assert curve[1] > 3.0 and curve[30] < 0.4 * curve[1]  # measured 4.43 -> 1.25

    force_transformers_torch_kernels(monkeypatch)
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    base = AutoModelForCausalLM.from_pretrained(chat_export).eval()
    before = reply_nll(base, tokenizer)
    merged = reply_nll(AutoModelForCausalLM.from_pretrained(out / "hf").eval(), tokenizer)
    adapted = reply_nll(PeftModel.from_pretrained(base, out / "hf-adapter").eval(), tokenizer)
    assert merged < 0.4 * before  # the reply learnt (measured 4.43 -> 1.25 nats a token)
    assert adapted == pytest.approx(merged, rel=1e-4)  # fp32 export: the same model two ways
