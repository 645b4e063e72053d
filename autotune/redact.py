"""Storage URLs and command lines fit for logs, reports and best.yaml: passwords hidden."""

from __future__ import annotations

from sqlalchemy.engine import make_url


def redact(url: str) -> str:
    """A storage URL fit for logs and reports: the password hidden."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - not a SQLAlchemy URL: nothing to hide in it
        return url


def redact_argv(argv: list[str]) -> list[str]:
    """A command line fit for best.yaml and the report: --storage passwords hidden."""
    shown: list[str] = []
    for index, arg in enumerate(argv):
        if index > 0 and argv[index - 1] == "--storage":
            arg = redact(arg)
        elif arg.startswith("--storage="):
            arg = "--storage=" + redact(arg.removeprefix("--storage="))
        shown.append(arg)
    return shown
