"""Errors a user can cause with tuner options; the CLI turns them into exit code 2."""


class AutotuneError(Exception):
    """A one-line, actionable message about bad tuner input or state."""
