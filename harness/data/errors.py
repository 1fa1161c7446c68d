"""DataError: a dataset, its token cache or a saved data position that cannot feed the run as configured.

Bad input, not a bug: harness/train.py prints its message as one `error:` line and exits 2. Every message names
the thing at fault (file and line, byte offset, cache folder, state key) and what to do about it.
"""


class DataError(ValueError):
    """The data cannot feed the run: a malformed file, an empty dataset, a damaged cache, a position that does not
    fit the data."""
