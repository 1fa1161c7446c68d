"""The model of a run: its shape from the config, then built on meta, parallelized, materialised and filled.

Order: model on the meta device -> FLA kernel check (CUDA) -> parallelize (AC, compile, FSDP) -> materialise on
the device -> initial weights from the seed (the same at any world size) or from an HF checkpoint -> frozen MTP
layers to the host (one GPU: no step runs them).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
from torch.distributed.fsdp import FSDPModule

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel
from models.qwen35_moe.kernels.fla_hopper_guard import enable_fla_hopper_backward, refuse_fla_hopper_backward
from models.qwen35_moe.kernels.gated_delta_rule import require_fla
from models.qwen35_moe.moe import force_balanced_routing
from parallel.parallel_dims import Meshes
from parallel.parallelize import parallelize_qwen35_moe
from parallel.vocab_parallel import resolve_vocab_parallel

from .checkpoint.hf_weights import load_hf_weights
from .config import JobConfig
from .config.run_requirements import model_args_of
from .float8 import convert_to_float8
from .lora.run import LoraRun

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_model_args(cfg: JobConfig, vocab_size: int) -> Qwen35MoeArgs:
    args, problems = model_args_of(cfg)
    if args is None:
        raise ValueError(problems[0])
    if vocab_size > args.vocab_size:
        raise ValueError(
            f"tokenizer has {vocab_size} tokens but model flavor {cfg.model.flavor!r} has vocab_size "
            f"{args.vocab_size}; pick a matching tokenizer or model")
    return args


def _vocab_parallel(cfg: JobConfig, args: Qwen35MoeArgs, meshes: Meshes) -> bool:
    shard_ranks = meshes.fsdp.size(meshes.fsdp.ndim - 1)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len // cfg.parallelism.context_parallel_degree
    chosen = resolve_vocab_parallel(cfg.parallelism.vocab_parallel, args.vocab_size, shard_ranks, tokens)
    if meshes.fsdp.size() > 1:
        logger.info("embedding and lm_head: %s", f"vocabulary-parallel over {shard_ranks} ranks" if chosen else "FSDP")
    return chosen


def trains_mtp(cfg: JobConfig, model: Qwen35MoeModel, lora: LoraRun | None) -> bool:
    """Whether the run trains the model's MTP layers (it has some, their loss has a weight and, under LoRA, they
    have adapters)."""
    return model.mtp is not None and cfg.training.mtp_loss_coef > 0 and (lora is None or lora.trains_mtp)


def hold_on_host(mtp: torch.nn.Module, device: torch.device) -> None:
    """Move a LoRA run's frozen MTP layers, which no step runs, to the host: their GPU memory goes to the step (1.57
    GiB of 35B-A3B's in bf16); the export reads them from there, and validation brings them to the GPU for its pass
    (`brought_to`). Drawn or loaded on the GPU first, so a base drawn from the seed is the one the run's device draws
    (init.py: CPU and CUDA generators differ). (LoRA's frozen weights are held in the compute dtype, so no kept bf16
    copy of them follows the move: parallel/one_device_precision.py.)"""
    held = sum(p.numel() * p.element_size() for p in mtp.parameters())
    mtp.to("cpu")
    torch.cuda.empty_cache()  # the freed blocks back to the device, not kept for tensors of the MTP's sizes
    logger.info("MTP layers held on the host until the export reads them: %.2f GiB of %s spared", held / 1024**3,
                device)


@contextmanager
def brought_to(module: torch.nn.Module | None, device: torch.device):
    """`module` on `device` for the block where `hold_on_host` left it on the host, and back there after (validation
    runs the MTP layers); as it is otherwise."""
    held = module is not None and device.type == "cuda" and any(p.device.type == "cpu" for p in module.parameters())
    if held:
        module.to(device)
    try:
        yield
    finally:
        if held:
            module.to("cpu")
            torch.cuda.empty_cache()


def build_model(cfg: JobConfig, args: Qwen35MoeArgs, meshes: Meshes | None, device: torch.device,
                lora: LoraRun | None = None, load_hf: bool = True, grad_accum_steps: int = 1) -> Qwen35MoeModel:
    """`lora`: the run's LoRA (harness/lora/run.py), which converts the model before it is parallelized."""
    with torch.device("meta"):
        model = Qwen35MoeModel(args)
    on_gpu = device.type == "cuda"
    if lora is not None:  # the frozen base held in the compute dtype on a GPU (CPU runs compute in fp32 anyway), an
        # FP8 release's quantized weights as stored
        fp8 = lora.fp8_held_keys(args, cfg.parallelism.expert_parallel_degree > 1,
                                 cfg.activation_checkpoint.mode == "full",
                                 cfg.lora.fp8_base) if load_hf else frozenset()
        lora.convert(model, DTYPES[cfg.training.mixed_precision_param] if on_gpu else None, fp8)
    train_mtp = trains_mtp(cfg, model, lora)
    if model.mtp is not None and not train_mtp:
        # Loaded, kept and exported as they are, never run: frozen, and so without gradients or optimizer state.
        model.mtp.requires_grad_(False)
        logger.info("MTP layers (mtp_num_hidden_layers %d): %s, so carried frozen from the initial weights to the "
                    "export", args.mtp_num_hidden_layers,
                    "training.mtp_loss_coef is 0" if lora is None else "no adapters on them (lora.mtp frozen)")
    elif train_mtp:
        logger.info("MTP layers (mtp_num_hidden_layers %d): trained, loss weight training.mtp_loss_coef %g (0 keeps "
                    "them frozen)", args.mtp_num_hidden_layers, cfg.training.mtp_loss_coef)
    if cfg.debug.moe_force_load_balance:
        layers = force_balanced_routing(model)
        logger.warning("debug.moe_force_load_balance: benchmarks only. The %d MoE layers send token n of each layer's "
                       "N local tokens to experts (n * k + j) mod E, not to the router's top-k: equal expert load, "
                       "the routing is not learned and the balance loss stays at about top_k", layers)
    convert_to_float8(model, cfg, device)  # [quantize]: before parallelizing, as torchao's converters go
    if device.type == "cuda":
        require_fla()
    if device.type == "cuda" and cfg.model.fla_hopper_backward == "auto":
        cp = cfg.parallelism.context_parallel_degree  # under CP each rank runs the kernel on 1/cp of the heads
        enable_fla_hopper_backward(args.linear_num_key_heads // cp, args.linear_num_value_heads // cp,
                                   args.linear_key_head_dim, args.linear_value_head_dim, device)
    elif device.type == "cuda":
        refuse_fla_hopper_backward()
    # CPU runs compute in the parameters' own dtype (fp32): bf16 matmuls are slow there, the debug model is tiny.
    if cfg.compile.enable and cfg.activation_checkpoint.mode == "selective":
        logger.warning("activation_checkpoint.mode selective with compile.enable: the per-op policy cannot see into "
                       "the compiled graphs, which are recomputed whole; full is faster and holds less "
                       "(docs/performance.md, \"Activation checkpointing\")")
    parallelize_qwen35_moe(model, meshes.fsdp if meshes else None,
                           param_dtype=DTYPES[cfg.training.mixed_precision_param] if on_gpu else None,
                           reduce_dtype=DTYPES[cfg.training.mixed_precision_reduce] if on_gpu else None,
                           ac_mode=cfg.activation_checkpoint.mode, compile=cfg.compile.enable,
                           cp_mesh=meshes.cp if meshes else None, ep_mesh=meshes.ep if meshes else None,
                           expert_fsdp_mesh=meshes.expert_fsdp if meshes else None,
                           expert_dispatch=cfg.parallelism.expert_parallel_dispatch,
                           reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward != "never",
                           vocab_parallel=meshes is not None and _vocab_parallel(cfg, args, meshes),
                           # one GPU: weights read from kept copies, not cast (parallel/one_device_precision.py);
                           # with one backward a step the gradients stay in the copies' bf16, which holds them exactly
                           weight_copies=on_gpu, grads_in_copies=grad_accum_steps == 1, train_mtp=train_mtp)
    model.to_empty(device=device)
    model.init_weights(cfg.training.seed)
    if cfg.checkpoint.initial_load_hf and load_hf:
        load_hf_weights(model, args, cfg.checkpoint.initial_load_hf)
    if model.mtp is not None and not train_mtp and on_gpu and lora is not None and not isinstance(model, FSDPModule):
        hold_on_host(model.mtp, device)
    shape = cfg.model.hf_config or f"flavor {cfg.model.flavor}"
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    share = "" if trained == total else f", {trained / 1e6:.2f}M of them trained ({trained / total:.2%})"
    logger.info("model %s: %.2fM parameters%s; %s on %s", shape, total / 1e6, share,
                "FSDP" if isinstance(model, FSDPModule) else "one process, no FSDP", device)
    if on_gpu:  # the weights' share of the peak; the step adds optimizer state and activations
        logger.info("GPU memory with the model built: %.2f GiB allocated", torch.cuda.memory_allocated(device) / 1024**3)
    return model
