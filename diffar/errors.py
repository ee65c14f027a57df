"""The one exception type the CLI turns into a one-line message and a non-zero exit."""


class DiffarError(Exception):
    """A user-facing error: bad input, a missing file, mismatched artefacts. Never a bug."""
