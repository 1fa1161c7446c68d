"""Chat fine-tuning end to end on CPU, as a user ships it: train_configs/debug_sft.toml trains the debug model on the
debug chat corpus, and transformers, from the export alone (weights, tokenizer, chat template), renders a new
conversation with `apply_chat_template(..., add_generation_prompt=True)` and `generate`s the reply the corpus taught,
closed by the template's end token."""

from __future__ import annotations

from pathlib import Path

import torch

from harness.train import main
from tests.hf_reference import force_transformers_torch_kernels

REPO = Path(__file__).resolve().parents[2]
GREETING = "Hello! How can I help?"  # the corpus's reply to "say hello" (scripts/make_debug_chat.py)


def test_the_export_of_a_chat_fine_tune_answers_as_the_data_taught(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "out"
    # 60 steps learn the fixed greeting (300, the config's, also the format of the word tasks)
    assert main(["--config", str(REPO / "train_configs" / "debug_sft.toml"), "--training.steps", "60",
                 "--validation.enable", "false", "--metrics.enable_tensorboard", "false",
                 "--job.dump_folder", str(out)]) == 0
    tokenizer = AutoTokenizer.from_pretrained(out / "hf")
    force_transformers_torch_kernels(monkeypatch)
    model = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "say hello"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    assert tokenizer.decode(prompt["input_ids"][0]).endswith("<|im_start|>assistant\n")  # the template's own prompt
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=40, do_sample=False)
    reply = generated[0, prompt["input_ids"].shape[1]:]
    # The reply, then the end-of-turn token, which the template names as EOS: generation stops there.
    assert tokenizer.decode(reply) == GREETING + "<|im_end|>"
    assert reply[-1].item() == tokenizer.convert_tokens_to_ids("<|im_end|>") == model.generation_config.eos_token_id
