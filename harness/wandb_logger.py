"""Weights & Biases logging, opt-in (`metrics.enable_wandb`), as torchtitan's WandBLogger: rank 0's MetricsLogger
(harness/metrics.py) sends what it writes to metrics.jsonl and TensorBoard to one W&B run as well.

The run: project = job.name; id = the run's line id (harness/run_outputs.py), the same for every launch of the line,
so a resumed launch continues the same W&B run (resume="allow"); its local files under the dump folder (wandb's dir,
<dump_folder>/wandb/); its config the run's resolved config. Where it is sent is W&B's own business: `wandb login`, or
WANDB_MODE=offline (then `wandb sync <dump_folder>/wandb/offline-run-*`), WANDB_ENTITY, ... W&B keeps a run's steps
increasing: a launch that resumes from step k logs its steps up to the last one the run logged before to W&B in vain
(W&B drops them, with a warning); metrics.jsonl and TensorBoard hold them.

wandb is imported here only, when a run asks for it (~0.5 s, and its service process); a run that asks for it without
it installed is refused before it starts (harness/config/run_requirements.py).
"""

from __future__ import annotations

from pathlib import Path

from .run_outputs import OutputError


class WandbLogger:
    def __init__(self, project: str, run_id: str, folder: str | Path, config: dict):
        import wandb

        try:
            self.run = wandb.init(project=project, id=run_id, resume="allow", dir=str(folder), config=config)
        except wandb.errors.Error as e:  # not logged in, a refused key, a project one may not write to
            raise OutputError(f"Weights & Biases (metrics.enable_wandb) refused the run: {e}; `wandb login` first, or "
                              f"set WANDB_MODE=offline to keep the run on disk for a later `wandb sync`") from None

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        """`metrics` at `step`, those with a value (mfu is None on CPU)."""
        self.run.log({key: value for key, value in metrics.items() if value is not None}, step=step)

    def close(self) -> None:
        self.run.finish()
