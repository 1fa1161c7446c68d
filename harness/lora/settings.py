"""A run's LoRA settings from its config: the one place that reads the config's [lora] section (no torch: the
config check and the memory check read it before anything heavy is imported)."""

from __future__ import annotations

from models.qwen35_moe.lora_targets import LoraArgs


def lora_args_of(cfg) -> LoraArgs | None:
    """The run's adapters ([lora]), None without LoRA."""
    lora = cfg.lora
    if not lora.enable:
        return None
    return LoraArgs(lora.rank, lora.alpha, lora.dropout, tuple(lora.targets), mtp=lora.mtp == "lora",
                    expert_rank=lora.expert_rank)


def lora_config_problems(cfg, unusable: frozenset[str]) -> list[str]:
    """What in [lora] no run can use together with the rest of the config (a check reading an unusable key is
    skipped)."""
    lora = cfg.lora
    if lora.enable and lora.mtp == "lora" and cfg.training.mtp_loss_coef == 0 \
            and "training.mtp_loss_coef" not in unusable:
        return ["lora.mtp = \"lora\" trains the MTP layers' adapters, which needs training.mtp_loss_coef > 0"]
    return []
