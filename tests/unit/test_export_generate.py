"""The HF export generates on CPU in the project's own environment, with our weights: the install keeps FLA
out of CPU environments, our code never imports it there, and the exported tokenizer feeds `generate`."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from harness.checkpoint.hf_weights import export_hf
from harness.data.tokenizer import ByteTokenizer
from models.qwen35_moe import from_pretrained, get_flavor
from tests.builders import initialized_model
from tests.hf_reference import force_transformers_torch_kernels

REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 8
# The native model and transformers' (fp32, both) agree to ~1e-5 in logits (test_hf_parity.py); a step whose
# best two logits are closer than this could go either way, and would make the comparison a coin toss.
MIN_ARGMAX_MARGIN = 1e-3


def test_fla_is_a_gpu_extra_not_a_dependency():
    """Wherever `fla` imports, transformers binds FLA's Triton kernels into Qwen3.5 models, and `generate` on
    CPU fails ("0 active drivers"): a plain or test install must not bring it."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("fla")]
    assert project["optional-dependencies"]["gpu"] == ["fla-core>=0.6,<0.7"]
    assert not [d for d in project["optional-dependencies"]["test"] if d.startswith("fla")]


def test_cpu_training_step_never_imports_fla():
    """Our CUDA paths import FLA lazily; on CPU nothing may even look for it (a fresh interpreter records
    every import of `fla` or a submodule, found or not)."""
    script = """
import sys
class Recorder:
    seen = []
    def find_spec(self, name, path=None, target=None):
        if name == "fla" or name.startswith("fla."):
            self.seen.append(name)
        return None
recorder = Recorder()
sys.meta_path.insert(0, recorder)

import torch
import harness.train, harness.trainer, harness.model_setup, parallel.parallelize
from models.qwen35_moe import get_flavor
from tests.builders import initialized_model
from tests.hf_reference import force_transformers_torch_kernels

model = initialized_model(get_flavor("debugmodel"))
ids = torch.randint(0, 258, (2, 40))
positions = torch.cat([torch.arange(15), torch.arange(25)]).expand(2, -1)  # two documents per row: varlen paths
out = model(ids, positions)
(out.logits.float().logsumexp(-1).mean() + out.aux_loss).backward()
assert recorder.seen == [], recorder.seen
"""
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture
def cpu_transformers(monkeypatch):
    """Nothing to do on a CPU install (CI): without FLA, transformers runs its own torch kernels. With the GPU
    extra installed, transformers binds FLA's Triton kernels, which take CUDA tensors only, and these tests
    generate on CPU: there they point transformers back at its torch kernels."""
    if importlib.util.find_spec("fla") is not None:
        force_transformers_torch_kernels(monkeypatch)


def _greedy_continuation(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Argmax decoding with full recomputation at every step: no cache, nothing shared with transformers."""
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(ids).logits[0, -1].float()
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] > MIN_ARGMAX_MARGIN, f"near tie at length {ids.shape[1]}: {top2.tolist()}"
        ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids


def _assert_generates(folder: Path, compare_with_native: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    inputs = tokenizer("Hello", return_tensors="pt")
    assert inputs["input_ids"].tolist() == [[ByteTokenizer.bos_id, *ByteTokenizer().encode("Hello")]]
    out = hf.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out.shape == (1, inputs["input_ids"].shape[1] + NEW_TOKENS)
    assert out.device.type == "cpu"
    if compare_with_native:
        expected = _greedy_continuation(from_pretrained(folder), inputs["input_ids"], NEW_TOKENS)
        assert out.tolist() == expected.tolist()


def test_export_generates_on_cpu_with_our_weights(tmp_path, cpu_transformers):
    """AutoTokenizer + AutoModelForCausalLM on the export generate on CPU (on a CPU install, with no workaround),
    and greedy decoding (transformers' cached recurrent path) gives the argmax continuation of our native model."""
    args = get_flavor("debugmodel")
    model = initialized_model(args, seed=3)
    export_hf(model, args, str(tmp_path / "hf"), torch.float32, tokenizer=ByteTokenizer())
    _assert_generates(tmp_path / "hf", compare_with_native=True)


def test_trainer_export_at_end_loads_tokenizer_and_generates(tmp_path, cpu_transformers):
    """The trainer's export (the debug config's default) is a folder a user can generate from as it is."""
    from harness.train import main

    config = str(REPO / "train_configs" / "debug_model.toml")
    corpus = str(REPO / "data" / "debug_corpus" / "train.jsonl")
    assert main(["--config", config, "--training.steps", "2", "--training.seq_len", "64",
                 "--training.local_batch_size", "4", "--metrics.enable_tensorboard", "false",
                 "--training.dataset_path", corpus, "--job.dump_folder", str(tmp_path / "out"),
                 "--checkpoint.export_hf_at_end", "true"]) == 0
    _assert_generates(tmp_path / "out" / "hf", compare_with_native=False)
