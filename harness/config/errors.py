"""ConfigError: bad configuration input, every problem found at once."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .schema import JobConfig


class ConfigError(ValueError):
    """Bad configuration input: every problem found (`problems`, each naming the file or key at fault), numbered
    in one message when there are several.

    From `load_config`, also what loaded despite them: `partial`, the config with each rejected value left at its
    default (None when no config could be read: a missing or malformed file), and `rejected`, the keys whose given
    values were refused."""

    def __init__(self, problems: str | list[str], partial: JobConfig | None = None,
                 rejected: frozenset[str] = frozenset()):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.partial, self.rejected = partial, rejected
        super().__init__(describe_problems(self.problems))


def describe_problems(problems: list[str]) -> str:
    """One problem as it is; several numbered (their own texts may hold semicolons)."""
    if len(problems) == 1:
        return problems[0]
    return f"the run cannot start, {len(problems)} problems: " + " ".join(
        f"({i}) {p}{';' if i < len(problems) else ''}" for i, p in enumerate(problems, 1))
