"""The ``powertrain`` command's entry point (the console script and ``python -m powertrain``).

The command line imports torch (a second or more). A Ctrl-C while an extension module initialises leaves it half
made (numpy: "cannot load module more than once per process", exit 1 with a traceback), or is swallowed by a library
(the run went on and exited 0). So SIGINT is held back while the command line is imported and delivered once the
import is done: an interrupt at any moment from here on ends the command with one line and status 130. (Before this
code runs, the interpreter starts up, tens of milliseconds: a Ctrl-C there is Python's own affair.)"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    try:
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            from powertrain.cli import main as command
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)  # a Ctrl-C pressed meanwhile arrives here
        return command()
    except KeyboardInterrupt:  # before the command's own handlers: while importing, parsing, checking
        print("powertrain: interrupted", file=sys.stderr)
        return 130
