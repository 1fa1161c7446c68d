"""What a relaunch changes lives in harness/config/resume.py; this name stays while harness/checkpoint/checkpointer.py
imports `data_changes` from it."""

from .config.resume import data_changes

__all__ = ["data_changes"]
