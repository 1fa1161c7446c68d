"""LoRA fine-tuning as one part (run.py: `LoraRun`, built once from the config; the trainer touches it at build and at
export only, the converter uses it as it is): settings.py (the config's [lora], torch-free), base.py (the frozen base's
digest, what a checkpoint records of it, the resume check), merge.py (the merged export: W + s B A), peft.py (the PEFT
adapter folder). The adapters themselves are the model's (models/qwen35_moe/lora.py, lora_targets.py)."""
