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
