"""benchmarks/alternate.py: variants run round-robin, and each is compared with the first variant's run of the same
round (the pairing is the point: machines differ by as much as the changes measured)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.scripts import loaded

REPO = Path(__file__).resolve().parents[2]


def test_variant_specs_name_gpus_and_overrides():
    alternate = loaded("alternate.py")
    v = alternate.parse_variant("full=--activation_checkpoint.mode full --metrics.log_freq 10")
    assert (v.name, v.gpus, v.overrides) == ("full", 1, ["--activation_checkpoint.mode", "full",
                                                         "--metrics.log_freq", "10"])
    v = alternate.parse_variant("fsdp@2=")
    assert (v.name, v.gpus, v.overrides) == ("fsdp", 2, [])
    assert v.tree == REPO
    v = alternate.parse_variant(f"old@2:{REPO}=--x 1")  # another checkout: here, the repository itself
    assert (v.name, v.gpus, v.tree, v.overrides) == ("old", 2, REPO, ["--x", "1"])
    for bad in ("no equals sign", "x@0=", "@2=--a b", f"old:{REPO / 'docs'}="):
        with pytest.raises(SystemExit):
            alternate.parse_variant(bad)


def test_variants_alternate_and_ratios_pair_runs_of_the_same_round():
    alternate = loaded("alternate.py")
    variants = [alternate.parse_variant(s) for s in ("base=", "fast=--x 1", "broken=--y 2")]
    order = []
    # The machine slows down in round 2: "fast" is 1.10x "base" in each round, though its round-2 figure is below
    # base's round-1 one. "broken" fails in round 2.
    rates = {("base", 0): 100.0, ("fast", 0): 110.0, ("base", 1): 90.0, ("fast", 1): 99.0, ("broken", 0): 50.0}

    def run(variant, index):
        order.append((variant.name, index))
        rate = rates.get((variant.name, index))
        return None if rate is None else {"tokens_per_sec": rate, "max_memory_gib": 1.5 + index}

    results = alternate.alternate(variants, 2, run)
    assert order == [("base", 0), ("fast", 0), ("broken", 0), ("base", 1), ("fast", 1), ("broken", 1)]
    lines = alternate.report(variants, results)
    assert lines[0].strip() == "base (1 rank): 100 90; mean 95, peak 2.5 GiB"
    assert lines[1].strip() == "fast (1 rank): 110 99; mean 104, peak 2.5 GiB; vs base: 1.100 1.100 (mean 1.100)"
    assert lines[2].strip() == "broken (1 rank): 50 failed; mean 50, peak 1.5 GiB; vs base: 0.500 (mean 0.500)"


def test_parity_compares_each_variants_curves_with_the_first_variants_run_of_the_same_round(tmp_path):
    """The gaps by hand: from step 2 on, fp8's loss is 1% above base's at step 2 and 2% below at step 3 (the largest),
    its grad norm 10% and 30% above; the last two steps' means are 2.5 -> 2.495 (0.2%)."""
    alternate = loaded("alternate.py")
    variants = [alternate.parse_variant(s) for s in ("base=", "fp8=--x 1")]
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 4.0, "grad_norm": 1.0}\n{"step": 2, "val_loss": 9.0}\n'
                       '{"step": 2, "loss": 3.0, "grad_norm": 2.0}\n{"step": 3, "loss": 2.0, "grad_norm": 1.0}\n')
    base = alternate.run_curves(metrics)
    assert base == {"losses": {1: 4.0, 2: 3.0, 3: 2.0}, "grad_norms": {1: 1.0, 2: 2.0, 3: 1.0}}
    fp8 = {"losses": {1: 9.0, 2: 3.03, 3: 1.96}, "grad_norms": {1: 9.0, 2: 2.2, 3: 1.3}}
    (line,) = alternate.parity(variants, {"base": [base], "fp8": [fp8]}, from_step=2)
    assert line.strip() == ("fp8 vs base (round 1), steps 2-3: loss gap max 2.00%, at step 3 2.00%, last 2 steps' "
                            "means 0.20% (2.5000 -> 2.4950); grad norm gap max 30.00%, median 20.00%")
    assert alternate.parity(variants, {"base": [None], "fp8": [fp8]}, from_step=2) == []  # its baseline failed
