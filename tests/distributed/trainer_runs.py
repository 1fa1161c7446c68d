"""The trainer in a run of the shared launches (tests/distributed/launch.py): the debug model on the debug corpus,
64-token rows, outputs in the run's folder; closed without ending the process group the launch's next runs use."""

import os
from collections.abc import Callable
from unittest import mock

import torch
import torch.distributed as dist

from harness.config import load_config
from harness.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CORPUS = os.path.join(REPO, "data", "debug_corpus", "train.jsonl")


def debug_trainer(folder: str, *overrides: str) -> Trainer:
    """A Trainer of train_configs/debug_model.toml, dumping to <folder>/dump, its token cache shared with the other
    runs of the test module (the folder's parent); `overrides` are config flags."""
    return Trainer(load_config([
        "--config", os.path.join(REPO, "train_configs", "debug_model.toml"), "--training.dataset_path", CORPUS,
        "--training.seq_len", "64", "--metrics.enable_tensorboard", "false",
        "--job.dump_folder", os.path.join(folder, "dump"),
        "--training.dataset_cache_dir", os.path.join(os.path.dirname(folder), "dataset_cache"), *overrides,
    ]))


def layout_trainer(folder: str, overrides: tuple[str, ...], global_rows: int, *flags: str) -> tuple[Trainer, int]:
    """debug_trainer with `flags`, then the layout's `overrides`, each data-parallel rank given its share of a global
    batch of `global_rows` rows (the CP ranks of one data-parallel rank hold the same rows). Returns it and its CP
    degree."""
    settings = dict(zip(overrides[::2], overrides[1::2]))
    cp = int(settings.get("--parallelism.context_parallel_degree", 1))
    local = global_rows * cp // int(os.environ.get("WORLD_SIZE", "1"))
    return debug_trainer(folder, *flags, "--training.local_batch_size", str(local), *overrides), cp


def close_keeping_process_group(trainer: Trainer) -> None:
    with mock.patch.object(dist, "destroy_process_group", lambda *args, **kwargs: None):
        trainer.close()


def assert_same_grads(got: dict, ref: dict) -> None:
    """Every full gradient of a worker's result within 1e-9 relative of the reference's (float64 runs)."""
    for key, want in ref["grads"].items():
        rel = ((got["grads"][key] - want).norm() / want.norm().clamp_min(1e-30)).item()
        # Measured at most 8.1e-13 (A_log of a GDN layer, in every layout); a wrong head, chunk or document
        # boundary gives O(1).
        assert rel < 1e-9, f"{key}: relative grad difference {rel:.2e}"


def in_float64(step: Callable[[str, tuple[str, ...]], None], folder: str, overrides: tuple[str, ...]) -> None:
    """step(folder, overrides) with float64 the default dtype: layouts then differ only in summation order, which
    float64 keeps near 1e-16."""
    torch.set_default_dtype(torch.float64)
    try:
        step(folder, overrides)
    finally:
        torch.set_default_dtype(torch.float32)


def saved_result(launches, run) -> dict:
    """The result.pt a worker's rank 0 saved in `run`'s folder."""
    return torch.load(launches.folder_of(run) / "result.pt")
