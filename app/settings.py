"""Where each setting comes from: a flag, else SPOOL_<DEST> in the environment, else a key of the
--config YAML file (vLLM's format: long flag names as keys), else its default.

The table is the command's own argparse parser, so a new flag is at once an environment
variable and a config key. `--print-config` shows each value and where it came from.
"""

import argparse
import json
import os
import re
from pathlib import Path

ENV_PREFIX = "SPOOL_"
SECRET = {"api_key"}
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}
_NOT_SETTINGS = {"help", "config", "print_config", "model_arg", "prompt", "peer_notes"}


class SettingsError(ValueError):
    """A value from the environment or the config file that its flag would refuse, in one line."""


def add_arguments(parser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="read settings from a YAML file of flag names and values (as vLLM's --config);"
                             " flags and SPOOL_* variables win over it (default: $SPOOL_CONFIG, else none)")
    parser.add_argument("--print-config", action="store_true",
                        help="print every setting, its value and where it came from, then exit")


def settings(parser) -> dict[str, argparse.Action]:
    """Each setting's dest and the action that names it first (its primary flag)."""
    found = {}
    for action in parser._actions:
        if action.option_strings and action.dest not in _NOT_SETTINGS and action.help != argparse.SUPPRESS:
            found.setdefault(action.dest, action)
    return found


def env_name(dest: str) -> str:
    return ENV_PREFIX + dest.upper()


def primary_flag(action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def resolve(parser, argv, environ=None) -> tuple[argparse.Namespace, dict[str, str]]:
    """The parsed namespace, every setting layered flag > environment > file > default, and
    each setting's source ("--flag", "SPOOL_X", the file's path, or "default")."""
    environ = os.environ if environ is None else environ
    args = parser.parse_args(argv)
    given = _given_on_command_line(parser, argv)
    table = settings(parser)
    sources = {dest: "default" for dest in table}
    config = args.config if "config" in given else environ.get(env_name("config"))
    for key, raw in (_read_config(config) if config else {}).items():
        action, negated = _action_for_key(parser, table, key, config)
        value = _convert(action, raw, f"{config}: {key}")
        if action.dest not in given and env_name(action.dest) not in environ:
            setattr(args, action.dest, not value if negated else value)
            sources[action.dest] = config
    for dest, action in table.items():
        if dest in given:
            sources[dest] = "command line"
        elif (raw := environ.get(env_name(dest))) is not None:
            setattr(args, dest, _convert(action, raw, env_name(dest)))
            sources[dest] = env_name(dest)
    return args, sources


def describe(parser, args, sources) -> str:
    """--print-config's table: each setting's primary flag, value and source; secrets masked."""
    rows = []
    for dest, action in settings(parser).items():
        value = getattr(args, dest)
        shown = "****" if dest in SECRET and value else " ".join(value) if isinstance(value, list) else str(value)
        rows.append((primary_flag(action), shown, sources[dest]))
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{flag:<{width[0]}}  {value:<{width[1]}}  {source}" for flag, value, source in rows)


def _given_on_command_line(parser, argv) -> set[str]:
    """The dests argv itself sets: parsed again with every default suppressed."""
    defaults = [(action, action.default) for action in parser._actions]
    try:
        for action, _ in defaults:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(argv)))
    finally:
        for action, default in defaults:
            action.default = default


def _read_config(path: str) -> dict:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise SettingsError(f"cannot read the config file {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SettingsError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path} must hold a mapping of flag names to values, not a {type(data).__name__}")
    return data


def _action_for_key(parser, table, key, path) -> tuple[argparse.Action, bool]:
    """A key is a long flag name without its dashes, in either spelling (max-num-seqs or
    max_num_seqs), aliases included; the action, and whether the key is a --no-x that negates it."""
    flag = "--" + str(key).replace("_", "-")
    for action in parser._actions:
        if flag in action.option_strings and action.dest in table:
            return action, isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-")
    raise SettingsError(f"{path}: {key!r} is not a setting of this command (see --help)")


def _convert(action, raw, where: str):
    """raw (an environment string, or a YAML scalar or list) as the flag would have parsed it."""
    if raw is None:
        raise SettingsError(f"{where}: no value")
    if action.nargs == 0:  # a switch: store_true, store_false or --x/--no-x
        if isinstance(raw, bool):
            on = raw
        elif str(raw).strip().lower() in _TRUE | _FALSE:
            on = str(raw).strip().lower() in _TRUE
        else:
            raise SettingsError(f"{where}: {raw!r} is not a boolean (true/false, 1/0, yes/no, on/off)")
        return on if action.const is not False else not on
    if isinstance(action, argparse._AppendAction):  # a repeated flag (--lora FILE): a list of what each takes
        items = [str(v) for item in (raw if isinstance(raw, list) else re.split(r"[,\s]+", str(raw).strip()))
                 for v in (item if isinstance(item, list) else [item]) if str(v)]
        width = action.nargs if isinstance(action.nargs, int) else 1
        if not items or len(items) % width:
            raise SettingsError(f"{where}: takes values in groups of {width}")
        groups = [items[i:i + width] for i in range(0, len(items), width)]
        return groups if isinstance(action.nargs, int) else [g[0] for g in groups]
    many = action.nargs in ("+", "*")
    if isinstance(raw, list) and not many:
        try:  # one value that reads a JSON list (--allowed-origins) takes a YAML list whole
            return action.type(json.dumps(raw))
        except (TypeError, ValueError):
            raise SettingsError(f"{where}: takes one value, not a list") from None
    if isinstance(raw, list):
        items = raw
    else:
        items = [s for s in re.split(r"[,\s]+", str(raw).strip()) if s] if many else [raw]
    values = []
    for item in items:
        text = json.dumps(item) if isinstance(item, dict) else str(item)  # a JSON-valued flag's YAML mapping
        try:
            value = action.type(text) if action.type else text
        except (TypeError, ValueError):
            raise SettingsError(f"{where}: {item!r} is not a valid {getattr(action.type, '__name__', 'value')}"
                                ) from None
        if action.choices is not None and value not in action.choices:
            raise SettingsError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
        values.append(value)
    return values if many else values[0]
