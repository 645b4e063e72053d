"""Errors a user can cause with tuner options, and the exit codes scripts may rely on.

Exit codes of `autotune run`, `retune`, `worker` and `finalize` (stable; `retune` adds its
own outcome codes 3, 10 and 11, see autotune.cli.retune):

    0    done: best.yaml written (a better config was validated, or the baseline was kept
         and its measured standing reported)
    1    an unexpected failure (a bug; the traceback says where)
    2    bad input, refused before any server started (AutotuneError and friends)
    12   nothing could be measured: the baseline failed (request errors over the limit, a
         crash, an engine that would not start) or met the SLOs at no load the ladder tried
         (unless --search-anyway); no best.yaml was written
    13   the environment failed, not a config: a trial's server died on a missing module,
         a CUDA or driver error or a broken install; the study stopped after that trial,
         keeping what it measured; fix the install, then `--resume`
    130  stopped by Ctrl-C (SIGINT); 143 by SIGTERM; 129 by SIGHUP (128 + the signal number):
         the running trial's server was stopped and the trial closed; `--resume` continues
    141  stdout's reader went away (`| head -1`): every command ends quietly, as if killed
         by SIGPIPE (128 + 13), as standard tools do
"""

import argparse

from workloads.errors import VllmAutotuneError

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING_MEASURED = 12
EXIT_ENVIRONMENT = 13

# The epilog of `autotune --help` and of `autotune run|retune|worker|finalize --help`.
EXIT_CODES_HELP = """\
exit status:
  0    done (run, finalize: best.yaml written: a better config was validated, or the
       baseline was kept with its measured standing in report.md)
  1    unexpected failure (a bug: the traceback says where)
  2    bad input, refused before any server started (one line: the figure and the fix)
  12   nothing could be measured: the baseline failed (request errors over the limit, a
       crash, no engine start) or met the SLOs at no load tried (unless --search-anyway);
       no best.yaml was written, report.md says why
  13   the environment failed, not a config (a missing module, a CUDA or driver error):
       the study stopped after that trial, keeping what it measured; fix the install,
       then --resume
  130  stopped by Ctrl-C, 143 by SIGTERM, 129 by SIGHUP: the trial's server was stopped
       and the trial closed; --resume continues the study
  141  the reader of stdout went away (`| head -1`): a quiet stop, as SIGPIPE gives
  retune also: 0 no drift (nothing started), 3 drift found (--dry-run), 10 a new config
       was written, 11 drift but the deployed config stays (capacity objective: it still
       carries --headroom x the current traffic, one launch, no study; or no config beat it)"""


class HelpFormatter(argparse.HelpFormatter):
    """argparse's own, except that the exit-status epilog keeps its layout."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit status:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def describe_command(parser: argparse.ArgumentParser, description: str) -> None:
    """Gives a tuner command's parser its description, its --help ending with the exit
    statuses as `autotune --help` does."""
    parser.description = description
    parser.epilog = EXIT_CODES_HELP
    parser.formatter_class = HelpFormatter


class AutotuneError(VllmAutotuneError):
    """A one-line, actionable message about bad tuner input or state."""


class NothingMeasured(VllmAutotuneError):
    """The baseline could not be measured, so no figure of the study can be trusted and
    nothing is exported. The message is one line: what failed and what to look at."""


class EnvironmentFailure(VllmAutotuneError):
    """A trial's server died of the install or the machine (a missing module, a CUDA or
    driver error), which would fail every config alike: the study stops after that trial
    (exit 13), its measured trials kept for `--resume`. The message is one line: the trial,
    the module or error, and the fix."""
