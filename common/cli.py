"""Command-line helpers shared by every step: argument types and the one-line error contract."""
import functools
import os
import sys


class UserError(Exception):
    """A problem the user can fix. Printed as one line (with the fix), exit status 2."""


def _whole_number(text, minimum, rule):
    try:
        value = int(text)
    except ValueError:
        raise _arg_error(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise _arg_error(f"must be {rule}, got {value}")
    return value


def positive_int(text):
    return _whole_number(text, 1, "positive")


def non_negative_int(text):
    return _whole_number(text, 0, "0 or more")


def positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise _arg_error(f"expected a number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise _arg_error(f"must be a positive finite number, got {text}")
    return value


def _arg_error(message):
    import argparse

    return argparse.ArgumentTypeError(message)


def exits_cleanly(main):
    """Turn a UserError into one line on stderr and exit status 2, never a traceback.

    Under a launcher every rank prints its own line, prefixed with its rank, so the launcher's
    log says which process gave up and why.
    """

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as error:
            rank = os.environ.get("RANK")
            prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
            print(f"{prefix}error: {error}", file=sys.stderr, flush=True)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr, flush=True)
            sys.exit(130)

    return wrapper
