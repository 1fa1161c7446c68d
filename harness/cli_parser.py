"""The argument parser of the project's command-line tools (harness.convert, scripts/): a command-line mistake is bad
input like any other, one `error:` line and exit 2, not argparse's usage block and `prog: error:` line."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    def __init__(self, *args, help_command: str = "--help", **kwargs):
        super().__init__(*args, **kwargs)
        self.help_command = help_command  # named in the error line, for the arguments

    def error(self, message: str):
        print(f"error: {message} ({self.help_command} lists the arguments)", file=sys.stderr)
        sys.exit(2)
