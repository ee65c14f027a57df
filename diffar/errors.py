"""The exceptions the CLI turns into a one-line message and a non-zero exit."""


class DiffarError(Exception):
    """A user-facing error: bad input, a missing file, mismatched artefacts. Never a bug."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM stopped a command cleanly (e.g. a trainer, after saving): exit status 130, not an error."""
