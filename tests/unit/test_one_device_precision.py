"""One GPU's mixed precision (parallel/one_device_precision.py): the kept bf16 copies read in place of the casts are
those of the model's current weights, whenever and however the weights were made, and compiled code reads them as
it reads module buffers, in one graph, recast without a recompile. Reference: the same model casting its weights
where it uses them (tests/unit/test_parallelize.py ties that to FSDP's bf16 policy), bitwise."""

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter

from models.qwen35_moe import Qwen35MoeModel, get_flavor, moe
from models.qwen35_moe.linear import Linear
from parallel.one_device_precision import OneDevicePrecision
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import experts_in_one_graph

IDS = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(6))
POSITIONS = torch.cat((torch.arange(40), torch.arange(24))).expand(2, 64)


def _loss(model: nn.Module) -> torch.Tensor:
    out = model(IDS, POSITIONS, labels=IDS.roll(-1, dims=1), loss_chunk_tokens=48)
    return out.ce_sum / IDS.numel() + 0.01 * out.aux_loss


def _kept_and_cast_on_meta() -> tuple[Qwen35MoeModel, Qwen35MoeModel]:
    """Two models parallelized on the meta device, as build_model does, one reading kept copies, one casting."""
    models = []
    for copies in (True, False):
        with torch.device("meta"):
            model = Qwen35MoeModel(get_flavor("debugmodel"))
        parallelize_qwen35_moe(model, None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode="none",
                               compile=False, weight_copies=copies)
        models.append(model)
    return models[0], models[1]


def test_copies_of_weights_materialised_after_the_hook_was_set_are_made_by_the_first_forward():
    kept, cast = _kept_and_cast_on_meta()
    for model in (kept, cast):
        model.to_empty(device="cpu")  # new parameter objects, the hook's readers already set
        model.init_weights(0)
    assert kept.mixed_precision.pairs == []
    assert torch.equal(_loss(kept), _loss(cast))
    matrices = [p for m in kept.modules() if isinstance(m, (Linear, moe.RoutedExperts))
                for p in m.parameters(recurse=False) if p.ndim >= 2]
    weights = [weight for weight, _ in kept.mixed_precision.pairs]
    assert len(weights) == len(matrices) and all(w is p for w, p in zip(weights, matrices))
    assert all(copy.dtype == torch.bfloat16 and torch.equal(copy, w.detach().bfloat16())
               for w, copy in kept.mixed_precision.pairs)
    with torch.no_grad():  # the forward reads the copies: one changed behind the hook's back changes the loss
        kept.mixed_precision.copy_of(kept.layers["0"].mlp.shared_expert.up_proj.weight).zero_()
    assert not torch.equal(_loss(kept), _loss(cast))


def test_a_weight_replaced_or_given_new_storage_gets_a_new_copy():
    """Neither moves the weight's version counter: a new parameter (an assignment, `to_empty`, a `.to()` to another
    device) and new storage under the same parameter (`.data`, as `.to()` within a device does)."""
    kept, cast = _kept_and_cast_on_meta()
    for model in (kept, cast):
        model.to_empty(device="cpu")
        model.init_weights(0)
    assert torch.equal(_loss(kept), _loss(cast))
    gen = torch.Generator().manual_seed(7)
    replacement = torch.randn(kept.layers["0"].mlp.shared_expert.up_proj.weight.shape, generator=gen)
    new_values = torch.randn(kept.lm_head.weight.shape, generator=gen)
    for model in (kept, cast):
        model.layers["0"].mlp.shared_expert.up_proj.weight = nn.Parameter(replacement.clone())
    assert torch.equal(_loss(kept), _loss(cast))
    for model in (kept, cast):
        model.lm_head.weight.data = new_values.clone()
    assert torch.equal(_loss(kept), _loss(cast))


@pytest.mark.parametrize("grads_in_copies", [False, True])
def test_compiled_code_reads_the_copies_in_one_graph_and_recasts_need_no_recompile(monkeypatch, grads_in_copies):
    """A Linear and the routed experts (as one traceable computation, as on the GPU) compiled with fullgraph: the
    readers break no graph, and three steps with in-place updates between them (the copies recast) run the one
    compiled frame. Loss and gradients bitwise those of the casts."""
    monkeypatch.setattr(moe.RoutedExperts, "forward", experts_in_one_graph)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = Linear(16, 16, bias=False)
            self.experts = moe.RoutedExperts(4, 16, 8)

        def forward(self, x, counts):
            return self.experts(self.proj(x), counts)

    torch.manual_seed(0)
    kept, cast = Block(), Block()
    for p in kept.parameters():
        nn.init.normal_(p, std=0.5)
    cast.load_state_dict(kept.state_dict())
    precision = OneDevicePrecision(torch.bfloat16, grads_in_copies=grads_in_copies)
    kept.proj.weight_reader, kept.experts.weight_reader = precision.reader(kept.proj), precision.reader(kept.experts)
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(kept, backend=counter, fullgraph=True)
    x, counts = torch.randn(12, 16).bfloat16(), torch.tensor([3, 0, 5, 4])
    for step in range(3):
        precision.before_forward()
        precision.zero_grad()
        kept.zero_grad()
        cast.zero_grad()
        loss, want = compiled(x, counts).float().square().sum(), cast(x, counts).float().square().sum()
        loss.backward()
        want.backward()
        assert torch.equal(loss, want), step
        holders = [precision.grad_of(p) for p in kept.parameters()]
        assert all(torch.equal(g.float(), p.grad) for g, p in zip(holders, cast.parameters())), step
        with torch.no_grad():
            for model in (kept, cast):
                for p in model.parameters():
                    p.sub_(0.01 * p.detach().sign())  # an optimizer's in-place step: the copies are recast
    assert counter.frame_count == 1
    assert all(copy.requires_grad == grads_in_copies for _, copy in precision.pairs)
    torch._dynamo.reset()
