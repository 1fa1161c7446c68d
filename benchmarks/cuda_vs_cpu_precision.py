"""How far the CUDA path (FLA, grouped GEMM, varlen attention) lands from the CPU fp32 reference, next to
how far plain bf16 on the CPU reference path lands: tells kernel error from bf16 precision loss."""

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.gpu.test_model_cuda import ARGS, _rel, build_reference_model  # noqa: E402

model = build_reference_model()
g = torch.Generator().manual_seed(5)
ids = torch.randint(0, ARGS.vocab_size, (2, 256), generator=g)
packed = torch.cat((torch.arange(100), torch.arange(156))).expand(2, 256)
variants = {
    "cpu bf16": copy.deepcopy(model).to(torch.bfloat16),
    "cuda fp32": copy.deepcopy(model).cuda(),
    "cuda bf16": copy.deepcopy(model).to("cuda", torch.bfloat16),
}
with torch.no_grad():
    for pos_name, pos in (("one document per row", None), ("packed rows", packed)):
        ref = model(ids, pos).logits
        for name, m in variants.items():
            dev = next(m.parameters()).device
            out = m(ids.to(dev), None if pos is None else pos.to(dev)).logits
            print(f"{pos_name:22s} {name:10s} rel logits error vs cpu fp32: {_rel(out, ref):.2e}")
