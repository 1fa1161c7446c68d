"""Model construction shared by the tests: the meta -> materialise -> init path the trainer takes."""

from pathlib import Path

import torch
import torch.nn.functional as F

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel

# The debug model with the release's layer pattern (3 Gated DeltaNet layers, then full attention), for tests that need
# several blocks of one kind; `--model.hf_config` takes it too.
DEBUGMODEL_4_LAYERS = Path(__file__).resolve().parent / "data" / "debugmodel_4_layers.json"


def debugmodel_4_layers() -> Qwen35MoeArgs:
    return Qwen35MoeArgs.from_hf_config(DEBUGMODEL_4_LAYERS)


def initialized_model(args: Qwen35MoeArgs, seed: int = 0) -> Qwen35MoeModel:
    """An fp32 CPU model with the HF-like init, reproducible from `seed`."""
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    model.to_empty(device="cpu")
    model.init_weights(seed)
    return model


# Gradients of the GDN decay parameters sum dg over every token, terms that largely cancel (|sum| << sum of
# |terms|), so fp32 summation-order noise is amplified there: measured up to 3.6e-5 relative between the same
# batch run whole and in two halves, where every other parameter stays below 1e-6.
DECAY_PARAMS = ("A_log", "dt_bias", "in_proj_a.weight")


def fp32_grad_tolerance(name: str) -> float:
    """Relative tolerance for a parameter's gradient between two fp32 CPU runs that sum in different orders."""
    return 1e-4 if name.endswith(DECAY_PARAMS) else 1e-5


def experts_in_one_graph(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """A stand-in for `RoutedExperts.forward` (patch it onto the class): the routed experts as one traceable
    computation, as the GPU's grouped GEMMs are (the CPU reference loops over the experts on the host, a graph
    break): each row computed with its expert's weights, gathered. Exact in fp32."""
    gate_up, down = self._weights(x.dtype)
    expert = torch.searchsorted(counts.cumsum(0), torch.arange(x.shape[0]), right=True).clamp(max=len(counts) - 1)
    gate, up = torch.bmm(gate_up[expert], x.unsqueeze(-1)).chunk(2, dim=1)
    return torch.bmm(down[expert], F.silu(gate) * up).squeeze(-1).clone()  # a view would trip FSDP's output check


def compile_blocks(model: Qwen35MoeModel) -> Qwen35MoeModel:
    """compile.enable on one process: each block runs compiled (parallel/compile.py), nothing else changes."""
    from parallel.parallelize import parallelize_qwen35_moe

    return parallelize_qwen35_moe(model, None, param_dtype=None, reduce_dtype=None, ac_mode="none", compile=True)


# Modules an FP8 release keeps unquantized, as the release's own modules_to_not_convert lists them (embedding,
# lm_head, router, shared expert gate, Gated DeltaNet's per-head projections, the MTP layer's fc); norms, conv1d, A_log and dt_bias are
# not Linear weights and stay as they are too.
FP8_KEPT = ("model.embed_tokens", "lm_head", "model.layers.*.mlp.gate", "model.layers.*.mlp.shared_expert_gate",
            "model.layers.*.linear_attn.in_proj_a", "model.layers.*.linear_attn.in_proj_b", "mtp.fc",
            "mtp.layers.*.mlp.gate", "mtp.layers.*.mlp.shared_expert_gate")


def fp8_release_folder(source: Path, folder: Path, scale_dtype: torch.dtype = torch.float32) -> Path:
    """The text-only HF folder `source` (an export of ours) rewritten in the FP8 release's layout: the routed experts
    per expert, every 2-D Linear weight outside FP8_KEPT as float8_e4m3fn with its `weight_scale_inv` (128 x 128
    blocks), config.json's quantization_config. Quantized by the format's definition (amax / 448 per block), written
    here apart from models/qwen35_moe/fp8_blocks.py so that tests of the reader check it against another hand."""
    import json
    import re
    import shutil
    from fnmatch import fnmatchcase

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    tensors = {}
    for shard in source.glob("*.safetensors"):
        tensors.update(load_file(shard))
    split = {}
    for key, value in tensors.items():
        fused = re.match(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$", key)
        if fused is None:
            split[key] = value
            continue
        for e in range(value.shape[0]):
            if fused.group(2) == "gate_up_proj":
                gate, up = value[e].chunk(2)
                split[f"{fused.group(1)}.{e}.gate_proj.weight"] = gate.contiguous()
                split[f"{fused.group(1)}.{e}.up_proj.weight"] = up.contiguous()
            else:
                split[f"{fused.group(1)}.{e}.down_proj.weight"] = value[e].contiguous()
    written = {}
    for key, value in split.items():
        module = key.removesuffix(".weight")
        if value.ndim != 2 or not key.endswith(".weight") or any(fnmatchcase(module, m) for m in FP8_KEPT):
            written[key] = value
            continue
        rows, cols = value.shape
        w = value.double()
        scales = torch.ones(-(-rows // 128), -(-cols // 128), dtype=torch.float64)
        for i in range(scales.shape[0]):
            for j in range(scales.shape[1]):
                amax = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
                if amax > 0:
                    scales[i, j] = amax / 448
        scales = scales.to(scale_dtype)
        per_element = scales.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        written[key] = (w / per_element).clamp(-448, 448).to(torch.float8_e4m3fn)
        written[key + "_scale_inv"] = scales
    save_file(written, folder / "model.safetensors")
    for extra in source.iterdir():
        if not extra.name.startswith("model.safetensors"):
            shutil.copy(extra, folder / extra.name)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128], "modules_to_not_convert": list(FP8_KEPT)}
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def fp8_reference(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """W = fp8 value x its block's scale, in float64, blocks of 128 cut at the edges (the format's definition)."""
    rows, cols = weight.shape
    per_element = scale_inv.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return weight.double() * per_element


def dequantized_folder(fp8: Path, folder: Path) -> Path:
    """The FP8 release folder `fp8` (fp8_release_folder's) as an unquantized folder of the same weights: each float8
    weight dequantized by the float64 definition (`fp8_reference`) and stored in fp32, the scales and the config's
    quantization_config dropped, the other files copied."""
    import json

    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    stored = load_file(fp8 / "model.safetensors")
    save_file({k: fp8_reference(v, stored[k + "_scale_inv"]).float() if v.dtype == torch.float8_e4m3fn else v
               for k, v in stored.items() if not k.endswith("_scale_inv")}, folder / "model.safetensors")
    for extra in fp8.iterdir():
        if extra.name not in ("model.safetensors", "config.json"):
            (folder / extra.name).write_bytes(extra.read_bytes())
    config = json.loads((fp8 / "config.json").read_text())
    del config["quantization_config"]
    (folder / "config.json").write_text(json.dumps(config))
    return folder
