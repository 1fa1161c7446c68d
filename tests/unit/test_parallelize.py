"""Activation checkpointing changes memory, not math, and not the checkpoint keys; selective checkpointing
recomputes the elementwise work but none of the matmuls."""

import copy
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from models.qwen35_moe import get_flavor
from parallel.parallelize import parallelize_qwen35_moe
from tests.builders import initialized_model


def _model():
    return initialized_model(get_flavor("debugmodel"))


def _loss_and_grads(model, ids, positions):
    out = model(ids, positions)
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _checkpointed(model, mode: str):
    return parallelize_qwen35_moe(model, None, param_dtype=None, reduce_dtype=None, ac_mode=mode, compile=False)


def _assert_sharded_grads_match(sharded, plain):
    """Every parameter's gradient of an FSDP model (DTensors; the GDN layers' fp32 parameters whole, plain tensors)
    against the same model run whole, in fp32."""
    from torch.distributed.tensor import DTensor

    plain_params = dict(plain.named_parameters())
    for name, param in sharded.named_parameters():
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        torch.testing.assert_close(grad, plain_params[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def _whole_param_names(model) -> set[str]:
    """What FSDP leaves whole on every rank: the GDN layers' fp32 parameters (docs/design.md, fp32 contract) and
    the final norm's weight."""
    from models.qwen35_moe.fp32_contract import Fp32ParamsModule

    return {"norm.weight", *(f"{name}.{pname}" for name, module in model.named_modules()
                             if isinstance(module, Fp32ParamsModule) for pname, _ in module.named_parameters())}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_keeps_loss_grads_and_keys(mode):
    plain = _model()
    wrapped = _checkpointed(copy.deepcopy(plain), mode)
    assert list(wrapped.state_dict()) == list(plain.state_dict())

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 96), generator=g)
    positions = torch.cat((torch.arange(40), torch.arange(56))).expand(2, 96)
    loss_a, grads_a = _loss_and_grads(plain, ids, positions)
    loss_b, grads_b = _loss_and_grads(wrapped, ids, positions)
    # The recomputed forward is the same fp32 CPU computation: equal up to summation order.
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-7, msg=name)


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode: str) -> Counter:
    """The aten ops the backward of one step runs (a recompute runs forward ops inside the backward)."""
    model = _checkpointed(_model(), mode)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2, 64), generator=g)
    out = model(ids)
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()) + 0.01 * out.aux_loss
    with _OpCounter() as counter:
        loss.backward()
    return counter.counts


def test_selective_checkpointing_recomputes_elementwise_work_but_no_matmul():
    none, full, selective = _backward_ops("none"), _backward_ops("full"), _backward_ops("selective")
    matmuls = ("mm", "addmm", "bmm")
    assert sum(full[op] for op in matmuls) > sum(none[op] for op in matmuls)  # full reruns every projection
    assert sum(selective[op] for op in matmuls) == sum(none[op] for op in matmuls)  # selective reruns none
    # ... but recomputes what lies between them: activations, gates, norms.
    for op in ("silu", "sigmoid", "rsqrt"):
        assert none[op] < selective[op] <= full[op], (op, none[op], selective[op], full[op])


@pytest.mark.parametrize("mode", ["default", "never", "kept later"])
def test_fsdp_reshard_after_forward_keeps_or_frees_gathered_weights(one_rank_mesh, mode):
    """`parallelism.fsdp_reshard_after_forward = "never"`: between forward and backward the blocks hold their
    gathered (plain tensor) weights, not their shards (DTensors); the gradients are the same either way. "kept
    later" is what "auto" does where the weights fit: units built to free them keep them from then on
    (parallel/reshard_policy.py)."""
    from torch.distributed.tensor import DTensor

    from parallel.parallelize import apply_fsdp, reshard_fsdp, resharding_units
    from parallel.reshard_policy import keep_gathered_weights

    plain = _model()
    model = copy.deepcopy(plain)
    apply_fsdp(model, one_rank_mesh, None, None, reshard_after_forward=mode != "never")
    # the units built to free their weights: every block but the last, and the first block's experts (a unit of its own)
    layers = list(model.layers.values())
    assert resharding_units(model) == [layers[0].mlp.experts, *layers[:-1]]
    if mode == "kept later":
        keep_gathered_weights(resharding_units(model))
    reshard = mode == "default"
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(64).expand(1, 64)
    sharded = lambda: isinstance(model.layers["0"].mlp.shared_expert.up_proj.weight, DTensor)  # noqa: E731
    out = model(ids, positions)
    assert sharded() == reshard
    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten())
    loss.backward()
    assert sharded()  # resharded after backward
    # A forward without backward (validation) leaves them gathered until reshard_fsdp: a state dict (checkpoint)
    # must hold the fp32 shards.
    with torch.no_grad():
        model(ids, positions)
    assert sharded() == reshard
    reshard_fsdp(model)
    whole = _whole_param_names(model)
    assert whole and all(isinstance(value, DTensor) != (key in whole) for key, value in model.state_dict().items())
    ref = F.cross_entropy(plain(ids, positions).logits.flatten(0, 1), ids.roll(-1, dims=1).flatten())
    ref.backward()
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    _assert_sharded_grads_match(model, plain)


def test_fsdp_units_keep_gathered_what_backward_needs_first_and_never_gather_the_embedding(one_rank_mesh):
    """apply_fsdp's units, seen from which weights are gathered (plain tensors) or sharded (DTensors) when:
    after forward the last block and the lm_head stay gathered (their backward comes first), the other blocks
    (the first one's experts a unit of their own) and the embedding are resharded; in backward the embedding is
    never gathered (its lookup's backward needs only the ids), yet its gradient is the plain model's; after
    backward everything is sharded again, except each GDN layer's fp32 parameters and the final norm's weight,
    which FSDP never shards."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from parallel.parallelize import apply_fsdp

    plain = _model()
    model = copy.deepcopy(plain)
    apply_fsdp(model, one_rank_mesh, None, None)
    gathered = lambda param: not isinstance(param, DTensor)  # noqa: E731
    embedding_in_backward = []

    def watch_backward(module, args, out):  # returns None: a forward hook's return value would replace the output
        out.register_hook(lambda grad: embedding_in_backward.append(gathered(model.embed_tokens.weight)))
    model.embed_tokens.register_forward_hook(watch_backward)
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(64).expand(1, 64)
    out = model(ids, positions)

    *blocks, last = model.layers.values()
    assert gathered(last.input_layernorm.weight) and gathered(model.lm_head.weight)
    assert not any(gathered(block.input_layernorm.weight) for block in blocks)
    assert not gathered(model.embed_tokens.weight)
    gdn = [layer.linear_attn for layer in model.layers.values() if hasattr(layer, "linear_attn")]
    assert gdn and all(gathered(m._fp32_params.A_log) and gathered(m.norm.weight) for m in gdn)  # never sharded
    # The first block's experts are a unit of their own (their reduction overlaps that block's attention backward),
    # resharded with it; the other blocks' experts are part of their block's unit.
    experts = [layer.mlp.experts for layer in model.layers.values()]
    assert isinstance(experts[0], FSDPModule) and not any(isinstance(e, FSDPModule) for e in experts[1:])
    assert blocks and not gathered(experts[0].gate_up_proj)

    loss = F.cross_entropy(out.logits.flatten(0, 1), ids.roll(-1, dims=1).flatten())
    loss.backward()
    assert embedding_in_backward == [False]
    whole = _whole_param_names(model)
    assert all(isinstance(param, DTensor) != (name in whole) for name, param in model.named_parameters())
    F.cross_entropy(plain(ids, positions).logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()).backward()
    _assert_sharded_grads_match(model, plain)


def test_fsdp_keeps_tied_embeddings_one_parameter_in_the_root(one_rank_mesh):
    """tie_word_embeddings under apply_fsdp: the shared weight stays one parameter (in the root unit, not split
    into the embedding's and the lm_head's units), and its gradient, the sum of both uses, is the plain model's."""
    import dataclasses

    from parallel.parallelize import apply_fsdp

    plain = initialized_model(dataclasses.replace(get_flavor("debugmodel"), tie_word_embeddings=True))
    assert plain.lm_head.weight is plain.embed_tokens.weight
    model = copy.deepcopy(plain)
    apply_fsdp(model, one_rank_mesh, None, None)
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = torch.randint(0, 512, (1, 64), generator=torch.Generator().manual_seed(4))
    positions = torch.arange(64).expand(1, 64)
    for m in (model, plain):
        F.cross_entropy(m(ids, positions).logits.flatten(0, 1), ids.roll(-1, dims=1).flatten()).backward()
    _assert_sharded_grads_match(model, plain)  # the tied weight's among them


def test_one_rank_without_fsdp_computes_as_fsdp_bf16_mixed_precision(one_rank_mesh):
    """One GPU runs without FSDP (parallelize with no mesh and a param_dtype): fp32 weights cast where they are
    used. Reference: FSDP2's bf16 mixed precision on a one-rank mesh, which the trainer used before. Same bf16
    values in the same ops, so the loss and every block's gradient are bitwise FSDP's; the embedding's and
    lm_head's gradients only differ in rounding: without FSDP they are summed in fp32 (the table's scatter-add,
    the cross entropy's fp32 product) instead of being rounded to bf16 on the way."""
    from torch.distributed.tensor import DTensor

    from parallel.parallelize import apply_fsdp, parallelize_qwen35_moe

    plain = _model()
    fsdp, ours = copy.deepcopy(plain), copy.deepcopy(plain)
    apply_fsdp(fsdp, one_rank_mesh, torch.bfloat16, torch.float32)
    parallelize_qwen35_moe(ours, None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode="none",
                           compile=False)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 512, (2, 64), generator=gen)
    positions = torch.cat((torch.arange(40), torch.arange(24))).expand(2, 64)  # packed documents

    def loss_and_grads(model):
        out = model(ids, positions, labels=ids.roll(-1, dims=1), loss_chunk_tokens=48)
        loss = out.ce_sum / ids.numel() + 0.01 * out.aux_loss
        loss.backward()
        full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
        return loss, {n: full(p.grad) for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads(fsdp)
    loss, grads = loss_and_grads(ours)
    assert all(p.dtype == torch.float32 and not isinstance(p, DTensor) for p in ours.parameters())
    assert ours.state_dict().keys() == plain.state_dict().keys()
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    summed_in_fp32 = ("embed_tokens.weight", "lm_head.weight")
    for name, grad in grads.items():
        assert grad.dtype == torch.float32, name
        if name in summed_in_fp32:
            rel = ((grad - ref_grads[name]).norm() / ref_grads[name].norm()).item()
            assert 0 < rel < 1e-2, (name, rel)
        else:
            assert torch.equal(grad, ref_grads[name]), name


def test_kept_weight_copies_compute_as_the_casts_and_follow_every_change_of_the_weights():
    """One GPU reads its bf16 weights from kept copies (parallel/one_device_precision.py) instead of casting them at
    each use. Reference: the same model casting (the test above ties that to FSDP's bf16 policy). The loss and every
    gradient are bitwise the cast's, fp32 gradients included; the copies are not in the state dict; an in-place
    change of the weights (a state-dict load, the checkpointer's `set_model_state_dict`, an optimizer's step) is
    picked up by the next forward; and `.to()`, which may replace the parameters, remakes the copies of the new ones."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    from parallel.parallelize import parallelize_qwen35_moe

    cast, kept = _model(), _model()
    for model, copies in ((cast, False), (kept, True)):
        parallelize_qwen35_moe(model, None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode="none",
                               compile=False, weight_copies=copies)
    assert kept.state_dict().keys() == cast.state_dict().keys()
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 512, (2, 64), generator=gen)
    positions = torch.cat((torch.arange(40), torch.arange(24))).expand(2, 64)

    def loss_and_grads(model):
        model.zero_grad()
        out = model(ids, positions, labels=ids.roll(-1, dims=1), loss_chunk_tokens=48)
        loss = out.ce_sum / ids.numel() + 0.01 * out.aux_loss
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters()}

    def assert_same():
        (loss, grads), (want_loss, want_grads) = loss_and_grads(kept), loss_and_grads(cast)
        assert torch.equal(loss, want_loss)
        for name, grad in grads.items():
            assert grad.dtype == torch.float32 and torch.equal(grad, want_grads[name]), name

    assert_same()
    assert len(kept.mixed_precision.pairs) > 10  # made by the first forward
    moved = {k: v + 0.01 * torch.randn_like(v) for k, v in cast.state_dict().items()}
    for model in (cast, kept):
        model.load_state_dict(moved)
    assert_same()
    moved = {k: v - 0.02 * torch.randn_like(v) for k, v in cast.state_dict().items()}
    for model in (cast, kept):  # the checkpointer's resume path (harness/checkpoint/checkpointer.py)
        set_model_state_dict(model, moved)
    assert_same()
    for model in (cast, kept):
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(1e-3 * p.grad)  # an optimizer's in-place step
    assert_same()
    kept.to(torch.float64).to(torch.float32)  # the values survive the round trip; the copies are remade
    assert_same()
    params = {id(p) for p in kept.parameters()}
    assert all(id(weight) in params for weight, _ in kept.mixed_precision.pairs)


def test_kept_copies_holding_the_gradients_hold_the_casts_gradients_and_step_as_with_them():
    """grads_in_copies (one GPU, one backward per step): the copies are the leaves autograd differentiates, so each
    copied weight's gradient stays bf16 in its copy. Reference: the model that casts its weights, whose fp32
    gradients are the cast's backward, an upcast of the same bf16 product. So the loss is bitwise the cast's, each
    copy's gradient upcast is bitwise the cast model's fp32 gradient (the weight itself gets none), the other
    gradients are equal, the global norm (fp32 accumulation either way) lands within fp32 rounding, and one
    clipped FastAdam step (torch's ops on CPU, upcasting the bf16 gradient) leaves bitwise the same weights;
    zero_grad clears the copies' gradients."""
    from harness.optim.fast_adam import FastAdam
    from parallel.grad_norm import clip_grad_norm_
    from parallel.one_device_precision import gradient_holders, weight_copies_of
    from parallel.parallelize import parallelize_qwen35_moe

    cast, kept = _model(), _model()
    for model, copies in ((cast, False), (kept, True)):
        parallelize_qwen35_moe(model, None, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ac_mode="none",
                               compile=False, weight_copies=copies, grads_in_copies=copies)
    copies = weight_copies_of(kept)
    optimizers = {m: FastAdam([{"params": list(m.parameters()), "weight_decay": 0.1}], lr=1e-2, betas=(0.9, 0.95),
                              eps=1e-8, weight_copies=weight_copies_of(m)) for m in (cast, kept)}
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 512, (2, 64), generator=gen)
    positions = torch.cat((torch.arange(40), torch.arange(24))).expand(2, 64)
    losses, norms = {}, {}
    for model in (cast, kept):
        optimizers[model].zero_grad()
        out = model(ids, positions, labels=ids.roll(-1, dims=1), loss_chunk_tokens=48)
        losses[model] = out.ce_sum / ids.numel() + 0.01 * out.aux_loss
        losses[model].backward()
    assert torch.equal(losses[kept], losses[cast])
    copied = {id(weight) for weight, _ in copies.pairs}
    lm_head = id(kept.lm_head.weight)  # the loss returns its fp32 gradient itself (linear_cross_entropy.py)
    for (name, p), q in zip(kept.named_parameters(), cast.parameters()):
        grad = copies.grad_of(p)
        if id(p) in copied and id(p) != lm_head:
            assert p.grad is None and grad.dtype == torch.bfloat16, name
        else:
            assert grad.dtype == torch.float32, name
        assert torch.equal(grad.float(), q.grad), name
    for model in (cast, kept):
        norms[model] = clip_grad_norm_(gradient_holders(model), 0.5, scaling_optimizer=optimizers[model])
        optimizers[model].step()
    torch.testing.assert_close(norms[kept], norms[cast], rtol=1e-6, atol=0)
    assert norms[cast] > 0.5  # the clipping acted
    for (name, p), q in zip(kept.named_parameters(), cast.parameters()):
        assert torch.equal(p, q), name
    optimizers[kept].zero_grad()
    assert all(copy.grad is None for _, copy in copies.pairs)


def test_vocab_parallel_auto_takes_it_where_it_moves_fewer_bytes_than_fsdp():
    from parallel.vocab_parallel import resolve_vocab_parallel, vocab_rows

    assert resolve_vocab_parallel("auto", 248_320, 2, 8192)  # 16k tokens travel, not two 248k-row matrices
    assert not resolve_vocab_parallel("auto", 248_320, 8, 32_768)  # 262k tokens per group > 248k rows
    assert resolve_vocab_parallel("always", 248_320, 8, 32_768)
    assert not resolve_vocab_parallel("never", 248_320, 2, 8192)
    assert not resolve_vocab_parallel("auto", 512, 1, 8)  # one shard per replica: nothing to split
    assert vocab_rows(509, 2, 0) == (0, 255) and vocab_rows(509, 2, 1) == (255, 509)  # DTensor's Shard(0) chunks
    assert vocab_rows(5, 4, 3) == (5, 5)  # chunks of 2: the last rank's is empty
    assert not resolve_vocab_parallel("auto", 5, 4, 1)
    with pytest.raises(ValueError, match="empty slice"):
        resolve_vocab_parallel("always", 5, 4, 1)
