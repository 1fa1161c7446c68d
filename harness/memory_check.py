"""Whether a run can fit, judged from its config before anything is allocated: a lower bound on each process's
memory against what the device holds.

A config of hostile sizes (a hidden size of 1e9, a vocabulary of 1e12, a million layers, `--lora.rank 1000000008`,
`--training.local_batch_size 10000000`) would otherwise try to allocate terabytes, or hang building layers, and end
in a traceback. The bound counts only what every such run surely holds on each process, so it never refuses a run
that fits (benchmarks/memory_model.py predicts the real peak; this is its floor):

- the weights' state, shared out over every process at most (FSDP / EP shard it over no more than the world):
  a trained parameter 16 B (fp32 weight, fp32 gradient, AdamW's two moments); under LoRA an adapter parameter 8 B
  (fp32 weight and gradient; its moments may live elsewhere) and a frozen one 2 B on a GPU (held in bf16), 1 B
  from an FP8 release base that may be held in float8 (`fp8_base_held`), 4 B on the CPU (fp32); a frozen MTP
  layer not at all (it need not stay on the device);
- activations: every block's input for each of the process's tokens (what full activation checkpointing keeps),
  2 B a value on a GPU (bf16), 4 B on the CPU;
- one chunk of the loss's logits (training.loss_chunk_tokens tokens x the vocabulary).

It is checked twice: by the launcher's config check, torch-free, against this host's memory for a CPU run and,
for a GPU run, against the most any device holds (FITS_NOWHERE); then by the trainer, once it has its device,
against that GPU's memory (or the host's), before the model is built.
"""

from __future__ import annotations

import os

from models.qwen35_moe.args import Qwen35MoeArgs
from models.qwen35_moe.fp8_config import folder_quantization_config
from models.qwen35_moe.sizes import adapter_count, parameter_counts

from .lora.settings import lora_args_of

GIB = 1024**3
FITS_NOWHERE = 4 * 1024 * GIB  # more than any one GPU or host holds: refused before a GPU run starts


def fp8_base_held(cfg) -> bool:
    """Whether a LoRA run's frozen base may be held in float8 (harness/lora/run.py's fp8_held_keys): its starting
    folder's config.json has a quantization_config and lora.fp8_base is "held". The floor then counts 1 B a frozen
    weight; the trainer's own conditions (one process, full AC) are not asked, as a floor may only be lower."""
    folder = cfg.checkpoint.initial_load_hf
    if not (cfg.lora.enable and cfg.lora.fp8_base == "held" and folder):
        return False
    try:
        return folder_quantization_config(folder) is not None
    except (OSError, ValueError):  # the config check names what is wrong with the folder
        return False


def memory_floor(cfg, args: Qwen35MoeArgs, world_size: int, cp: int, on_gpu: bool) -> dict[str, int]:
    """Each process's least memory for a run of `cfg` with model `args` on `world_size` processes (`cp`: the
    context-parallel degree), in bytes, by part: "state", "activations", "logits"."""
    counts = parameter_counts(args)
    value = 2 if on_gpu else 4
    lora = lora_args_of(cfg)
    if lora is not None:
        adapters = adapter_count(args, lora)
        frozen = counts.total - (0 if lora.mtp else counts.mtp)  # a frozen MTP layer need not be held
        state = (1 if on_gpu and fp8_base_held(cfg) else value) * frozen + 8 * adapters
    else:
        state = 16 * counts.total
    tokens = cfg.training.local_batch_size * cfg.training.seq_len // max(1, cp)
    chunk = min(cfg.training.loss_chunk_tokens or tokens, tokens)
    return {"state": state // max(1, world_size),
            "activations": tokens * args.hidden_size * args.num_hidden_layers * value,
            "logits": chunk * args.vocab_size * value}


def memory_problem(cfg, args: Qwen35MoeArgs, world_size: int, cp: int, on_gpu: bool, available: int,
                   where: str) -> str | None:
    """One line if the run cannot fit `available` bytes per process (`where` names them), else None."""
    parts = memory_floor(cfg, args, world_size, cp, on_gpu)
    need = sum(parts.values())
    if need <= available:
        return None
    shown = ", ".join(f"{name} {size / GIB:,.1f}" for name, size in
                      (("weights and optimizer state", parts["state"]), ("activations", parts["activations"]),
                       ("one loss chunk of logits", parts["logits"])))
    return (f"the run cannot fit: each process needs at least {need / GIB:,.1f} GiB ({shown} GiB), more than "
            f"{where}; shrink the model (model.flavor / model.hf_config), lora.rank, training.local_batch_size, "
            "training.seq_len or training.loss_chunk_tokens, or use more processes")


def host_memory_per_process(processes: int) -> int:
    """This host's memory (its cgroup's limit where lower) shared by `processes` processes."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // max(1, processes)


def launch_memory_problem(cfg, args: Qwen35MoeArgs, world_size: int, cp: int, gpu_run: bool,
                          processes_per_node: int) -> str | None:
    """The config check's verdict (torch-free): a CPU run against this host's memory, a GPU run against
    FITS_NOWHERE."""
    if gpu_run:
        return memory_problem(cfg, args, world_size, cp, True, FITS_NOWHERE,
                              f"any GPU holds ({FITS_NOWHERE / GIB:,.0f} GiB)")
    available = host_memory_per_process(processes_per_node)
    return memory_problem(cfg, args, world_size, cp, False, available,
                          f"this host's {available / GIB:,.1f} GiB of memory per process ({processes_per_node} "
                          f"process{'es' if processes_per_node != 1 else ''})")


def device_memory_problem(cfg, args: Qwen35MoeArgs, world_size: int, cp: int, device) -> str | None:
    """The trainer's verdict, once it has its device (a torch.device): against that GPU's memory (what this process
    may allocate of it: torch.cuda.set_per_process_memory_fraction caps it, as a smaller card's stand-in), or the
    host's."""
    if device.type == "cuda":
        import torch

        props = torch.cuda.get_device_properties(device)
        fraction = torch.cuda.get_per_process_memory_fraction(device)
        available = int(props.total_memory * fraction)
        capped = f" this process may allocate (set_per_process_memory_fraction {fraction:g})" if fraction < 1 else ""
        return memory_problem(cfg, args, world_size, cp, True, available,
                              f"the {available / GIB:,.1f} GiB{capped} of this {props.name}")
    return launch_memory_problem(cfg, args, world_size, cp, False, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
