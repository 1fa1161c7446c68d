"""The two exports of a LoRA model (docs/design.md, "Hugging Face export"): the merged folder, which transformers loads
as the LoRA model (every adapted weight W + s * B A, the layout of a plain export), and the PEFT adapter folder, which
PEFT loads onto transformers' model of the base as the same model (routed experts and router included, through PEFT's
target_parameters; the MTP layer, which transformers has not, left out). The offline converter writes both from a
LoRA checkpoint (adapters only), byte for byte as the end of the run does, and refuses another base."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from harness.checkpoint.hf_weights import ExportUnit, export_hf, load_hf_weights, write_hf_meta
from harness.checkpoint.integrity import ALGORITHM, digest_files, rank_0_files, rank_data_files, write_complete
from harness.checkpoint.plain_state import to_bytes
from harness.convert import main as convert_main
from harness.lora.base import base_digest
from harness.lora.peft import CONFIG_NAME, WEIGHTS_NAME, peft_config, peft_layout
from harness.lora.run import LoraRun
from models.qwen35_moe import Qwen35MoeModel, from_pretrained, get_flavor
from models.qwen35_moe.lora import adapted_modules, add_adapters
from models.qwen35_moe.lora_targets import TARGETS, LoraArgs, is_adapter_key
from tests.hf_reference import force_transformers_torch_kernels
from tests.unit.test_convert_output_folder import files_under, one_error
from tests.unit.test_export_mtp_layout import headers
from tests.unit.test_lora import formula_weights

ARGS = get_flavor("debugmodel_mtp")
# every target, the MTP layer's too; dropout, which PEFT's ParamWrapper (experts, router) cannot state
LORA = LoraArgs(rank=4, alpha=8.0, dropout=0.1, targets=TARGETS, mtp=True)
# the converter's other tests: a few modules (each adapter is one DCP read in the converter)
FEW = LoraArgs(rank=4, alpha=8.0, targets=("q_proj", "experts"))
# fp32 end to end on transformers' side: its reductions are ordered unlike ours (test_hf_parity.py's bound)
LOGITS_ATOL = 1e-4
SMALL_SHARDS = 2**16  # 64 KiB: the merged export in several shards, as test_export_mtp_layout.py's


def lora_model(seed: int = 0, dtype: torch.dtype = torch.float64, lora: LoraArgs = LORA) -> Qwen35MoeModel:
    """The debug model with adapters on every target (`lora`), its base weights and its B moved away from their init
    (B zero would make every adapter a no-op), in eval mode (no dropout)."""
    with torch.device("meta"):
        model = Qwen35MoeModel(ARGS)
        add_adapters(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    randomise(model.to(dtype), seed, base=True)
    return model.eval()


def randomise(model: Qwen35MoeModel, seed: int, base: bool) -> None:
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
            elif base and not is_adapter_key(name):
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.02)


def base_of(model: Qwen35MoeModel) -> Qwen35MoeModel:
    """The plain model holding `model`'s base weights."""
    base = Qwen35MoeModel(ARGS).to(next(model.parameters()).dtype)
    base.load_state_dict({k: v for k, v in model.state_dict().items() if not is_adapter_key(k)})
    return base


def lora_exports(model, lora: LoraArgs, folder: Path, base: Path | None, dtype: torch.dtype,
                 **options) -> list[str]:
    """A LoRA model's two exports as the end of a run writes them: merged at `folder`, the PEFT adapter at
    `<folder>-adapter`, one unit (harness/lora/run.py)."""
    with ExportUnit() as unit:
        return LoraRun(lora, "" if base is None else str(base), 0).export(model, ARGS, folder, dtype, None, unit,
                                                                          **options)


def ids(seed: int = 5) -> torch.Tensor:
    return torch.randint(0, ARGS.vocab_size, (2, 40), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A float64 LoRA model, its base's plain export, its merged export and its PEFT adapter (all fp32)."""
    folder = tmp_path_factory.mktemp("lora_exports")
    model = lora_model()
    export_hf(base_of(model), ARGS, str(folder / "base"), torch.float32)
    notes = lora_exports(model, LORA, folder / "merged", folder / "base", torch.float32)
    return SimpleNamespace(model=model, folder=folder, notes=notes)


def test_merged_export_is_the_plain_layout_with_each_adapted_weight_merged(exported):
    """Names, dtypes and shapes of a plain export; each tensor W + s * B A (the plain formula, float64) rounded to
    fp32: the merge sums in float64 here, in its own order (addmm), so a value may round to the neighbouring fp32 (one
    ulp, 2**-23 relative: 1.2e-7)."""
    folder = exported.folder
    assert headers(folder / "merged") == headers(folder / "base")
    merged = from_pretrained(folder / "merged").state_dict()
    expected = formula_weights(exported.model)
    assert len(expected) == 35  # 2 layers and the MTP layer: every module adapted (its weights under the experts')
    for key, value in expected.items():
        torch.testing.assert_close(merged[key].double(), value, rtol=2.5e-7, atol=0, msg=key)
    base = base_of(exported.model).state_dict()
    for key in merged.keys() - expected.keys():
        assert torch.equal(merged[key].double(), base[key].float().double()), key


def test_merged_export_loads_in_transformers_with_the_lora_models_logits(exported, monkeypatch):
    from transformers import Qwen3_5MoeForCausalLM

    force_transformers_torch_kernels(monkeypatch)
    hf = Qwen3_5MoeForCausalLM.from_pretrained(exported.folder / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (hf(input_ids=ids()).logits.double() - exported.model(ids()).logits).abs().max().item()
    assert diff < LOGITS_ATOL, f"max |logits diff| {diff:.3e}"


def test_peft_adapter_on_transformers_base_gives_the_lora_models_logits(exported, monkeypatch):
    """PEFT's model of the base plus the adapter folder is our LoRA model, routed experts and router included; PEFT
    adapts exactly the modules the folder has factors for; the MTP adapters and the dropout are named as left out."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors import safe_open
    from transformers import Qwen3_5MoeForCausalLM

    force_transformers_torch_kernels(monkeypatch)
    base = Qwen3_5MoeForCausalLM.from_pretrained(exported.folder / "base", attn_implementation="eager").eval()
    plain = base(input_ids=ids()).logits.detach()
    peft = PeftModel.from_pretrained(base, exported.folder / "merged-adapter").eval()
    with torch.no_grad():
        ours = exported.model(ids()).logits
        diff = (peft(input_ids=ids()).logits.double() - ours).abs().max().item()
        moved = (plain.double() - ours).abs().max().item()
    assert diff < LOGITS_ATOL < moved, f"max |logits diff| {diff:.3e} (the base alone: {moved:.3e})"

    with safe_open(str(exported.folder / "merged-adapter" / WEIGHTS_NAME), "pt") as f:
        written = set(f.keys())
    assert set(get_peft_model_state_dict(peft)) == written
    assert {k for k in written if ".mlp.experts." in k} == {
        f"base_model.model.model.layers.{n}.mlp.experts.{inner}lora_{f}.weight"
        for n in range(2) for inner in ("", "base_layer.") for f in "AB"}
    config = json.loads((exported.folder / "merged-adapter" / CONFIG_NAME).read_text())
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"], config["lora_dropout"],
            config["base_model_name_or_path"]) == ("LORA", "CAUSAL_LM", 4, 8, 0.0, str(exported.folder / "base"))
    assert len(exported.notes) == 2 and "MTP layers" in exported.notes[0] and "trained with 0.1" in exported.notes[1]


def test_dense_targets_alone_keep_their_dropout_and_need_no_target_parameters():
    layout = peft_layout({"layers.3.self_attn.q_proj.adapter.lora_A": (4, 64),
                          "layers.3.self_attn.q_proj.adapter.lora_B": (128, 4),
                          "layers.0.mlp.shared_expert.up_proj.adapter.lora_A": (4, 64),
                          "layers.0.mlp.shared_expert.up_proj.adapter.lora_B": (32, 4)})
    config = peft_config(LORA, layout, None)
    assert (config["target_modules"], config["target_parameters"], config["lora_dropout"]) == (
        ["q_proj", "shared_expert.up_proj"], None, 0.1)


def test_a_sharded_model_exports_the_same_files_gathering_each_tensor_once(exported, tmp_path, one_rank_mesh,
                                                                           monkeypatch):
    """Under FSDP every tensor, adapters included, is a DTensor that the exports gather whole (a collective): once
    each for the merged export (A and B with their weight), once each for the adapter folder."""
    model = exported.model
    sharded = {k: distribute_tensor(v.detach(), one_rank_mesh, [Shard(0)]) for k, v in model.state_dict().items()}
    as_fsdp = SimpleNamespace(state_dict=lambda: sharded, named_modules=model.named_modules)
    gathered = []
    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(DTensor, "full_tensor", lambda self: gathered.append(id(self)) or full_tensor(self))
    lora_exports(as_fsdp, LORA, tmp_path / "merged", exported.folder / "base", torch.float32)
    adapters = [id(v) for k, v in sharded.items() if is_adapter_key(k) and "mtp." not in k]
    assert sorted(gathered) == sorted([*map(id, sharded.values()), *adapters])  # merged export, then adapter folder
    for name in ("merged", "merged-adapter"):
        assert files_under(tmp_path / name) == files_under(exported.folder / name), name


def lora_step(step_dir: Path, model: Qwen35MoeModel, base: Path | None, lora: LoraArgs, seed: int = 0) -> Path:
    """A LoRA run's checkpoint step as the trainer leaves it: the adapters alone under `model.`, the train state
    with its "lora" entry (settings; the base's source, "" when drawn from the seed, and digest) and run config,
    hf/config.json, COMPLETE."""
    source = "" if base is None else str(base)
    record = {"args": {**lora.__dict__, "targets": list(lora.targets)},
              "base": {"digest": base_digest(source, seed, ARGS), "source": source}}
    train = {"step": 20, "lora": record, "run_config": {"training": {"seed": seed}}}
    adapters = {k: v for k, v in model.state_dict().items() if is_adapter_key(k)}
    step_dir.mkdir(parents=True)
    dcp.save({"model": adapters, "train": to_bytes(train)}, checkpoint_id=str(step_dir), no_dist=True)
    (step_dir / "hf").mkdir()
    write_hf_meta(step_dir / "hf", ARGS, "bfloat16", None)
    names = [*rank_data_files(step_dir, 0), *rank_0_files(step_dir)]
    write_complete(step_dir, {"step": 20, "world_size": 1, "checksum": ALGORITHM,
                              "files": digest_files(step_dir, names, threads=1)})
    return step_dir


def trained_on(base: Path | None, lora: LoraArgs) -> Qwen35MoeModel:
    """An fp32 LoRA model as a run trains it: its base loaded from the HF folder `base` (None: drawn from seed 0),
    its adapters moved away from their init."""
    with torch.device("meta"):
        model = Qwen35MoeModel(ARGS)
        add_adapters(model, lora)
    model.to_empty(device="cpu")
    model.init_weights(0)
    if base is not None:
        load_hf_weights(model, ARGS, str(base))
    randomise(model, 3, base=False)
    return model


@pytest.mark.parametrize("drawn", ["from an HF folder", "from the seed"])
def test_the_converter_writes_the_end_of_run_exports_of_a_lora_step(exported, tmp_path, drawn, capsys):
    """From the adapters and the base (read from its folder, or drawn again from the seed): the merged folder (bf16,
    several shards) and the adapter folder, the bytes the end of the run writes."""
    base, lora = None, FEW
    if drawn == "from an HF folder":
        base, lora = tmp_path / "base", LORA
        export_hf(base_of(lora_model(seed=1, dtype=torch.float32)), ARGS, str(base), torch.bfloat16)
    model = trained_on(base, lora)
    lora_exports(model, lora, tmp_path / "run" / "hf", base, torch.bfloat16, max_shard_bytes=SMALL_SHARDS)
    step = lora_step(tmp_path / "run" / "checkpoint" / "step-20", model, base, lora)
    out = tmp_path / "converted"
    capsys.readouterr()
    assert convert_main([str(step), str(out), "--max-shard-gib", str(SMALL_SHARDS / 1024**3)]) == 0
    assert (f"wrote {out} (the merged model) and {tmp_path / 'converted-adapter'} (the PEFT adapter)"
            in capsys.readouterr().out)
    assert len(list(out.glob("*.safetensors"))) > 1
    assert files_under(out) == files_under(tmp_path / "run" / "hf")
    assert files_under(tmp_path / "converted-adapter") == files_under(tmp_path / "run" / "hf-adapter")


def test_the_converter_refuses_a_base_that_is_not_the_one_trained_on(exported, tmp_path, capsys):
    """Another base given with --base, or the saved one moved away: exit 2, one line naming both bases and digests
    (or the missing folder and --base), nothing written."""
    base, other = tmp_path / "base", exported.folder / "base"
    export_hf(base_of(lora_model(seed=1, dtype=torch.float32)), ARGS, str(base), torch.bfloat16)
    step = lora_step(tmp_path / "checkpoint" / "step-20", trained_on(base, FEW), base, FEW)
    out = tmp_path / "out"
    capsys.readouterr()
    assert convert_main([str(step), str(out), "--base", str(other)]) == 2
    error = one_error(capsys, logged=True)  # beside the log lines of the exports above, where logging is set up
    for named in (str(base), str(other), base_digest(str(base), 0, ARGS), base_digest(str(other), 0, ARGS)):
        assert named in error, error
    base.rename(tmp_path / "moved")
    assert convert_main([str(step), str(out)]) == 2
    error = one_error(capsys, logged=True)
    assert str(base) in error and "not there" in error and "--base" in error, error
    assert not out.exists() and not (tmp_path / "out-adapter").exists()
    assert convert_main([str(step), str(out), "--base", str(tmp_path / "moved")]) == 0


def hostile_headers() -> dict[str, bytes]:
    """safetensors files whose headers ask for what no reader should attempt: a length of 1e13, JSON nested 10,000
    deep (within a valid length), a header that is a list, a tensor whose bytes lie beyond the file."""
    deep = b"[" * 10_000 + b"]" * 10_000
    beyond = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}).encode()
    return {"huge": (10**13).to_bytes(8, "little") + b"{}", "deep": len(deep).to_bytes(8, "little") + deep,
            "list": (2).to_bytes(8, "little") + b"[]", "beyond": len(beyond).to_bytes(8, "little") + beyond}


@pytest.mark.parametrize("kind", ["huge", "deep", "list", "beyond"])
def test_a_hostile_safetensors_header_is_one_error_line_for_the_converter_and_the_trainer(
        exported, tmp_path, capsys, kind):
    """The converter's --base and training's initial_load_hf read headers through one bounded reader: exit 2 naming
    the file (before: MemoryError or RecursionError tracebacks in the converter's digest of the base)."""
    from harness.train import main as train_main

    base = tmp_path / "base"
    export_hf(base_of(lora_model(seed=1, dtype=torch.float32)), ARGS, str(base), torch.bfloat16)
    step = lora_step(tmp_path / "checkpoint" / "step-20", trained_on(base, FEW), base, FEW)
    (base / "model.safetensors").write_bytes(hostile_headers()[kind])
    capsys.readouterr()
    assert convert_main([str(step), str(tmp_path / "out"), "--base", str(base)]) == 2
    error = one_error(capsys, logged=True)
    assert f"cannot read {base / 'model.safetensors'}: it is not a safetensors file" in error, error
    assert train_main(["--training.steps", "1", "--training.seq_len", "64", "--model.flavor", "debugmodel_mtp",
                       "--lora.enable", "true", "--checkpoint.initial_load_hf", str(base),
                       "--job.dump_folder", str(tmp_path / "run")]) == 2
    error = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "it is not a safetensors file" in error[0], error


def test_a_headers_nesting_is_bounded_at_8_levels_counted_across_the_chunks_it_is_read_in(tmp_path):
    """The depth bound of read_safetensors_header, counted a chunk at a time, against the plain byte loop on random
    bracket strings cut at every chunk size up to 7; then a header of a valid tensor with an extra entry nested to
    depth 8 (read) and to 9 (refused, naming the depth)."""
    import random

    from models.qwen35_moe.hf_checkpoint import _bracket_depth, read_safetensors_header

    def loop(text: bytes) -> int:
        depth = deepest = 0
        for byte in text:
            depth += (byte in b"[{") - (byte in b"]}")
            deepest = max(deepest, depth)
        return deepest

    rng = random.Random(0)
    for _ in range(200):
        text = bytes(rng.choice(b'[]{}a"') for _ in range(rng.randrange(60)))
        assert all(_bracket_depth(text, chunk) == loop(text) for chunk in range(1, 8)), text
    for extra, deepest in ((6, 8), (7, 9)):
        header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16],
                                   "x": json.loads("[" * extra + "]" * extra)}}).encode()
        path = tmp_path / f"depth{deepest}.safetensors"
        path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
        if deepest <= 8:
            assert list(read_safetensors_header(path)) == ["w"]
        else:
            with pytest.raises(ValueError, match=f"its header nests {deepest} levels deep"):
                read_safetensors_header(path)


def test_a_separate_expert_rank_is_peft_rank_pattern_and_both_exports_are_the_same_model(tmp_path, monkeypatch):
    """lora.expert_rank: the routed experts' adapters at rank 8 beside the dense ones' 4, each scaled by alpha over
    its own rank. The PEFT folder states it as rank_pattern for the two expert parameters, and PEFT's model of the
    base with it, like transformers' model of the merged export, gives the LoRA model's logits."""
    import dataclasses

    from peft import PeftModel
    from transformers import Qwen3_5MoeForCausalLM

    force_transformers_torch_kernels(monkeypatch)
    lora = dataclasses.replace(LORA, dropout=0.0, expert_rank=8)
    model = lora_model(seed=2, lora=lora)
    experts = [m.adapter for n, m in adapted_modules(model) if n.endswith("experts")]
    assert experts and all(a.gate_up_A.shape[1] == 8 and a.scale == 1.0 for a in experts)  # alpha 8 / rank 8
    export_hf(base_of(model), ARGS, str(tmp_path / "base"), torch.float32)
    lora_exports(model, lora, tmp_path / "merged", tmp_path / "base", torch.float32)
    config = json.loads((tmp_path / "merged-adapter" / CONFIG_NAME).read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert config["rank_pattern"] == {"mlp.experts.down_proj": 8, "mlp.experts.gate_up_proj": 8}
    base = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager").eval()
    peft = PeftModel.from_pretrained(base, tmp_path / "merged-adapter").eval()
    merged = Qwen3_5MoeForCausalLM.from_pretrained(tmp_path / "merged", attn_implementation="eager").eval()
    with torch.no_grad():
        ours = model(ids()).logits
        for name, other in (("peft", peft), ("merged", merged)):
            diff = (other(input_ids=ids()).logits.double() - ours).abs().max().item()
            assert diff < LOGITS_ATOL, f"{name}: max |logits diff| {diff:.3e}"
