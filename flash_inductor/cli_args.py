"""What the command-line tools share about their arguments: a user's mistake is caught before any
work starts and reported as one line on stderr with exit code 2, never a traceback after the work.

    parser = cli_args.Parser(prog="python -m flash_inductor.tool")   # argparse errors: one line
    cli_args.output_dir("--out", args.out)                           # raises UsageError
    sys.exit(cli_args.run(main))                                     # UsageError -> one line, 2

Only :class:`UsageError` (and argparse's own errors) get this treatment: any other exception is
a bug or an environment problem, and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pathlib
import sys
from typing import Callable, Iterable, Optional

from .tuning.cache import CACHE_DIR_ENV, prove_writable, user_cache_dir

USAGE_EXIT_CODE = 2  # argparse's and the shell's code for a bad command line


class UsageError(SystemExit):
    """A mistake in the command line; ``str()`` names the argument and the fix.

    A SystemExit, so that a caller that does not use :func:`run` still stops without a traceback
    and callers that test ``main()`` in-process can ``pytest.raises(SystemExit, match=...)``.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))  # one line, whatever the message held

    def __str__(self) -> str:
        return str(self.args[0])


MODULE_PREFIX = "python -m flash_inductor."
SCRIPT_PREFIX = "flash-inductor-"  # the console scripts (pyproject.toml): flash-inductor-autotune, ...


def invoked_as(prog: str) -> str:
    """``prog`` ("python -m flash_inductor.autotune") as the user typed it: the console script's
    name (``flash-inductor-autotune``) when that is what runs, so that usage lines and errors name
    the command the user can repeat."""
    script = os.path.splitext(os.path.basename(sys.argv[0]))[0] if sys.argv and sys.argv[0] else ""
    if prog.startswith(MODULE_PREFIX) and script == SCRIPT_PREFIX + prog[len(MODULE_PREFIX):]:
        return script
    return prog


class Parser(argparse.ArgumentParser):
    """argparse, with its errors as one line (no usage block) and exit code 2; ``prog`` is shown
    as :func:`invoked_as` gives it."""

    def __init__(self, *args, prog: Optional[str] = None, **kwargs):
        super().__init__(*args, prog=invoked_as(prog) if prog else None, **kwargs)

    def error(self, message: str):
        raise UsageError(f"{message} (see {self.prog} --help)")


class RenamedOption(argparse.Action):
    """An old spelling of an option, hidden from ``--help``: it still works, with a one-line note
    on stderr naming the new one (``help=argparse.SUPPRESS`` and ``dest`` of the new option)::

        p.add_argument("--output", dest="out", action=cli_args.RenamedOption, new="--out", help=argparse.SUPPRESS)
    """

    def __init__(self, *args, new: str, **kwargs):
        self.new = new
        super().__init__(*args, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is now {self.new}; the old name will be removed", file=sys.stderr)
        setattr(namespace, self.dest, values)


def run(main: Callable[..., int], argv=None, prog: Optional[str] = None) -> int:
    """``main(argv)``, with a :class:`UsageError` printed as one line on stderr and code 2, and a
    reader that stopped early (``| head``) ending the output quietly, as other command-line tools do."""
    try:
        return main(argv)
    except UsageError as error:
        prefix = f"{invoked_as(prog)}: " if prog else ""
        print(f"{prefix}error: {error}", file=sys.stderr)
        return USAGE_EXIT_CODE
    except BrokenPipeError:
        # Python would report the pipe again when it flushes stdout at exit: point stdout at
        # nothing first. 141 is a shell's code for a process ended by SIGPIPE.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


# ------------------------------------------------------------------------------------------
# Values
# ------------------------------------------------------------------------------------------


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below {low}; give an integer >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def seconds(text: str) -> float:
    """An argparse ``type``: a number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds >= 0")
    return value


def int_list(text: str, arg: str, low: int = 1) -> tuple[int, ...]:
    """``"2048,4096"`` as integers >= ``low``; UsageError naming ``arg`` otherwise."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise UsageError(f"{arg}: {text!r} is not a comma-separated list of integers, e.g. 2048,4096") from None
    if not values or any(v < low for v in values):
        raise UsageError(f"{arg}: {text!r}: give integers >= {low}, comma-separated, e.g. 2048,4096")
    return values


def known_names(arg: str, names: Iterable[str], known: Iterable[str]) -> list[str]:
    """``names`` when each is in ``known``; UsageError naming ``arg``, the unknown ones and the
    choices otherwise."""
    names, known = list(names), list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UsageError(f"{arg}: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return names


# ------------------------------------------------------------------------------------------
# Paths
# ------------------------------------------------------------------------------------------


def _writable_ancestor(arg: str, path: pathlib.Path) -> None:
    """The nearest existing folder at or above ``path`` can take new entries, and no file sits
    where a folder must go."""
    for ancestor in (path, *path.parents):
        if ancestor.exists():
            break
    else:  # pragma: no cover -- the root exists
        return
    if not ancestor.is_dir():
        raise UsageError(f"{arg}: {path} lies under {ancestor}, which is a file; choose a path that is not under "
                         "a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"{arg}: cannot write to {ancestor}; choose a folder you can write to")
    if ancestor == path:
        try:
            prove_writable(path)
        except OSError as error:
            raise UsageError(f"{arg}: cannot write to {path} ({error.strerror or error}); "
                             "choose a folder you can write to") from None


def user_results_dir(arg: str) -> pathlib.Path:
    """Where a tool writes its results when ``arg`` is not given: ``results/`` in the user cache
    folder that also holds the tuning tables (``$FLASH_INDUCTOR_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/flash_inductor``, else ``~/.cache/flash_inductor``), never the current
    directory; UsageError when that folder cannot be resolved."""
    try:
        return user_cache_dir() / "results"
    except ValueError as error:
        raise UsageError(f"{error}, or pass {arg} with a folder") from None


USER_RESULTS_HELP = f"default: results/ in ${CACHE_DIR_ENV}, else ~/.cache/flash_inductor"


def output_dir(arg: str, value: os.PathLike) -> pathlib.Path:
    """A folder the tool will create if needed and write into; UsageError when it is a file,
    lies under a file, or cannot be written."""
    path = pathlib.Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise UsageError(f"{arg}: {path} is a file; give a folder (the tool writes its files into it)")
    _writable_ancestor(arg, path)
    return path


def output_file(arg: str, value: os.PathLike) -> pathlib.Path:
    """A file the tool will write (its folder created if needed); UsageError when a folder is in
    its place, its folder is a file, or it cannot be written."""
    path = pathlib.Path(value).expanduser()
    if path.is_dir():
        raise UsageError(f"{arg}: {path} is a folder; give a file path, e.g. {path / 'result.json'}")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{arg}: cannot overwrite {path}; choose a file you can write")
    _writable_ancestor(arg, path.parent)
    return path


def input_file(arg: str, value: os.PathLike) -> pathlib.Path:
    """An existing, readable file."""
    path = pathlib.Path(value).expanduser()
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise UsageError(f"{arg}: {path} {what}; give an existing file")
    if not os.access(path, os.R_OK):
        raise UsageError(f"{arg}: cannot read {path}; check its permissions")
    return path


# ------------------------------------------------------------------------------------------
# Code named on the command line
# ------------------------------------------------------------------------------------------


def load_callable(arg: str, spec: str, example: str, expected: str, positional: int = 1) -> Callable:
    """``MODULE:ATTR[.ATTR...]`` imported and checked to be callable with ``positional``
    positional arguments (``expected`` says how, e.g. "factory(length) -> (model, inputs)");
    UsageError naming what is missing otherwise. Errors raised while the
    module itself runs are its own, and keep their traceback."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"{arg}: expected MODULE:FACTORY (e.g. {example}), got {spec!r}")
    # Modules of the current folder are found as under `python -m`, which puts it on sys.path; a
    # console script's sys.path starts with its bin folder instead. A CLI process only: the tools
    # call this from their main().
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name is None or not module_name.startswith(error.name):
            raise  # the module exists and imports something missing: its own problem
        raise UsageError(f"{arg}: no module named {module_name!r}; check the name and that it is on "
                         "PYTHONPATH (run from the folder that holds it)") from None
    for part in attr.split("."):
        if not hasattr(target, part):
            raise UsageError(f"{arg}: {module_name} has no attribute {attr!r}; check the name after ':'")
        target = getattr(target, part)
    if not callable(target):
        raise UsageError(f"{arg}: {spec} is a {type(target).__name__}, not a function; name a {expected}")
    try:
        inspect.signature(target).bind(*range(positional))
    except TypeError:
        raise UsageError(f"{arg}: {spec} cannot be called with {positional} argument(s); name a "
                         f"{expected}") from None
    except ValueError:
        pass  # a builtin without a signature: trust it
    return target
