"""An FP8 export (`checkpoint.export_quantized fp8`) against the FP8 release's layout as
scripts/make_release_checkpoint.py --fp8 writes it for the same config: every tensor's name, dtype and shape from the
safetensors headers (no tensor is read), our text-only names for the release's `model.language_model.`, no vision
tower, dt_bias in F32 (docs/design.md: the export's one dtype change); and the quantization_config.

    python benchmarks/tools/fp8_layout_check.py /dev/shm/run/hf

Prints the counts and exits 1 naming the first differences, if any.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from models.qwen35_moe.hf_checkpoint import read_safetensors_header  # noqa: E402
from scripts.make_release_checkpoint import (  # noqa: E402
    RELEASE_TEXT_CONFIG,
    fp8_tensor_specs,
    quantization_config,
    release_config,
    tensor_specs,
)

NAMES = {"torch.bfloat16": "BF16", "torch.float32": "F32", "torch.float8_e4m3fn": "F8_E4M3"}


def headers(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{key: (dtype, shape)} of every safetensors file of `folder`, from their headers alone."""
    return {key: (entry["dtype"], tuple(entry["shape"])) for path in sorted(folder.glob("*.safetensors"))
            for key, entry in read_safetensors_header(path).items()}


def main(folder: Path) -> int:
    config = json.loads((folder / "config.json").read_text())
    text = {k: v for k, v in config.items() if k in RELEASE_TEXT_CONFIG or k == "layer_types"}
    bf16 = tensor_specs(release_config(text))
    release, _ = fp8_tensor_specs(bf16)
    rename = {"model.language_model.": "model."}
    expected = {}
    for name, (dtype, shape) in release.items():
        if name.startswith("model.visual."):
            continue
        dtype = "F32" if name.endswith("linear_attn.dt_bias") else NAMES[str(dtype)]
        for old, new in rename.items():
            name = name.replace(old, new, 1)
        expected[name] = (dtype, tuple(shape))
    ours = headers(folder)
    differ = sorted(k for k in ours.keys() | expected.keys() if ours.get(k) != expected.get(k))
    quant = quantization_config({k.replace("model.language_model.", "model.", 1): v for k, v in bf16.items()
                                 if not k.startswith("model.visual.")})
    fp8 = sum(dtype == "F8_E4M3" for dtype, _ in ours.values())
    print(f"{folder}: {len(ours)} tensors ({fp8} float8, {sum(k.endswith('_scale_inv') for k in ours)} scales), the "
          f"release layout {len(expected)}; {len(differ)} differ; quantization_config "
          f"{'as the release' if config.get('quantization_config') == quant else 'DIFFERS'}")
    for key in differ[:10]:
        print(f"  {key}: ours {ours.get(key)}, the release's {expected.get(key)}")
    return 1 if differ or config.get("quantization_config") != quant else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the FP8 export (an HF folder)")
    folder = parser.parse_args().folder
    if not (folder / "config.json").is_file():
        parser.error(f"{folder} holds no config.json: not an HF folder")
    sys.exit(main(folder))
