"""Options of the serve commands from the environment: a flag given > $SPECSPLIT_<FLAG> > the default.

`env_defaults(parser)` makes each variable set (`--max-batch` → SPECSPLIT_MAX_BATCH) its option's
default; `resolve_env(args)` parses those after the command line was read, as the flag would be
parsed, so a malformed value is an error naming the variable, and a flag given simply wins.
"""

from __future__ import annotations

import argparse
import os

from specsplit.shared.errors import InvalidRequest

ENV_PREFIX = "SPECSPLIT_"
# `up` / `demo --mps [on|auto|off]` as `specsplit.pair.ServiceSpec.mps` takes it (None: try, else without)
MPS_CHOICES = {"on": True, "auto": None, "off": False}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class Append(argparse.Action):
    """action="append", except that a flag given replaces (not extends) a value from the environment."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        items = getattr(namespace, self.dest, None)
        setattr(namespace, self.dest, (items if isinstance(items, list) else []) + [values])


class FromEnv:
    """An option's default read from its environment variable; `value` parses it as the flag would be,
    after the command line (a flag given replaces it)."""

    def __init__(self, action: argparse.Action, variable: str, raw: str) -> None:
        self.action, self.variable, self.raw = action, variable, raw

    def __str__(self) -> str:  # what --help shows as the default
        return f"{self.raw} from ${self.variable}"

    def value(self):
        if self.action.nargs == 0:  # a switch: --cuda-graphs/--no-cuda-graphs, store_true
            word = self.raw.strip().lower()
            if word not in _TRUE + _FALSE:
                raise InvalidRequest(f"${self.variable}={self.raw!r}: expected one of {', '.join(_TRUE + _FALSE)}")
            return word in _TRUE
        if isinstance(self.action, Append):
            return [self._one(part.strip()) for part in self.raw.split(",") if part.strip()]
        return self._one(self.raw)

    def _one(self, text: str):
        kind = self.action.type
        try:
            value = kind(text) if kind is not None else text
        except (TypeError, ValueError):
            raise InvalidRequest(f"${self.variable}={text!r}: not a valid {getattr(kind, '__name__', kind)} "
                                 f"(for {self.action.option_strings[0]})") from None
        if self.action.choices is not None and value not in self.action.choices:
            raise InvalidRequest(f"${self.variable}={text!r}: expected one of {', '.join(map(str, self.action.choices))}")
        return value


def env_variable(action: argparse.Action) -> str:
    """--max-batch → SPECSPLIT_MAX_BATCH."""
    flag = next(o for o in action.option_strings if o.startswith("--"))
    return ENV_PREFIX + flag[2:].upper().replace("-", "_")


def env_defaults(parser: argparse.ArgumentParser) -> None:
    """flag > $SPECSPLIT_<FLAG> > default, for every option of `parser` (a serve command): a variable
    set now becomes the option's default, parsed by `resolve_env` once the command line is read."""
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if isinstance(action, argparse._AppendAction):
            raise TypeError(f"{action.option_strings[0]}: use options.Append: a flag given must replace an environment value, not extend it")
        variable = env_variable(action)
        if variable in os.environ:
            action.default = FromEnv(action, variable, os.environ[variable])
            action.required = False


def resolve_env(args: argparse.Namespace) -> None:
    for name, value in vars(args).items():
        if isinstance(value, FromEnv):
            setattr(args, name, value.value())
