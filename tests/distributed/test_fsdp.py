"""Parallel layouts on CPU ranks (gloo) against one process, through the trainer and the real data pipeline:
FSDP and HSDP on 2 ranks (the embedding and the lm_head vocabulary-parallel, and as FSDP units), HSDP 2 x 2,
context parallelism on 2 ranks and CP=2 x FSDP=2 on 4, expert parallelism on 2 and 4 ranks alone and with FSDP,
HSDP and CP. The same seed gives the same initial weights, and the same global batch
gives the same loss, MoE balance loss, validation loss and gradients, whatever the layout (in float64, where only
summation order differs).

Every layout is a run of the shared launches (tests/distributed/launch.py): the layouts of 2 ranks run one after the
other in one launch, those of 4 in another, the one-process references in one plain process."""

import dataclasses
import json

import pytest
import torch

from models.qwen35_moe import get_flavor
from tests.distributed.launch import Run, register
from tests.distributed.trainer_runs import assert_same_grads

STEP = "tests.distributed.fsdp_step_worker:step"
SKEWED = "--skewed-routing"
NO_BALANCE_LOSS = ("--training.aux_loss_coef", "0")
TIED = ("--model.hf_config", "{folder}/config.json")  # written by write_tied_uneven_config


def write_tied_uneven_config(folder) -> None:
    """The debug model with tied embeddings and a 509-row vocabulary (split unevenly over 2 ranks: 255 + 254)."""
    config = dataclasses.replace(get_flavor("debugmodel"), tie_word_embeddings=True, vocab_size=509).to_hf_config()
    (folder / "config.json").write_text(json.dumps(config))


SINGLE = register(Run("fsdp/single", 1, STEP))
# One process with unbalanced routing: experts 0 and 1 get no token, expert 2 some (the worker's `skewed_router`).
SINGLE_SKEWED = register(Run("fsdp/single_skewed", 1, STEP, (SKEWED,)))
SINGLE_WITHOUT_BALANCE_LOSS = register(Run("fsdp/single_no_balance", 1, STEP, NO_BALANCE_LOSS))
SINGLE_TIED = register(Run("fsdp/single_tied", 1, STEP, TIED, write_tied_uneven_config))

LAYOUTS = {  # name: (processes, config overrides)
    "fsdp2": (2, []),
    "hsdp2": (2, ["--parallelism.data_parallel_replicate_degree", "2"]),
    "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
    "cp2_fsdp2": (4, ["--parallelism.context_parallel_degree", "2"]),
    # op-level activation checkpointing with an FSDP unit nested in a block (the first block's experts), under CP
    "cp2_selective_ac": (2, ["--parallelism.context_parallel_degree", "2", "--activation_checkpoint.mode", "selective"]),
    # gathered weights kept from forward to backward, also through full AC's recompute
    "fsdp2_no_reshard": (2, ["--parallelism.fsdp_reshard_after_forward", "never", "--activation_checkpoint.mode", "full"]),
    # the embedding and the lm_head as FSDP units, where every layout above takes them vocabulary-parallel ("auto")
    "fsdp2_vocab_fsdp": (2, ["--parallelism.vocab_parallel", "never"]),
    # vocabulary-parallel over the 2 shards, the replicas' gradients summed by an all-reduce
    "hsdp2x2": (4, ["--parallelism.data_parallel_replicate_degree", "2"]),
}
# Where the embedding and the lm_head are FSDP units: HSDP over one shard per replica has nothing to split.
VOCAB_FSDP = {"hsdp2", "fsdp2_vocab_fsdp"}
EP = "--parallelism.expert_parallel_degree"
EP_LAYOUTS = {  # unbalanced routing (SKEWED): under EP=4, rank 0's two experts receive no token from any rank
    "ep2": (2, [EP, "2"]),
    "ep4": (4, [EP, "4"]),
    "ep2_fsdp2": (4, [EP, "2"]),  # the experts' weights FSDP-sharded over the 2 ranks EP leaves
    "ep2_hsdp2": (4, [EP, "2", "--parallelism.data_parallel_replicate_degree", "2"]),
    "ep2_cp2": (4, [EP, "2", "--parallelism.context_parallel_degree", "2"]),  # the EP group is the CP group
    # the recompute reuses the forward's split sizes; it runs the token all-to-alls again (full) or replays
    # their saved outputs (selective)
    "ep2_full_ac": (2, [EP, "2", "--activation_checkpoint.mode", "full"]),
    "ep2_selective_ac": (2, [EP, "2", "--activation_checkpoint.mode", "selective"]),
}
# The layouts above run the all-to-all ("auto" with top_k 2); the all-gather dispatch in the main ones:
EP_LAYOUTS.update({f"{name}_all_gather": (nproc, [*layout, "--parallelism.expert_parallel_dispatch", "all_gather"])
                   for name, (nproc, layout) in EP_LAYOUTS.items()
                   if name in ("ep2", "ep4", "ep2_fsdp2", "ep2_cp2", "ep2_selective_ac")})

LAYOUT_RUNS = {name: register(Run(f"fsdp/{name}", nproc, STEP, tuple(layout)))
               for name, (nproc, layout) in LAYOUTS.items()}
EP_RUNS = {name: register(Run(f"fsdp/{name}", nproc, STEP, (SKEWED, *layout)))
           for name, (nproc, layout) in EP_LAYOUTS.items()}
# LoRA: the frozen base sharded as the trained weights are, the adapters of the routed experts split by EP
SINGLE_LORA = register(Run("fsdp/single_lora", 1, STEP, ("--lora",)))
LORA_LAYOUTS = {"fsdp2": (2, []), "cp2": (2, ["--parallelism.context_parallel_degree", "2"]),
                "ep2": (2, [EP, "2"]), "ep2_fsdp2": (4, [EP, "2"])}
LORA_RUNS = {name: register(Run(f"fsdp/lora_{name}", nproc, STEP, ("--lora", *layout)))
             for name, (nproc, layout) in LORA_LAYOUTS.items()}
TIED_FSDP2 = register(Run("fsdp/tied_fsdp2", 2, STEP, TIED, write_tied_uneven_config))
ONE_ROW_MICROBATCHES_FSDP2 = register(Run("fsdp/one_row_microbatches_fsdp2", 2, STEP,
                                          ("--one-row-microbatches", *NO_BALANCE_LOSS)))


def result(launches, run: Run) -> dict:
    return torch.load(launches.folder_of(run) / "result.pt")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_ranks_match_single_process(launches, name):
    """Documents start inside the CP chunks and cross their edges (tests/distributed/fsdp_step_worker.py)."""
    ref, got = result(launches, SINGLE), result(launches, LAYOUT_RUNS[name])
    assert got["vocab_parallel"] == (name not in VOCAB_FSDP)
    assert_same_step(got, ref)


@pytest.mark.parametrize("name", list(EP_LAYOUTS))
def test_expert_parallel_matches_single_process(launches, name):
    ref = result(launches, SINGLE_SKEWED)
    unused = ref["grads"]["layers.0.mlp.experts.gate_up_proj"][:2]
    assert torch.count_nonzero(unused) == 0  # the routing is as unbalanced as intended
    got = result(launches, EP_RUNS[name])
    assert got["vocab_parallel"]  # "auto": 2 or 4 shards x 128 or 64 tokens <= the 512-token vocabulary
    assert_same_step(got, ref)
    # The busiest EP rank's tokens over an even split's; under EP=4 rank 0 gets none, so another gets >= 1/3.
    layout = EP_LAYOUTS[name][1]
    ep = int(layout[layout.index(EP) + 1])
    assert (4 / 3 if ep == 4 else 1.0) - 1e-9 <= got["out"]["ep_rank_load"] <= ep


def assert_same_step(got: dict, ref: dict) -> None:
    # Initial weights depend on the seed only, not on the world size or mesh: bitwise equal.
    assert got["initial"].keys() == ref["initial"].keys()
    for key, value in ref["initial"].items():
        assert torch.equal(got["initial"][key], value), key

    # Same float64 math, other summation order (per-rank partial sums + all-reduce, head-parallel GDN): the
    # fp32 parts (cross entropy, router softmax, RoPE angles) are per token, so identical in every layout.
    assert got["validation"]["val_tokens"] == ref["validation"]["val_tokens"]
    assert got["validation"]["val_loss"] == pytest.approx(ref["validation"]["val_loss"], rel=1e-6)
    # expert_load: the step's routing counts pooled over the ranks against the one process's own.
    if got["logits"] is not None:  # rank 0's first row is the global first row; the weights after the step
        torch.testing.assert_close(got["logits"], ref["logits"], rtol=1e-9, atol=1e-12)
    for key in ("loss", "aux_loss", "grad_norm", "expert_load"):
        assert got["out"][key] == pytest.approx(ref["out"][key], rel=1e-5), key
    assert ref["out"]["aux_loss"] > 1.0  # the balance loss was on (a uniform router gives top_k = 2)
    assert_same_grads(got, ref)
    # The parameters FSDP leaves whole on every rank (parallel/replicated_params.py): after the step every
    # rank's copy and gradient are bitwise the same (averaged gradients, the same update).
    assert ref["replica_spread"] is None and got["replica_spread"] == 0.0


@pytest.mark.parametrize("name", list(LORA_LAYOUTS))
def test_lora_matches_single_process(launches, name):
    """Only the adapters have gradients, the same in every layout; the routed experts' ones included (EP splits
    them with the experts, FSDP shards them within the EP group)."""
    ref, got = result(launches, SINGLE_LORA), result(launches, LORA_RUNS[name])
    assert ref["grads"] and all(".adapter." in key for key in ref["grads"])
    assert got["grads"].keys() == ref["grads"].keys()
    assert ref["grads"]["layers.0.mlp.experts.adapter.gate_up_A"].norm() > 0  # B random: A learns too
    assert_same_step(got, ref)


def test_tied_embeddings_on_an_uneven_vocabulary_match_single_process(launches):
    """One parameter serving the vocabulary-parallel lookup and loss, its rows split unevenly (509 = 255 + 254): its
    gradient sums both uses' over both ranks' tokens, as one process's does."""
    ref, got = result(launches, SINGLE_TIED), result(launches, TIED_FSDP2)
    assert got["vocab_parallel"] and "lm_head.weight" not in ref["grads"]
    assert ref["grads"]["embed_tokens.weight"].shape[0] == 509
    assert_same_step(got, ref)


def test_gradient_accumulation_under_vocab_parallel_matches_one_process(launches):
    """Each FSDP rank accumulates the step over two one-row micro-batches: the vocabulary-parallel lm_head's and
    embedding's slice gradients add up over them as FSDP's units' do, against one process's one micro-batch of the
    same 4 rows (the balance loss off: it is pooled per micro-batch, so it depends on the split)."""
    ref, got = result(launches, SINGLE_WITHOUT_BALANCE_LOSS), result(launches, ONE_ROW_MICROBATCHES_FSDP2)
    assert got["vocab_parallel"]
    assert got["out"]["loss"] == pytest.approx(ref["out"]["loss"], rel=1e-9)
    assert_same_grads(got, ref)
