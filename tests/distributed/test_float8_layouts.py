"""FP8 training (`[quantize]`, the projections and the routed experts, GEMMs emulated on CPU ranks) under FSDP=2,
EP=2 and CP=2 against one process, through the trainer: the same rows and initial weights give the same losses over
3 steps. The forward's casts are per token and per weight row, whatever the layout; the weight gradients' per-column
scales are taken over each data-parallel rank's own tokens, which moves the losses by about 1e-7 here (measured),
far inside FP8's own effect on them (1e-3 after 12 steps, tests/unit/test_float8.py)."""

import pytest

from tests.distributed.launch import Run, register
from tests.distributed.train_worker import logged, losses

TRAIN = "tests.distributed.train_worker:train"
FP8 = ("--quantize.linear_float8_recipe", "rowwise", "--quantize.grouped_mm_float8_fqns", "experts",
       "--quantize.float8_emulate", "true", "--training.steps", "3", "--metrics.log_freq", "1",
       "--training.seq_len", "64", "--training.global_batch_size", "4", "--metrics.enable_tensorboard", "false",
       "--checkpoint.export_hf_at_end", "false")
LAYOUTS = {  # name: (processes, flags beside FP8's)
    "fsdp2": (2, ("--training.local_batch_size", "2")),
    "ep2": (2, ("--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2")),
    "cp2": (2, ("--training.local_batch_size", "4", "--parallelism.context_parallel_degree", "2")),
}
SINGLE = register(Run("float8/single", 1, TRAIN, (*FP8, "--training.local_batch_size", "4")))
RUNS = {name: register(Run(f"float8/{name}", nproc, TRAIN, (*FP8, *flags)))
        for name, (nproc, flags) in LAYOUTS.items()}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fp8_layouts_follow_one_process(launches, name):
    ref_folder, got_folder = launches.folder_of(SINGLE), launches.folder_of(RUNS[name])
    assert "routed experts' (rowwise)" in logged(got_folder)
    ref, got = losses(ref_folder), losses(got_folder)
    assert sorted(ref) == sorted(got) == [1, 2, 3]
    assert [got[step] for step in (1, 2, 3)] == pytest.approx([ref[step] for step in (1, 2, 3)], rel=1e-5)
