"""The one trainer: 1 CPU process or N GPUs on M nodes, same code.

Order of work: process group and mesh -> model on meta -> parallelize (AC, compile, FSDP) -> materialise
and initialise (or load HF weights) -> AdamW + LR schedule -> train loop (gradient accumulation, global
token-mean loss, clipping, metrics).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from models.qwen35_moe import Qwen35MoeArgs, Qwen35MoeModel, Qwen35MoeStateDictAdapter, get_flavor, load_hf_state_dict
from models.qwen35_moe.gated_delta_rule import enable_fla_hopper_backward
from parallel.parallelize import parallelize_qwen35_moe

from .config import JobConfig, validate_parallelism
from .data import IGNORE_INDEX, build_dataloader
from .lr_schedule import build_lr_scheduler
from .metrics import MetricsLogger, max_memory_gib, peak_flops, training_flops_per_token
from .tokenizer import build_tokenizer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingDivergedError(RuntimeError):
    """The loss became NaN or infinite; nothing was saved for that step."""


def _build_model_args(cfg: JobConfig, vocab_size: int) -> Qwen35MoeArgs:
    if cfg.model.hf_config:
        args = Qwen35MoeArgs.from_hf_config(cfg.model.hf_config)
    else:
        args = get_flavor(cfg.model.flavor)
    if vocab_size > args.vocab_size:
        raise ValueError(
            f"tokenizer has {vocab_size} tokens but model flavor {cfg.model.flavor!r} has vocab_size "
            f"{args.vocab_size}; pick a matching tokenizer or model")
    return args


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.degrees = validate_parallelism(cfg, self.world_size)  # again here for direct callers

        if torch.cuda.is_available():
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self._seed(cfg.training.seed, cfg.training.deterministic)

        # A process group on every GPU run, even a single one (FSDP2 then gives it the same bf16 mixed
        # precision as at scale), and on multi-process CPU runs; a single CPU process needs none.
        self.mesh = None
        if self.device.type == "cuda" or self.world_size > 1:
            if not dist.is_initialized():
                backend = "nccl" if self.device.type == "cuda" else "gloo"
                if "RANK" in os.environ:  # launched by torchrun
                    dist.init_process_group(backend, timeout=timedelta(minutes=10))
                else:
                    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            shape = (self.degrees["dp_replicate"], self.degrees["dp_shard"])
            if shape[0] == 1:
                self.mesh = init_device_mesh(self.device.type, (shape[1],), mesh_dim_names=("dp_shard",))
            else:
                self.mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))

        self.tokenizer = build_tokenizer(cfg.model.tokenizer_path)
        self.model_args = _build_model_args(cfg, self.tokenizer.vocab_size)
        self.aux_loss_coef = (self.model_args.router_aux_loss_coef if cfg.training.aux_loss_coef < 0
                              else cfg.training.aux_loss_coef)
        self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.lr_scheduler = build_lr_scheduler(
            self.optimizer, cfg.training.steps, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_ratio,
            cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor)

        dp_rank = self.mesh.get_rank() if self.mesh is not None else 0  # DP-only mesh: rank in it
        self.dataloader = build_dataloader(
            cfg.training.dataset, cfg.training.dataset_path, cfg.training.dataset_text_field, self.tokenizer,
            cfg.training.seq_len, cfg.training.local_batch_size, dp_rank=dp_rank,
            dp_world_size=self.degrees["dp_replicate"] * self.degrees["dp_shard"])
        self.step = 0
        self.metrics = MetricsLogger(cfg.job.dump_folder, cfg.training.steps, cfg.metrics.enable_tensorboard,
                                     cfg.metrics.save_tb_folder, enabled=self.rank == 0)
        self.flops_per_token = training_flops_per_token(self.model_args, cfg.training.seq_len)
        self.peak_flops = peak_flops(self.device)

    # ---- setup ----

    def _seed(self, seed: int, deterministic: bool) -> None:
        random.seed(seed)
        torch.manual_seed(seed)
        if deterministic:
            torch.use_deterministic_algorithms(True)
            if self.device.type == "cuda":
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
                torch.backends.cudnn.benchmark = False

    def _build_model(self) -> Qwen35MoeModel:
        cfg, args = self.cfg, self.model_args
        with torch.device("meta"):
            model = Qwen35MoeModel(args)
        if self.device.type == "cuda":
            self._check_fla_backward()
        # CPU runs compute in fp32: bf16 matmuls are slow there and the debug model is tiny.
        param_dtype = _DTYPES[cfg.training.mixed_precision_param] if self.device.type == "cuda" else torch.float32
        parallelize_qwen35_moe(
            model, self.mesh, param_dtype=param_dtype,
            reduce_dtype=_DTYPES[cfg.training.mixed_precision_reduce],
            ac_mode=cfg.activation_checkpoint.mode, compile=cfg.compile.enable)
        model.to_empty(device=self.device)
        with torch.no_grad():
            model.init_weights()
        if cfg.checkpoint.initial_load_hf:
            self._load_hf_weights(model, cfg.checkpoint.initial_load_hf)
        n_params = sum(p.numel() for p in model.parameters())
        if self.rank == 0:
            shape = cfg.model.hf_config or f"flavor {cfg.model.flavor}"
            logger.info("model %s: %.2fM parameters (%s on %s)", shape, n_params / 1e6,
                        "FSDP" if self.mesh is not None else "single process", self.device)
        return model

    def _check_fla_backward(self) -> None:
        mode, a = self.cfg.model.fla_hopper_backward, self.model_args
        if mode == "off":
            return
        result = enable_fla_hopper_backward(a.linear_num_key_heads, a.linear_num_value_heads,
                                            a.linear_key_head_dim, a.linear_value_head_dim, self.device)
        if self.rank == 0 and result.get("needed"):
            logger.info("FLA Hopper backward bypass on, self-check relative errors: %s", result)

    def _load_hf_weights(self, model: Qwen35MoeModel, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        native = Qwen35MoeStateDictAdapter(self.model_args).from_hf(load_hf_state_dict(path))
        set_model_state_dict(model, native, options=StateDictOptions(full_state_dict=True, strict=True))
        if self.rank == 0:
            logger.info("initialised weights from HF checkpoint %s", path)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.cfg.optimizer
        # No weight decay on 1-D parameters (norm scales, A_log, dt_bias): decaying them pulls the norms
        # and the SSM decay rates toward zero rather than regularising anything.
        decay = [p for p in self.model.parameters() if p.ndim >= 2]
        no_decay = [p for p in self.model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        kwargs = {"fused": True} if self.device.type == "cuda" else {"foreach": True}
        # Adam applies weight_decay as an L2 term in the gradient, AdamW decoupled from it.
        cls = torch.optim.AdamW if o.name == "AdamW" else torch.optim.Adam
        return cls(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, **kwargs)

    # ---- training ----

    def _all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            dist.all_reduce(value)
        return value

    def train_step(self, microbatches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
        """One optimizer step over the global batch; returns the global token-mean loss and grad norm."""
        self.optimizer.zero_grad(set_to_none=True)
        # Token-mean cross entropy over the whole global batch: divide every microbatch's summed loss by
        # the global count of label tokens, so uneven counts across microbatches and ranks weigh right.
        n_tokens = sum((mb["labels"] != IGNORE_INDEX).sum() for mb in microbatches).to(self.device, torch.float32)
        n_tokens = self._all_reduce_sum(n_tokens).clamp_min(1)
        dp = self.degrees["dp_replicate"] * self.degrees["dp_shard"]
        ce_total = torch.zeros((), device=self.device)
        aux_total = torch.zeros((), device=self.device)
        for mb in microbatches:
            input_ids = mb["input_ids"].to(self.device)
            out = self.model(input_ids, mb["position_ids"].to(self.device))
            ce = F.cross_entropy(out.logits.flatten(0, 1).float(), mb["labels"].to(self.device).flatten(),
                                 ignore_index=IGNORE_INDEX, reduction="sum") / n_tokens
            aux = out.aux_loss / len(microbatches)
            # FSDP averages gradients over the dp ranks; scale by dp so the result is the global sum.
            ((ce + self.aux_loss_coef * aux) * dp).backward()
            ce_total += ce.detach()
            aux_total += aux.detach()
        ce_total = self._all_reduce_sum(ce_total)
        aux_total = self._all_reduce_sum(aux_total) / dp
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm, foreach=True)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        loss = ce_total.item()
        if not math.isfinite(loss) or not math.isfinite(grad_norm.item()):
            raise TrainingDivergedError(
                f"step {self.step}: loss is {loss}, grad norm {grad_norm.item()}; stopping without saving "
                f"this step. Lower optimizer.lr or check the data.")
        self.optimizer.step()
        self.lr_scheduler.step()
        return {"loss": loss, "aux_loss": aux_total.item(), "grad_norm": grad_norm.item()}

    def train(self) -> dict[str, float]:
        cfg = self.cfg
        accum = self.degrees["grad_accum_steps"]
        data = iter(self.dataloader)
        tokens_per_step_local = cfg.training.local_batch_size * cfg.training.seq_len * accum
        window_tokens, window_start = 0, time.perf_counter()
        last = {}
        self.model.train()
        try:
            while self.step < cfg.training.steps:
                self.step += 1
                lr = self.optimizer.param_groups[0]["lr"]
                last = self.train_step([next(data) for _ in range(accum)])
                window_tokens += tokens_per_step_local
                if self.step % cfg.metrics.log_freq == 0 or self.step in (1, cfg.training.steps):
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    elapsed = time.perf_counter() - window_start
                    tps = window_tokens / elapsed  # per device, as torchtitan reports it
                    mfu = None if self.peak_flops is None else tps * self.flops_per_token / self.peak_flops
                    self.metrics.log(self.step, {**last, "lr": lr, "tokens_per_sec": tps, "mfu": mfu,
                                                 "max_memory_gib": max_memory_gib(self.device)})
                    window_tokens, window_start = 0, time.perf_counter()
        finally:
            self.metrics.close()
        return last

    def export_hf(self) -> None:
        """Write the trained weights as a Hugging Face folder at <dump_folder>/hf (rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from models.qwen35_moe import save_hf_checkpoint

        # Every rank takes part in gathering the full (unsharded) weights; only rank 0 keeps them.
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            folder = os.path.join(self.cfg.job.dump_folder, "hf")
            save_hf_checkpoint(state, self.model_args, folder, dtype=_DTYPES[self.cfg.checkpoint.export_dtype])
            logger.info("exported Hugging Face checkpoint to %s", folder)
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
