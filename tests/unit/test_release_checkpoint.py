"""scripts/make_release_checkpoint.py: a folder shaped like the Qwen/Qwen3.5-35B-A3B release, checked against
references it does not use: the project's description of the release's text and MTP tensors (release_layout), the
names transformers' multimodal model saves, the release's own index totals and shard sizes (public pins of its
files), transformers and our loader reading the folder, and the chat template rendered by jinja2 directly."""

from __future__ import annotations

import json
import math
import struct
import weakref
from pathlib import Path

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

from harness.checkpoint.hf_weights import load_hf_weights
from harness.data.tokenizer import HFTokenizer
from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel
from scripts.make_release_checkpoint import (
    CHAT_TEMPLATE,
    SMALL_TEXT,
    SMALL_VISION,
    main,
    nbytes,
    plan_shards,
    random_weights,
    release_config,
    shard_names,
    tensor_specs,
    write_release_checkpoint,
    write_weights,
)
from scripts.release_tokenizer import ADDED_TOKENS
from tests.unit.test_export_mtp_layout import headers, release_layout

SMALL_SHARD_BYTES = 2**19  # the small model's 64 MB in 4 shards: lm_head, the embedding, the rest (1 MB) over two
# The release's model.safetensors.index.json: 1811 tensors, total_size 71,903,655,008; its last two shards hold
# 5,367,816,192 and 2,224,575,584 bytes of tensors, 3 and 782 of the 785 `mtp.*` tensors (public pins of its files).
RELEASE_TENSORS, RELEASE_TOTAL_SIZE = 1811, 71_903_655_008
RELEASE_LAST_SHARDS = [(5_367_816_192, 3), (2_224_575_584, 782)]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("release") / "small"
    write_release_checkpoint(folder, release_config(SMALL_TEXT, SMALL_VISION), seed=3,
                             max_shard_bytes=SMALL_SHARD_BYTES, log=lambda line: None)
    return folder


def _file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for path in sorted(folder.glob("*.safetensors")) for k, v in load_file(path).items()}


def test_text_and_mtp_tensors_are_the_releases_key_for_key(small):
    """Names, dtypes and shapes of everything but the vision tower equal the project's description of the release."""
    ours = {k: v for k, v in headers(small).items() if not k.startswith("model.visual.")}
    release = release_layout(Qwen35MoeArgs.from_hf_config(small))
    assert ours.keys() == release.keys(), (sorted(ours.keys() - release.keys()), sorted(release.keys() - ours.keys()))
    assert {k: v for k, v in ours.items() if v != release[k]} == {}


def test_every_tensor_transformers_saves_is_there_with_its_shape(small):
    """transformers' multimodal model (meta device, the folder's config): its state dict's names are the folder's
    but `mtp.*` (which it does not model), with the same shapes; the vision tower in BF16."""
    from transformers import AutoConfig, Qwen3_5MoeForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3_5MoeForConditionalGeneration(AutoConfig.from_pretrained(small))
    theirs = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    ours = headers(small)
    assert {k for k in ours if not k.startswith("mtp.")} == theirs.keys()
    assert all(ours[k][1] == shape for k, shape in theirs.items())
    assert {dtype for k, (dtype, _) in ours.items() if k.startswith("model.visual.")} == {"BF16"}


def test_the_full_size_plan_is_the_releases():
    """At the release's config (nothing written): its tensor count and total size, 14 shards, and its last two
    shards' sizes with the `mtp.*` tensors split 3 / 782 between them."""
    specs = tensor_specs(release_config())
    assert len(specs) == RELEASE_TENSORS
    assert sum(map(nbytes, specs.values())) == RELEASE_TOTAL_SIZE
    assert sum(k.startswith("model.visual.") for k in specs) == 333 and sum(k.startswith("mtp.") for k in specs) == 785
    shards = plan_shards(specs)
    assert len(shards) == 14 and all(sum(nbytes(specs[k]) for k in s) <= 5 * 1024**3 for s in shards)
    last = [(sum(nbytes(specs[k]) for k in s), sum(k.startswith("mtp.") for k in s)) for s in shards[-2:]]
    assert last == RELEASE_LAST_SHARDS
    assert shard_names(14)[0] == "model.safetensors-00001-of-00014.safetensors"


def test_the_index_maps_every_tensor_to_its_file_and_sums_their_bytes(small):
    index = json.loads((small / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in small.glob("*.safetensors"))
    assert files == shard_names(len(files)) and len(files) == 4
    located, total = {}, 0
    for name in files:
        raw = (small / name).read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8:8 + length])
        header.pop("__metadata__", None)
        located |= {k: name for k in header}
        ends = [v["data_offsets"][1] for v in header.values()]
        assert len(raw) == 8 + length + max(ends), name  # the tensors' bytes end the file
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for v in header.values())
    assert index["weight_map"] == located
    assert index["metadata"]["total_size"] == total


def test_transformers_and_our_loader_read_the_same_weights(small):
    """transformers' Qwen3_5MoeForConditionalGeneration loads the folder with nothing missing or unexpected (it
    skips `mtp.*`); our loader fills our model; every text tensor is the same in both (fp32, exact: BF16 values
    widen exactly), the MTP tensors are the files'. A forward gives the loss of a uniform guess (log V), as a fresh
    model should."""
    from transformers import AutoConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    assert isinstance(AutoConfig.from_pretrained(small), Qwen3_5MoeConfig)
    hf, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(small, dtype=torch.float32,
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    theirs = hf.state_dict()
    args = Qwen35MoeArgs.from_hf_config(small)
    with torch.device("meta"):
        ours = Qwen35MoeModel(args)
    ours.to_empty(device="cpu")
    load_hf_weights(ours, args, str(small))
    files = _file_tensors(small)
    for key, value in ours.state_dict().items():
        if key.startswith("mtp."):
            continue
        name = key if key == "lm_head.weight" else "model.language_model." + key.replace("_fp32_params.", "")
        assert torch.equal(value, theirs[name]), key
    mtp = ours.state_dict()["mtp.layers.0.mlp.experts.gate_up_proj"]
    gate, up = files["mtp.layers.0.mlp.experts.5.gate_proj.weight"], files["mtp.layers.0.mlp.experts.5.up_proj.weight"]
    assert torch.equal(mtp[5], torch.cat([gate, up]).float())
    assert torch.equal(ours.state_dict()["mtp.fc.weight"], files["mtp.fc.weight"].float())

    ids = torch.randint(0, args.vocab_size, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = ours(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
    assert abs(loss.item() - math.log(args.vocab_size)) < 0.1  # initial logits ~ N(0, 0.16): near uniform


def test_values_follow_the_models_init_and_the_seed(small):
    files = _file_tensors(small)
    config = release_config(SMALL_TEXT, SMALL_VISION)
    for name, value in files.items():
        if name.endswith(("input_layernorm.weight", "q_norm.weight", "mtp.norm.weight", "pre_fc_norm_hidden.weight")):
            assert not value.any(), name  # zero-centred RMSNorms: scale 1 + 0
        elif name.endswith(("linear_attn.norm.weight", "dt_bias", "visual.merger.norm.weight", ".norm1.weight")):
            assert (value == 1).all(), name
        elif name.endswith(".bias"):
            assert not value.any(), name
    a_log = files["model.language_model.layers.0.linear_attn.A_log"]
    assert a_log.dtype == torch.float32 and math.log(0.01) <= a_log.min() and a_log.max() <= math.log(16)
    embedding = files["model.language_model.embed_tokens.weight"].float()
    assert abs(embedding.std().item() - 0.02) < 0.0005 and abs(embedding.mean().item()) < 0.0005
    conv = files["model.language_model.layers.0.linear_attn.conv1d.weight"].float()
    assert conv.abs().max() <= 0.5 and conv.std() > 0.2  # U(-1/sqrt(4), 1/sqrt(4))
    spec = (torch.bfloat16, (64, 64))
    same, other = random_weights(config, 3, "cpu"), random_weights(config, 4, "cpu")
    name = "model.language_model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(same(name, spec), same(name, spec)) and not torch.equal(same(name, spec), other(name, spec))


def test_each_tensor_is_made_when_it_is_written_and_released_after(tmp_path):
    """The writer asks for one tensor at a time, in file order, each once: when a tensor is made, at most the one
    written before it is still alive (the writer's loop variable), and none is left at the end."""
    specs = tensor_specs(release_config(SMALL_TEXT, SMALL_VISION))
    alive, at_make, made = set(), [], []

    def make(name, spec):
        at_make.append(len(alive))
        made.append(name)
        tensor = torch.zeros(spec[1], dtype=spec[0])
        alive.add(name)
        weakref.finalize(tensor, alive.discard, name)
        return tensor

    write_weights(tmp_path, specs, make, max_shard_bytes=2**18, log=lambda line: None)
    shards = plan_shards(specs, 2**18)
    assert len(shards) > 3 and made == [k for s in shards for k in sorted(s)]
    assert max(at_make) <= 1 and not alive


def test_the_tokenizer_renders_the_official_template_with_the_releases_special_ids(small):
    """AutoTokenizer renders a conversation (system, tools, a reasoning turn, a tool call and its answer) exactly
    as jinja2 renders tests/data/qwen35_chat_template.jinja in transformers' documented template environment; the
    special tokens are at the release's ids; our loader reads the same ids, EOS <|im_end|> and no BOS."""
    from transformers import AutoTokenizer

    assert (small / "chat_template.jinja").read_text() == CHAT_TEMPLATE.read_text()
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                              "parameters": {"type": "object",
                                                             "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What time is it in Paris?"},
        {"role": "assistant", "content": "", "reasoning_content": "I should ask the tool.",
         "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "10:42"},
        {"role": "assistant", "content": "It is 10:42 in Paris."},
        {"role": "user", "content": "Thanks! ça va?"},
    ]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
    env.globals["raise_exception"] = lambda message: (_ for _ in ()).throw(ValueError(message))
    expected = env.from_string(CHAT_TEMPLATE.read_text()).render(messages=messages, tools=tools,
                                                                 add_generation_prompt=True)

    tok = AutoTokenizer.from_pretrained(small)
    rendered = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert rendered == expected
    assert [tok.convert_tokens_to_ids(c) for c, _ in ADDED_TOKENS] == list(range(248044, 248044 + len(ADDED_TOKENS)))
    assert tok.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>", "<think>"]) == [248045, 248046, 248068]

    ours = HFTokenizer(str(small))
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    assert ours.encode(rendered) == ids and tok.decode(ids) == rendered
    assert (ours.eos_id, ours.bos_id) == (248046, None)
    assert ours.vocab_size == 248044 + len(ADDED_TOKENS) <= Qwen35MoeArgs.from_hf_config(small).vocab_size


def test_the_command_line_plans_without_writing_and_refuses_a_folder_in_use(small, tmp_path, capsys):
    assert main([str(tmp_path / "new"), "--small", "--plan"]) == 0
    assert not (tmp_path / "new").exists()
    assert capsys.readouterr().out.splitlines()[-1].startswith("146 tensors, ")
    assert main([str(small), "--small"]) == 2
    assert "is not an empty folder" in capsys.readouterr().err


def test_bad_arguments_are_one_error_line_naming_each_and_nothing_is_written(tmp_path, capsys):
    out = tmp_path / "new"
    assert main([str(out), "--small", "--text-config-overrides", '{"hidden_sizee": 64}',
                 "--vision-config-overrides", "nope", "--max-shard-bytes", "0"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: text_config has no field 'hidden_sizee'; ")
    assert "--vision-config-overrides is not JSON" in err[0] and "--max-shard-bytes must be positive" in err[0]
    for flags, named in ((["--text-config-overrides", '{"num_hidden_layers": "4"}'], "num_hidden_layers = '4' is not"),
                         (["--vision-config-overrides", '{"depth": "x"}'], "vision_config: Validation error")):
        assert main([str(out), "--small", *flags]) == 2  # values the model or transformers refuse
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and named in err[0], err
    (tmp_path / "file").touch()
    assert main([str(tmp_path / "file" / "sub"), "--small"]) == 2  # a folder that cannot be made
    assert capsys.readouterr().err.startswith("error: ")
    with pytest.raises(SystemExit) as e:
        main([str(out), "--seed", "abc"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines() == [
        "error: argument --seed: invalid int value: 'abc' (--help lists the arguments)"]
    assert not out.exists()
