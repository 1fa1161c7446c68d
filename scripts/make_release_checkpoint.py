"""Write a folder shaped exactly like the released Hugging Face checkpoint Qwen/Qwen3.5-35B-A3B, with random weights.

For running the full-size model where the weights cannot be downloaded: the same files, config fields, tensor names,
dtypes, shapes and shards as the release, the values drawn as the model is initialised. The weights are never held
whole: each shard's header is computed from names, dtypes and shapes, then its tensors are drawn one at a time and
streamed into it (models/qwen35_moe/hf_checkpoint.py's write_shard); at most two tensors are alive at once (the
largest, a layer's fused gate_up_proj, is 1 GiB in BF16, drawn in fp32 first).

Files: config.json, generation_config.json, preprocessor_config.json, video_preprocessor_config.json,
model.safetensors.index.json, model.safetensors-000NN-of-000MM.safetensors, and the tokenizer files
(scripts/release_tokenizer.py: tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, chat_template.jinja).
Not written: the release's README.md, LICENSE and ModelScope's configuration.json.

Where the values come from (the release's files are not downloadable here; public copies of them were read):
- config.json: the published config.json of Qwen/Qwen3.6-35B-A3B (the same architecture and model_type), as pinned
  verbatim by a public evaluation harness, with the two differences an inventory of both snapshots
  (Qwen3.5-35B-A3B ec2d4ece1ffb) lists for Qwen3.5-35B-A3B: no text_config.bos_token_id and transformers_version
  "4.57.0.dev0". vision_config's model_type is "qwen3_5_moe" as released (transformers corrects it on load).
  layer_types is derived (every 4th layer full attention); vision out_hidden_size follows text hidden_size.
- Tensors: text and MTP from the project's model (models/qwen35_moe) through its state-dict adapter, under the
  release's `model.language_model.` prefix, `lm_head` and `mtp.*` at the top level, the MTP experts per expert;
  the vision tower from transformers' Qwen3_5MoeVisionModel built on the meta device, under `model.visual.`. BF16
  but linear_attn.A_log and linear_attn.norm.weight (F32). At full size: 1811 tensors, 71,903,655,008 bytes, the
  release index's total_size and count (693 text + 785 MTP + 333 vision).
- Shards: named `model.safetensors-000NN-of-000MM.safetensors` as the Qwen3.5 releases name them (an index is
  written even for one shard, as Qwen3.5-0.8B's release has). Split as the release's sizes show: tensors from the
  largest to the smallest (ties by name), each shard filled up to 5 GiB before the next. At full size that gives
  the release's 14 shards, its shard 13 of 5,367,816,192 bytes of tensors holding 3 of the `mtp.*` tensors and its
  shard 14 of 2,224,575,584 bytes holding the other 782 (the sizes a public pin of the release's files records);
  which of two equal-sized tensors falls on each side of a shard boundary may differ from the release.
- Values: models/qwen35_moe/init.py's rules, as transformers initialises the model: N(0, initializer_range) for
  matrices and embeddings, zero-centred RMSNorm weights 0 (scale 1 + w), the GDN output norm 1, A_log = log U(0.01,
  16), dt_bias 1, conv1d U(+-1/sqrt(W)), biases 0; the vision tower's LayerNorm weights 1. Each tensor from its own
  generator seeded by (--seed, its name): the same values whatever the shard plan (CPU and CUDA generators differ).
- generation_config.json: the one published with the sibling release Qwen/Qwen3.5-397B-A17B (the 35B-A3B's own
  was not found; a public copy of it is 244 bytes, 25 more than this one, so it holds a field more).
- preprocessor configs: Qwen/Qwen3.6-35B-A3B's published ones (the same processor classes).

--fp8 writes the layout of the official FP8 release, Qwen/Qwen3.5-35B-A3B-FP8, instead: DeepSeek-V3's block-wise
"fp8" scheme, as public copies of the Qwen3.5/3.6-35B-A3B-FP8 config.json and tensor names show it (a public mlx-lm
pull request, for one, counts the Qwen3.6 FP8 release's 30,720 per-expert weights of the main layers and their scales):
- config.json gains a top-level quantization_config: quant_method "fp8", fmt "e4m3", activation_scheme "dynamic",
  weight_block_size [128, 128], and modules_to_not_convert (`modules_to_not_convert`: lm_head, the embedding, in every
  layer, the MTP's too, the router, shared_expert_gate and linear_attn.in_proj_a/b, mtp.fc, the vision tower). Which
  modules these are follows the release's tensor dtypes as described; the exact names and order of the release's own
  list were not seen, and its scale dtype (BF16 here) neither: the reader takes F32 and BF16 scales alike.
- Every 2-D `.weight` of the text model and the MTP layer outside those modules (self_attn q/k/v/o_proj, linear_attn
  in_proj_qkv, in_proj_z and out_proj, the shared expert's and the routed experts' gate/up/down_proj) is float8_e4m3fn,
  with `<module>.weight_scale_inv` beside it: one scale per 128 x 128 block, (ceil(rows/128), ceil(cols/128)), in
  SCALE_DTYPE (models/qwen35_moe/fp8_layout.py: the quantized export writes the same layout). The main layers'
  routed experts are stored per expert, as the FP8 release stores them (`...mlp.experts.{e}.{gate,up,down}_proj.weight`,
  each with its scales; the BF16 release holds them fused), the MTP's per expert as in BF16.
- Everything else (embedding, lm_head, norms, routers, shared_expert_gate, in_proj_a/b, conv1d, A_log, dt_bias, the
  vision tower) is the BF16 folder's, byte for byte.
- Values: the BF16 folder's of the same seed, quantized: each weight drawn as the BF16 path draws it (an expert cut
  from its layer's fused tensor, which stays alive while that layer's experts are written: gate_up_proj and
  down_proj, 1.5 GiB in BF16 at full size) and quantized at once; its scales wait until their turn in the file.
- At full size: 64,196 tensors (1811 less the 80 fused expert tensors, plus 30,720 per-expert weights and 31,745
  scales), 37,454,799,072 bytes in 7 shards (the release is ~37 GB against the BF16 one's 72 GB).

    python scripts/make_release_checkpoint.py OUT [--seed 0] [--device cpu|cuda] [--small] [--fp8]
        [--text-config-overrides JSON] [--vision-config-overrides JSON] [--max-shard-bytes N] [--plan]

--small writes a tiny model of the same structure (4 layers in the release's pattern, 8 experts, one MTP layer, a
2-block vision tower; the release's vocabulary size, which the tokenizer's ids need). --plan prints the shards and
sizes without writing anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.cli_parser import OneLineParser  # noqa: E402
from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeStateDictAdapter  # noqa: E402
from models.qwen35_moe.fp8_blocks import BLOCK, FP8, quantize_blocks  # noqa: E402
from models.qwen35_moe.fp8_config import SCALE_SUFFIX  # noqa: E402
from models.qwen35_moe.fp8_layout import SCALE_DTYPE, Piece, fp8_tensor_specs, quantization_config  # noqa: E402
from models.qwen35_moe.hf_checkpoint import write_shard  # noqa: E402
from models.qwen35_moe.init import initial_value  # noqa: E402
from scripts.release_tokenizer import write_tokenizer  # noqa: E402

CHAT_TEMPLATE = REPO / "tests" / "data" / "qwen35_chat_template.jinja"  # the release's chat_template.jinja
INDEX_FILE = "model.safetensors.index.json"
SHARD_BYTES = 5 * 1024**3
F32_TENSORS = ("linear_attn.A_log", "linear_attn.norm.weight")  # the release's only F32 tensors

RELEASE_TEXT_CONFIG = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": "bfloat16",
    "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2, "output_router_logits": False,
    "pad_token_id": None, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "use_cache": True, "vocab_size": 248320,
}
RELEASE_VISION_CONFIG = {
    "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
    "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5_moe",
    "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2,
}
RELEASE_TOP_LEVEL = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "image_token_id": 248056, "model_type": "qwen3_5_moe",
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0", "video_token_id": 248057,
    "vision_end_token_id": 248054, "vision_start_token_id": 248053,
}
GENERATION_CONFIG = {"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044],
                     "pad_token_id": 248044, "temperature": 0.6, "top_k": 20, "top_p": 0.95,
                     "transformers_version": "4.57.0.dev0"}
_PROCESSOR = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
              "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor"}
PREPROCESSOR_CONFIG = {**_PROCESSOR, "size": {"longest_edge": 16777216, "shortest_edge": 65536},
                       "image_processor_type": "Qwen2VLImageProcessorFast"}
VIDEO_PREPROCESSOR_CONFIG = {**_PROCESSOR, "size": {"longest_edge": 25165824, "shortest_edge": 4096},
                             "video_processor_type": "Qwen3VLVideoProcessor"}

# --small: the release's structure at toy widths (rotary dim 32 * 0.25 = 8, so mrope_section sums to 4).
SMALL_TEXT = {"hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
              "linear_value_head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
              "shared_expert_intermediate_size": 32, "rope_parameters": {"mrope_section": [2, 1, 1]}}
SMALL_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                "num_position_embeddings": 64}


def release_config(text_overrides: dict | None = None, vision_overrides: dict | None = None) -> dict:
    """config.json: the release's, with fields of text_config / vision_config replaced. layer_types follows
    num_hidden_layers (every full_attention_interval-th layer full attention) unless given; rope_parameters is
    updated key by key, its partial_rotary_factor the top-level one (the release holds both); the vision output
    width follows the text width unless given."""
    text_overrides, vision_overrides = dict(text_overrides or {}), dict(vision_overrides or {})
    rope = {**RELEASE_TEXT_CONFIG["rope_parameters"], **text_overrides.pop("rope_parameters", {})}
    rope["partial_rotary_factor"] = text_overrides.get("partial_rotary_factor", rope["partial_rotary_factor"])
    text = {**RELEASE_TEXT_CONFIG, **text_overrides, "rope_parameters": rope}
    # Derived only from integer values; others are named by the model's args (tensor_specs), not failed on here.
    interval, layers = text["full_attention_interval"], text["num_hidden_layers"]
    if "layer_types" not in text and isinstance(interval, int) and isinstance(layers, int) and interval > 0:
        text["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                               for i in range(layers)]
    vision = {**RELEASE_VISION_CONFIG, "out_hidden_size": text["hidden_size"], **vision_overrides}
    return {**RELEASE_TOP_LEVEL, "text_config": text, "vision_config": vision}


def tensor_specs(config: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """{name: (dtype, shape)} of every tensor the release stores, for this config."""
    args = Qwen35MoeArgs.from_hf_config(config)
    adapter = Qwen35MoeStateDictAdapter(args)
    specs = {}
    for key, shape in adapter.expected_shapes.items():
        for hf_key, hf_shape in adapter.to_hf_shapes(key, shape).items():  # the text-only export's names
            name = "model.language_model." + hf_key.removeprefix("model.") if hf_key.startswith("model.") else hf_key
            specs[name] = (torch.float32 if name.endswith(F32_TENSORS) else torch.bfloat16, hf_shape)
    return specs | vision_specs(config["vision_config"])


def vision_specs(vision_config: dict) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The vision tower's tensors: transformers' module names (saved as they are) under `model.visual.`, BF16."""
    from transformers import Qwen3_5MoeVisionConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    try:
        config = Qwen3_5MoeVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
        with torch.device("meta"):
            tower = Qwen3_5MoeVisionModel(config)
    except Exception as e:  # transformers' validation errors are of its own types, over several lines
        raise ValueError(f"vision_config: {' '.join(str(e).split())}") from e
    return {f"model.visual.{k}": (torch.bfloat16, tuple(v.shape)) for k, v in tower.state_dict().items()}


def fp8_release_config(config: dict, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict:
    """config.json of the FP8 release: `config` with a top-level quantization_config (module docstring, --fp8)."""
    return {**config, "quantization_config": quantization_config(specs)}


def nbytes(spec: tuple[torch.dtype, tuple[int, ...]]) -> int:
    dtype, shape = spec
    return math.prod(shape) * dtype.itemsize


def plan_shards(specs: dict, max_shard_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """The release's split: tensors from the largest to the smallest (ties by name), each shard filled up to
    `max_shard_bytes` before the next is begun (a larger tensor gets a shard alone)."""
    shards, size = [[]], 0
    for name in sorted(specs, key=lambda k: (-nbytes(specs[k]), k)):
        if shards[-1] and size + nbytes(specs[name]) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes(specs[name])
    return shards


def shard_names(count: int) -> list[str]:
    return [f"model.safetensors-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def random_weights(config: dict, seed: int, device: str) -> Callable[[str, tuple], torch.Tensor]:
    """`make(name, (dtype, shape))`: the tensor's initial value (module docstring, "Values"), on `device`."""
    stds = {"text": config["text_config"]["initializer_range"], "vision": config["vision_config"]["initializer_range"]}

    def make(name: str, spec: tuple[torch.dtype, tuple[int, ...]]) -> torch.Tensor:
        dtype, shape = spec
        digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()  # salted hash() would differ per process
        generator = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        vision = name.startswith("model.visual.")
        if vision and re.search(r"\.norm\d*\.weight$", name):  # LayerNorms: y = norm(x) * w + b
            return torch.ones(shape, dtype=dtype, device=device)
        std = stds["vision" if vision else "text"]
        return initial_value(name, torch.Size(shape), std, generator).to(dtype)

    return make


def fp8_weights(specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], pieces: dict[str, Piece],
                make: Callable[[str, tuple], torch.Tensor]) -> Callable[[str, tuple], torch.Tensor]:
    """`make` for the FP8 layout (`fp8_tensor_specs`'s `pieces`) from `make` for the BF16 one (`specs`): a tensor is
    its piece of the BF16 value; a quantized weight is quantized as soon as it is drawn, its scales kept until they
    are asked for (after it: a smaller tensor, or the next name in the same shard; drawn again if asked first)."""
    scales = {}

    @functools.lru_cache(maxsize=2)  # a layer's fused gate_up_proj and down_proj: its experts alternate between them
    def fused(source: str) -> torch.Tensor:
        return make(source, specs[source])

    def value(name: str) -> torch.Tensor:
        piece = pieces[name]
        if piece.expert is None:
            return make(name, specs[name])
        return fused(piece.source)[piece.expert, piece.start:piece.stop]

    def make_fp8(name: str, spec: tuple[torch.dtype, tuple[int, ...]]) -> torch.Tensor:
        if name.endswith(SCALE_SUFFIX):
            if name in scales:
                return scales.pop(name)
            return quantize_blocks(value(name.removesuffix(SCALE_SUFFIX)), BLOCK, SCALE_DTYPE)[1]
        if spec[0] != FP8:
            return value(name)
        weight, scales[name + SCALE_SUFFIX] = quantize_blocks(value(name), BLOCK, SCALE_DTYPE)
        return weight

    return make_fp8


def write_weights(folder: Path, specs: dict, make: Callable[[str, tuple], torch.Tensor],
                  max_shard_bytes: int = SHARD_BYTES, log: Callable[[str], None] = print) -> int:
    """The shards and their index into `folder`, each tensor made by `make` when its turn to be written comes.
    Returns the bytes of tensors written."""
    shards = plan_shards(specs, max_shard_bytes)
    files = shard_names(len(shards))
    total, done, started = sum(map(nbytes, specs.values())), 0, time.perf_counter()
    log(f"writing {len(specs)} tensors, {total:,} bytes, in {len(files)} shards to {folder}")
    for file, names in zip(files, shards):
        write_shard(folder / file, {k: specs[k] for k in names}, ((k, make(k, specs[k])) for k in sorted(names)))
        done += sum(nbytes(specs[k]) for k in names)
        seconds = time.perf_counter() - started
        log(f"{file}: {len(names)} tensors; {done / 1e9:.2f} of {total / 1e9:.2f} GB in {seconds:.1f} s "
            f"({done / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
    weight_map = dict(sorted((name, file) for file, names in zip(files, shards) for name in names))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")  # after the shards: it names them
    return total


def write_release_checkpoint(folder: str | Path, config: dict, seed: int = 0, device: str = "cpu",
                             max_shard_bytes: int = SHARD_BYTES, log: Callable[[str], None] = print,
                             fp8: bool = False) -> int:
    """The whole folder, in the FP8 release's layout if `fp8`; returns the bytes of tensors written. `folder` must be
    new or empty."""
    folder = Path(folder)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise FileExistsError(f"{folder} exists and is not an empty folder: name a new folder for the checkpoint")
    specs = tensor_specs(config)  # a config the model refuses: before anything is written
    make = random_weights(config, seed, device)
    if fp8:
        config = fp8_release_config(config, specs)
        fp8_specs, pieces = fp8_tensor_specs(specs)
        specs, make = fp8_specs, fp8_weights(specs, pieces, make)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("config.json", config), ("generation_config.json", GENERATION_CONFIG),
                          ("preprocessor_config.json", PREPROCESSOR_CONFIG),
                          ("video_preprocessor_config.json", VIDEO_PREPROCESSOR_CONFIG)):
        (folder / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    write_tokenizer(folder, CHAT_TEMPLATE.read_text(encoding="utf-8"))
    started = time.perf_counter()
    total = write_weights(folder, specs, make, max_shard_bytes, log)
    seconds = time.perf_counter() - started
    log(f"wrote {len(specs)} tensors, {total:,} bytes, to {folder} in {seconds:.1f} s "
        f"({total / 1e6 / max(seconds, 1e-9):.0f} MB/s)")
    return total


def _arguments(a: argparse.Namespace) -> tuple[dict, dict, list[str]]:
    """The text and vision overrides, and every problem of the arguments (all named at once): not a JSON object,
    a field no config of the release has (a misspelt one would be written and never read), a shard size below 1."""
    problems, overrides = [], []
    known = {"text_config": {*RELEASE_TEXT_CONFIG, *(f.name for f in dataclasses.fields(Qwen35MoeArgs))},
             "vision_config": set(RELEASE_VISION_CONFIG)}
    for section, flag, text in (("text_config", "--text-config-overrides", a.text_config_overrides),
                                ("vision_config", "--vision-config-overrides", a.vision_config_overrides)):
        try:
            value = json.loads(text)
        except ValueError as e:
            value = None
            problems.append(f"{flag} is not JSON ({e}): {text!r}")
        else:
            if not isinstance(value, dict):
                value = None
                problems.append(f"{flag} must be a JSON object of {section} fields, got {text!r}")
        problems += [f"{section} has no field {k!r}" for k in value or {} if k not in known[section]]
        overrides.append(value or {})
    if a.max_shard_bytes < 1:
        problems.append(f"--max-shard-bytes must be positive, got {a.max_shard_bytes}")
    return overrides[0], overrides[1], problems


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the folder to write (new or empty)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where to draw the values (cuda: faster at full size)")
    parser.add_argument("--small", action="store_true", help="a tiny model of the same structure")
    parser.add_argument("--text-config-overrides", default="{}", metavar="JSON",
                        help="text_config fields to replace (after --small's)")
    parser.add_argument("--vision-config-overrides", default="{}", metavar="JSON",
                        help="vision_config fields to replace (after --small's)")
    parser.add_argument("--max-shard-bytes", type=int, default=SHARD_BYTES)
    parser.add_argument("--fp8", action="store_true", help="the layout of the FP8 release (Qwen3.5-35B-A3B-FP8)")
    parser.add_argument("--plan", action="store_true", help="print the shards and sizes; write nothing")
    a = parser.parse_args(argv)
    text_overrides, vision_overrides, problems = _arguments(a)
    if problems:
        print(f"error: {'; '.join(problems)}", file=sys.stderr)
        return 2
    text = {**(SMALL_TEXT if a.small else {}), **text_overrides}
    vision = {**(SMALL_VISION if a.small else {}), **vision_overrides}
    try:
        config = release_config(text, vision)
        if a.plan:
            specs = tensor_specs(config)
            if a.fp8:
                specs = fp8_tensor_specs(specs)[0]
            shards = plan_shards(specs, a.max_shard_bytes)
            for file, names in zip(shard_names(len(shards)), shards):
                print(f"{file}: {len(names)} tensors, {sum(nbytes(specs[k]) for k in names):,} bytes")
            print(f"{len(specs)} tensors, {sum(map(nbytes, specs.values())):,} bytes")
            return 0
        write_release_checkpoint(a.out, config, a.seed, a.device, a.max_shard_bytes, fp8=a.fp8)
    except (OSError, ValueError, TypeError) as e:  # a folder in use or out of reach; a config the model refuses
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
