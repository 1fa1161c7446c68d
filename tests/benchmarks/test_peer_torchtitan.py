"""benchmarks/peer_torchtitan.py, the parts that run without torchtitan: the report (a contender that failed among
those that ran), our trainer's batch check, the folder as torchtitan 0.3.0's from_hf reads it, the HF slices its
parameters are checked against, the stand-ins for what an older torch lacks, and the LoRA mode's CPU check (ours
against transformers + PEFT from the same adapters)."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch

from tests.benchmarks.scripts import loaded, printed_by


def test_report_keeps_the_others_when_one_contender_fails():
    peer = loaded("peer_torchtitan.py")
    ns = peer.parse_args(["--flavor", "debugmodel"])
    spec = {"seq": 256, "batch": 2, "ac": "none", "compile": False, "steps": 2, "warmup": 1, "folder": "/w/hf",
            "attended": 100.0}
    results = {"ours": {"tokens_per_sec": 200.0, "max_memory_gib": 1.0, "losses": [6.0, 5.5], "peak_flops": 1e3,
                        "notes": ["a note"]},
               "torchtitan": {"error": ["Traceback (most recent call last):", "torch.OutOfMemoryError: CUDA"],
                              "exit": 1},
               "transformers": {"tokens_per_sec": 100.0, "max_memory_gib": 2.0, "losses": [6.1, 5.3],
                                "peak_flops": 1e3}}
    text = "\n".join(peer.report(ns, spec, results, flops=2.0, device="cuda"))
    assert "torchtitan 0.3.0   failed (exit 1)" in text and "| torch.OutOfMemoryError: CUDA" in text
    assert "ours                      200 tok/s  MFU  40.0%  peak 1.0 GiB  loss step 1 6.0000, step 2 5.5000" in text
    assert "ratio ours / transformers loop: 2.00x" in text and "ours / torchtitan" not in text
    assert "transformers loop vs ours: max |loss difference| 0.20000 over 2 steps, 0.10000 at step 1" in text
    assert "  ours: a note" in text


def test_a_frame_that_dynamo_gave_up_on_is_noted_from_its_own_warning(tmp_path):
    """The log lines torch itself writes when a frame passes the recompile limit (a frame guarded on the length of
    a tuple, as torchtitan's document boundaries), read back as the note the figures carry."""
    script = tmp_path / "recompiles.py"
    script.write_text("import torch\ntorch._dynamo.config.recompile_limit = 2\n"
                      "f = torch.compile(lambda x, bounds: x * len(bounds), backend='eager')\n"
                      "for n in range(1, 5):\n    f(torch.ones(2), tuple(range(n)))\n")
    log = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stderr
    peer = loaded("peer_torchtitan.py")
    (note,) = peer.recompile_notes(log.splitlines())
    assert note.startswith("dynamo hit its recompile_limit on 1 compiled frame(s), which then ran uncompiled; "
                           "last reason: 0/1: len(bounds) == 2"), note
    assert peer.recompile_notes(["torch._dynamo hit nothing"]) == []


def test_results_of_earlier_invocations_count_only_with_the_same_settings(tmp_path):
    peer = loaded("peer_torchtitan.py")
    spec = {"steps": 2, "ac": "none"}
    (tmp_path / "ours.json").write_text(json.dumps({"tokens_per_sec": 1.0, "notes": ["n"], "spec": spec}))
    assert peer.earlier_result(tmp_path, "ours", spec)["notes"] == ["measured by an earlier invocation on this "
                                                                      "folder", "n"]
    assert peer.earlier_result(tmp_path, "ours", {**spec, "ac": "full"}) is None
    assert peer.earlier_result(tmp_path, "torchtitan", spec) is None
    # torchtitan's own settings: a rerun of it with its recompile limit raised keeps ours, not its own earlier run
    tuned = {**spec, "torchtitan_recompile_limit": 64}
    (tmp_path / "torchtitan.json").write_text(json.dumps({"tokens_per_sec": 1.0, "spec": spec}))
    assert peer.earlier_result(tmp_path, "ours", tuned) is not None
    assert peer.earlier_result(tmp_path, "torchtitan", tuned) is None
    assert peer.earlier_result(tmp_path, "torchtitan", spec) is not None


def test_only_names_contenders_of_the_mode():
    """Full fine-tuning: ours, torchtitan, transformers; with --lora: ours and transformers + PEFT, ours with our
    LoRA flags (alpha twice the rank unless given)."""
    peer = loaded("peer_torchtitan.py")
    assert peer.parse_args(["--only", "ours, torchtitan"]).only == ["ours", "torchtitan"]
    assert peer.parse_args([]).only == ["ours", "torchtitan", "transformers"]
    lora = peer.parse_args(["--lora", "16", "--lora-expert-rank", "8"])
    assert lora.only == ["ours", "peft"] and lora.lora_alpha == 32.0
    assert peer.lora_flags(lora) == ["--lora.enable", "true", "--lora.rank", "16", "--lora.expert_rank", "8",
                                     "--lora.alpha", "32"]
    assert peer.lora_flags(peer.parse_args([])) == []
    fp8 = peer.parse_args(["--float8"])
    assert fp8.only == ["ours", "torchtitan"]
    assert peer.float8_flags(fp8, "cuda") == ["--quantize.linear_float8_recipe", "rowwise",
                                              "--quantize.grouped_mm_float8_fqns", "experts"]
    assert peer.float8_flags(fp8, "cpu")[-2:] == ["--quantize.float8_emulate", "true"]
    assert peer.float8_flags(peer.parse_args([]), "cuda") == []
    for wrong in (["--only", "ours,megatron"], ["--steps", "5", "--warmup", "5"], ["--only", "peft"],
                  ["--lora", "8", "--only", "ours,torchtitan"], ["--lora", "8", "--only", "transformers"],
                  ["--float8", "--only", "transformers"], ["--float8", "--lora", "8"]):
        with pytest.raises(SystemExit):
            peer.parse_args(wrong)


def test_torchtitans_float8_filter_keeps_in_bf16_what_ours_keeps():
    """--float8 gives torchtitan's Float8LinearConverter the modules our default filter keeps in bf16, by its names:
    ours' default changing without the script following would compare different conversions."""
    from harness.config.schema import Quantize

    peer = loaded("peer_torchtitan.py")
    ours_to_torchtitans = {"lm_head": "lm_head", "shared_expert_gate": "shared_experts.gate",
                           "in_proj_a": "in_proj_a", "in_proj_b": "in_proj_b", "mtp.": None}  # its model: no MTP
    assert Quantize().linear_float8_filter_fqns == list(ours_to_torchtitans)
    # its router is a Linear (ours is not one, so never converted): filtered by name
    assert sorted(peer.TORCHTITAN_FLOAT8_FILTER) == sorted([*filter(None, ours_to_torchtitans.values()), "router.gate"])


def test_our_trainers_batches_are_checked_against_the_saved_rows():
    peer = loaded("peer_torchtitan.py")
    rows = [{"input_ids": torch.arange(4).view(1, 4)}, {"input_ids": torch.arange(4, 8).view(1, 4)}]
    assert len(list(peer.CheckedLoader(rows, rows))) == 2
    with pytest.raises(SystemExit, match="batch 2 differs"):
        list(peer.CheckedLoader([rows[0], rows[0]], rows))


def test_folder_as_torchtitan_reads_it_and_the_slices_its_parameters_must_equal():
    peer = loaded("peer_torchtitan.py")
    args = loaded("bench_model.py").bench_args(4, 8, "debugmodel")
    kd = args.linear_num_key_heads * args.linear_key_head_dim
    vd = args.linear_num_value_heads * args.linear_value_head_dim
    e, f, d = args.num_experts, args.moe_intermediate_size, args.hidden_size
    hf = {"model.layers.0.linear_attn.in_proj_qkv.weight": torch.randn(2 * kd + vd, d),
          "model.layers.0.linear_attn.conv1d.weight": torch.randn(2 * kd + vd, 1, 4),
          "model.layers.0.mlp.experts.gate_up_proj": torch.randn(e, 2 * f, d),
          "model.layers.0.mlp.experts.down_proj": torch.randn(e, d, f),
          "lm_head.weight": torch.randn(args.vocab_size, d)}
    read = peer.torchtitan_input(hf)
    assert set(read) == {k.replace("model.", "model.language_model.") for k in hf}
    assert torch.equal(read["model.language_model.layers.0.mlp.experts.gate_up_proj"],
                       hf["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2))
    assert torch.equal(read["model.language_model.layers.0.mlp.experts.down_proj"],
                       hf["model.layers.0.mlp.experts.down_proj"].transpose(1, 2))

    def part(name):
        return peer.hf_source(f"layers.0.{name}", hf, args)

    assert torch.equal(torch.cat([part(f"attn.in_proj_{x}.weight") for x in "qkv"]),
                       hf["model.layers.0.linear_attn.in_proj_qkv.weight"])
    assert [part(f"attn.conv_{x}.weight").shape[0] for x in "qkv"] == [kd, kd, vd]
    gate, up = part("moe.routed_experts.inner_experts.w1_EFD"), part("moe.routed_experts.inner_experts.w3_EFD")
    x = torch.randn(3, d)  # transformers' expert e: gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)
    want_gate, want_up = torch.nn.functional.linear(x, hf["model.layers.0.mlp.experts.gate_up_proj"][1]).chunk(2, -1)
    assert torch.allclose(x @ gate[1].T, want_gate) and torch.allclose(x @ up[1].T, want_up)
    assert part("moe.routed_experts.inner_experts.w2_EDF").shape == (e, d, f)
    assert peer.hf_source("lm_head.weight", hf, args) is hf["lm_head.weight"]


def test_stand_ins_only_where_torch_lacks_the_original():
    peer = loaded("peer_torchtitan.py")
    calls = []
    create = peer._with_full_blocks(lambda *args, **kwargs: calls.append((args, kwargs)))
    create("mask_mod", 2, None, 8, 8, BLOCK_SIZE=128, separate_full_blocks=True)
    assert calls == [(("mask_mod", 2, None, 8, 8), {"BLOCK_SIZE": 128})]
    with pytest.raises(NotImplementedError):
        create("mask_mod", 2, None, 8, 8, separate_full_blocks=False)
    with pytest.raises(NotImplementedError):
        peer._DataParallelMeshDims()
    import torch.distributed.fsdp as fsdp
    from torch.nn.attention.flex_attention import create_block_mask

    full_blocks = "separate_full_blocks" in inspect.signature(create_block_mask).parameters
    if hasattr(fsdp, "DataParallelMeshDims") and full_blocks:
        assert peer.add_torch_stand_ins() == []  # torch >= 2.12 has both originals: nothing is replaced
        assert torch.nn.attention.flex_attention.create_block_mask is create_block_mask


def test_one_reduce_of_fp32_and_bf16_gradients_gets_them_in_fp32():
    peer = loaded("peer_torchtitan.py")
    seen = []
    reduce = peer._uniform_reduce_dtype(lambda params, grads, *rest: seen.append(([g.dtype for g in grads], rest)))
    grads = [torch.ones(2, dtype=torch.bfloat16), torch.ones(3)]
    reduce(["norm", "lm_head"], grads, "group")
    assert seen == [([torch.float32, torch.float32], ("group",))] and grads[0].dtype == torch.float32
    reduce(["a"], [torch.ones(1, dtype=torch.bfloat16)])
    assert seen[-1][0] == [torch.bfloat16]  # uniform: untouched


def test_the_timed_steps_note_names_the_graphs_compiled_inside_them():
    """torchtitan's frames compile again for each new document count: the note says in which timed steps, from the
    counts of graphs dynamo captured per step (here a frame guarded on a tuple's length, as its boundaries are)."""
    from torch._dynamo.utils import counters

    peer = loaded("peer_torchtitan.py")
    f = torch.compile(lambda x, bounds: x * len(bounds), backend="eager")
    graphs = []
    for count in (3, 4, 3, 3, 5, 3):  # steps 1-6; steps 3-6 timed, step 5 brings a new count
        before = counters["stats"]["unique_graphs"]
        f(torch.ones(2), tuple(range(count)))
        graphs.append(counters["stats"]["unique_graphs"] - before)
    assert graphs[2:] == [0, 0, 1, 0]
    note = peer.timed_steps_note([900.0, 1000.0, 50.0, 1100.0], graphs, warmup=2)
    assert note == ("timed steps: median 950 tok/s, slowest 50 (step 5); dynamo compiled 1 graph(s) in 1 of them "
                    "(step: graphs 5: 1)")
    assert peer.timed_steps_note([1000.0, 990.0], [2, 1, 0, 0], warmup=2).endswith("no dynamo graph compiled in them")


def test_our_trainer_builds_its_loader_and_model_where_the_script_looks(tmp_path, monkeypatch):
    """run_ours wraps harness.data_setup.build_dataloader to check our trainer's batches against the saved rows, and
    harness.trainer.build_model to record the adapters a LoRA run starts from: the trainer must build both through
    those names, or the checks would silently check nothing."""
    import harness.data_setup
    import harness.trainer
    from harness.config import DEFAULT_CONFIG, load_config
    from harness.trainer import Trainer

    built, real = [], harness.data_setup.build_dataloader
    monkeypatch.setattr(harness.data_setup, "build_dataloader",
                        lambda *args, **kwargs: built.append(args[1]) or real(*args, **kwargs))
    models, build_model = [], harness.trainer.build_model
    monkeypatch.setattr(harness.trainer, "build_model",
                        lambda *args, **kwargs: models.append(build_model(*args, **kwargs)) or models[-1])
    trainer = Trainer(load_config(["--config", str(DEFAULT_CONFIG), "--training.seq_len", "64",
                                   "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(tmp_path)]))
    trainer.close()
    assert len(built) == 1 and built[0].endswith("train.jsonl")
    assert models == [trainer.model]


def test_lora_cpu_check_peft_starts_from_our_adapters_and_agrees_on_the_loss(tmp_path):
    """The script's LoRA check on CPU, as a user runs it: transformers + PEFT loads a PEFT folder of our initial
    adapters, trains exactly those (each tensor equal to ours as loaded, gradients reaching all), and its losses
    agree with our LoRA trainer's."""
    from harness.lora.peft import peft_layout
    from models.qwen35_moe.lora import adapter_shapes
    from models.qwen35_moe.lora_targets import LoraArgs

    out = printed_by("peer_torchtitan.py", "--flavor", "debugmodel", "--layers", "4", "--experts", "8", "--seq",
                     "256", "--steps", "3", "--warmup", "1", "--lora", "8", "--only", "ours,peft", "--work",
                     str(tmp_path))
    ours, peft = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("ours", "peft"))
    assert ours["adapters_sha256"] == peft["adapters_sha256"]
    assert "initial adapters: ours and those PEFT loaded are the same" in out
    args = loaded("bench_model.py").bench_args(4, 8, "debugmodel")
    tensors = len(peft_layout(adapter_shapes(args, LoraArgs(rank=8, alpha=16.0))).native_of)
    assert f"PEFT trains exactly our adapters: {tensors} tensors" in out and "gradients reached all of them" in out
    assert "ratio ours / transformers+PEFT: " in out
    # Step 1, before any update: the same weights (B = 0: PEFT's model is the base) and rows, fp32 on CPU. Its model
    # attends across the rows' documents, which at the initial weights moves the loss by about 5e-7 (measured);
    # 1e-5 leaves room for reduction order, where a wrong base or a B loaded nonzero moves it by far more.
    assert abs(peft["losses"][0] - ours["losses"][0]) < 1e-5, (peft["losses"], ours["losses"])
    # Later steps: the transformers loop's difference from ours in full fine-tuning on these rows is 2.4e-4
    # (attention across documents); ours' MoE balance loss does not change it.
    assert max(abs(a - b) for a, b in zip(peft["losses"], ours["losses"])) < 1e-3, (peft["losses"], ours["losses"])
    peer = loaded("peer_torchtitan.py")
    assert "DIFFER" in peer.same_initial_adapters(ours["adapters_sha256"], "0" * 64)
    assert "DIFFER" in peer.same_initial_adapters(None, None)


def test_float8_cpu_check_trains_ours_in_fp8_and_says_so(tmp_path):
    """--float8 on CPU as a user runs it (ours only: torchtitan's converters need an SM89 GPU): our trainer gets the
    FP8 flags, emulated, converts the blocks' projections and every layer's routed experts, and the report says FP8."""
    out = printed_by("peer_torchtitan.py", "--flavor", "debugmodel", "--layers", "4", "--experts", "8", "--seq",
                     "256", "--steps", "3", "--warmup", "1", "--float8", "--only", "ours", "--work", str(tmp_path))
    assert "FP8 training, rowwise dynamic scales (torchao's recipe)" in out
    assert ("ours: FP8: --quantize.linear_float8_recipe rowwise --quantize.grouped_mm_float8_fqns experts "
            "--quantize.float8_emulate true") in out
    log = (tmp_path / "ours.log").read_text()
    # 4 layers, 2 of each kind: Gated DeltaNet's in_proj_qkv, in_proj_z, out_proj; attention's q, k, v, o; and the
    # shared experts' gate, up, down in all 4: 2 * 3 + 2 * 4 + 4 * 3
    assert "26 projections' GEMMs in float8 (recipe rowwise), 4 routed experts'" in log, log[-2000:]
    assert len(json.loads((tmp_path / "ours.json").read_text())["losses"]) == 3
