"""Layered, strictly validated configuration shared by the subcommands.

A subcommand describes its settings once, as a frozen dataclass whose fields all
have defaults, and gets flags, environment variables and a TOML file from it.
Precedence, highest first::

    command-line flag  >  MORPHLING_<FIELD>  >  TOML file  >  field default

Field types are ``int``, ``float``, ``bool`` and ``str``. Optional field metadata:
``help`` (str), ``choices`` (tuple), ``min`` and ``max`` (inclusive bounds),
``aliases`` (extra flag spellings, e.g. ``("--listen_ip",)``) and ``secret``.

A ``secret`` field (a str, e.g. ``token``) is never shown: ``describe`` and error
messages mask it. Every layer also takes it from a file (for ``token``:
``--token-file PATH``, ``MORPHLING_TOKEN_FILE``, ``token_file`` in the TOML file), so
that it need not be on the command line, which ``ps`` shows every user, or in a widely
readable settings file. A value and a file in the same layer is an error.

Values given as text (flags, environment) are parsed: ints accept a plain integer
or one with a binary size suffix, ``B``, ``KiB``, ``MiB`` or ``GiB`` (``4MiB`` is
4194304; the suffix is case-sensitive and decimal ``MB`` is refused as
ambiguous); bools accept 1/0, true/false, yes/no in any case. TOML values must
already have the field's type (a float field also takes an integer), so
``block_size = "4MiB"`` or ``window = true`` in a file are errors.

Every layer that supplies a value is validated, even one a higher layer
overrides, so a typo in a file or variable fails at start instead of waiting
for the day the override is dropped. ``choices`` and the bounds apply to every
source, defaults included.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, get_type_hints

ENV_PREFIX = "MORPHLING_"

T = TypeVar("T")

_TYPES = (int, float, bool, str)
_METADATA_KEYS = frozenset({"help", "choices", "min", "max", "aliases", "secret"})
_INT_TEXT = re.compile(r"\s*([+-]?\d+)\s*(B|KiB|MiB|GiB)?\s*")
SIZE_UNITS = {None: 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_TRUE = frozenset({"1", "true", "yes"})
_FALSE = frozenset({"0", "false", "no"})


class ConfigError(ValueError):
    """A setting is malformed, out of range or unknown; the message says which and where from."""


@dataclasses.dataclass(frozen=True)
class _Field:
    """One schema field with its metadata resolved, so the rest of the module needn't re-check."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None
    min: float | None
    max: float | None
    aliases: tuple[str, ...]
    secret: bool

    @property
    def flag(self) -> str:
        return _flag(self.name)

    @property
    def env(self) -> str:
        return _env(self.name)

    @property
    def file_key(self) -> str:
        """The key (flag, variable, TOML) that names a file holding a secret field's value."""
        return f"{self.name}_file"

    def show(self, value: Any) -> str:
        """``value`` as logs and errors may print it: a secret only says whether it is set."""
        if self.secret:
            return "<secret>" if value else "''"
        return repr(value)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _env(key: str) -> str:
    return ENV_PREFIX + key.upper()


def env_names(schema: type) -> set[str]:
    """The environment variables that set ``schema``'s fields."""
    return {_env(f.name) for f in dataclasses.fields(schema)}


def _keys(fields: list[_Field]) -> list[str]:
    """Every key a source may give: the fields, and the file form of each secret."""
    return [f.name for f in fields] + [f.file_key for f in fields if f.secret]


def _fields(schema: type) -> list[_Field]:
    """Resolve and check a schema; mistakes in it are programming errors, hence TypeError."""
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        raise TypeError(f"{schema!r} is not a dataclass")
    hints = get_type_hints(schema)  # resolves string annotations (from __future__ import)
    fields = []
    for f in dataclasses.fields(schema):
        where = f"{schema.__name__}.{f.name}"
        typ = hints[f.name]
        if typ not in _TYPES:
            raise TypeError(f"{where}: type {typ!r} is not one of int, float, bool, str")
        if f.default is dataclasses.MISSING:
            raise TypeError(f"{where}: every field needs a plain default")
        if f.name == "config":
            raise TypeError(f"{where}: the name 'config' is taken by --config")
        extra = set(f.metadata) - _METADATA_KEYS
        if extra:
            raise TypeError(f"{where}: unknown metadata {sorted(extra)}")
        choices = f.metadata.get("choices")
        secret = bool(f.metadata.get("secret", False))
        if secret and typ is not str:
            raise TypeError(f"{where}: a secret must be a str")
        fields.append(
            _Field(
                name=f.name,
                type=typ,
                default=f.default,
                help=f.metadata.get("help", ""),
                choices=None if choices is None else tuple(choices),
                min=f.metadata.get("min"),
                max=f.metadata.get("max"),
                aliases=tuple(f.metadata.get("aliases", ())),
                secret=secret,
            )
        )
    names = {f.name for f in fields}
    for field in fields:
        if field.secret and field.file_key in names:
            raise TypeError(
                f"{schema.__name__}.{field.file_key}: the name is taken by {field.name}'s file"
            )
    return fields


def option(default: Any, help: str, **metadata: Any) -> Any:
    """A schema field: its default, help text and metadata (choices, bounds, aliases,
    secret). A secret is also left out of the dataclass's repr."""
    return dataclasses.field(
        default=default, metadata={"help": help, **metadata}, repr=not metadata.get("secret")
    )


def add_command(
    sub: argparse._SubParsersAction,
    name: str,
    schema: type,
    func: Any,
    *,
    help: str,
    description: str,
) -> argparse.ArgumentParser:
    """A subcommand whose settings are ``schema``, read from the TOML table ``[name]``."""
    parser = sub.add_parser(
        name,
        help=help,
        description=f"{description} Settings: flags > {ENV_PREFIX}* environment > "
        f"--config TOML [{name}] > defaults.",
    )
    add_arguments(parser, schema)
    parser.set_defaults(func=func)
    return parser


def add_arguments(parser: argparse.ArgumentParser, schema: type) -> None:
    """Add one flag per field (plus aliases) and ``--config PATH`` to ``parser``.

    Every flag defaults to None so that ``load`` can tell "not given" from a
    value that happens to equal the default. Non-bool values stay text here
    and are parsed by ``load``, so bad values raise ConfigError like any other
    source and size suffixes work on the command line.
    """
    for f in _fields(schema):
        note = f"(default: {f.default!r}; env: {f.env})"
        if f.secret:
            note = f"(default: none; env: {f.env}; ps shows it here: prefer {_flag(f.file_key)})"
        text = f"{f.help} {note}" if f.help else note
        kwargs: dict[str, Any] = {"dest": f.name, "default": None, "help": text.replace("%", "%%")}
        if f.type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.choices is not None:
            kwargs["metavar"] = "{" + ",".join(str(c) for c in f.choices) + "}"
        parser.add_argument(f.flag, *f.aliases, **kwargs)
        if f.secret:
            parser.add_argument(
                _flag(f.file_key),
                dest=f.file_key,
                metavar="PATH",
                default=None,
                help=f"read {f.flag} from this file, one line (env: {_env(f.file_key)}; "
                f"TOML: {f.file_key})",
            )
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=None,
        help=f"TOML configuration file (flags > {ENV_PREFIX}* environment > file > defaults)",
    )


def parse_int(text: str) -> int:
    """An integer with an optional binary size suffix (``B``, ``KiB``, ``MiB``, ``GiB``)."""
    match = _INT_TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not an integer with an optional KiB, MiB or GiB suffix")
    return int(match[1]) * SIZE_UNITS[match[2]]


def _parse_text(f: _Field, text: str, where: str) -> Any:
    """Parse a flag or environment string into the field's type."""
    if f.type is str:
        return text
    if f.type is bool:
        word = text.strip().lower()
        if word in _TRUE:
            return True
        if word in _FALSE:
            return False
        raise ConfigError(f"{where}: expected bool (1/0, true/false, yes/no), got {text!r}")
    if f.type is int:
        try:
            return parse_int(text)
        except ValueError:
            raise ConfigError(
                f"{where}: expected int (optionally with KiB, MiB, GiB), got {text!r}"
            ) from None
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{where}: expected float, got {text!r}") from None


def read_text(path: str, where: str) -> str:
    """File ``path`` as UTF-8 text; ConfigError naming ``where`` (the setting) when it
    cannot be read."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: {path} is not UTF-8 text") from None


def read_secret(path: str, where: str) -> str:
    """The secret in file ``path``: its one line, without the line end. An empty file is an
    error, not an empty secret, which would quietly turn authentication off."""
    secret = read_text(path, where).rstrip("\r\n")
    if not secret:
        raise ConfigError(f"{where}: {path} is empty")
    if "\n" in secret:
        raise ConfigError(f"{where}: {path} has more than one line")
    return secret


def _convert(f: _Field, raw: Any, where: str, *, text_ok: bool) -> Any:
    """Type-check (or, where ``text_ok``, parse) one value and enforce choices and bounds."""
    if text_ok and isinstance(raw, str):
        value = _parse_text(f, raw, where)
    elif f.type is float and type(raw) is int:
        value = float(raw)
    elif type(raw) is f.type:  # exact: True must not pass as an int
        value = raw
    else:
        got = type(raw).__name__ if f.secret else repr(raw)
        raise ConfigError(f"{where}: expected {f.type.__name__}, got {got}")
    if f.type is float and not math.isfinite(value):
        raise ConfigError(f"{where}: expected a finite float, got {raw!r}")
    if f.choices is not None and value not in f.choices:
        allowed = ", ".join(repr(c) for c in f.choices)
        raise ConfigError(f"{where}: {raw!r} is not one of {allowed}")
    if f.min is not None and value < f.min:
        raise ConfigError(f"{where}: {raw!r} is below the minimum {f.min!r}")
    if f.max is not None and value > f.max:
        raise ConfigError(f"{where}: {raw!r} is above the maximum {f.max!r}")
    return value


# The tables a settings file may have: one per command that reads one.
SECTIONS = ("emulator", "device", "fleet", "run")


def _did_you_mean(word: str, names: Sequence[str], spell: str = "{!r}") -> str:
    """The "did you mean" ending of an error for a misspelt ``word``: the closest known
    name, written by ``spell``; empty when none is close."""
    close = difflib.get_close_matches(word, names, n=1)
    return f"; did you mean {spell.format(close[0])}?" if close else ""


def _unknown_key(key: str, where: str, names: list[str]) -> ConfigError:
    hint = _did_you_mean(key, names)
    return ConfigError(f"unknown key {key!r} in {where} (known: {', '.join(names)}){hint}")


def _read_toml(path: Path, section: str | None, names: list[str]) -> tuple[dict[str, Any], str]:
    """Return the file's settings for this schema and the label used in error messages."""
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid TOML in config file {path}: {exc}") from exc
    where = str(path)
    if section is not None:
        for key, value in data.items():
            if not isinstance(value, dict):
                raise ConfigError(
                    f"{path}: top-level key {key!r} = {value!r} is not a table; "
                    f"settings belong under [{section}]"
                )
            if key not in SECTIONS and key != section:  # a misspelling would configure nothing
                hint = _did_you_mean(key, SECTIONS, "[{}]")
                raise ConfigError(
                    f"{path}: unknown table [{key}] (known: {', '.join(SECTIONS)}){hint}"
                )
        # Other tables are other roles' sections; a file without ours configures nothing here.
        data = data.get(section, {})
        where = f"{path} [{section}]"
    for key in data:
        if key not in names:
            raise _unknown_key(key, where, names)
    return data, where


def _given_flags(
    args: argparse.Namespace | Mapping[str, Any] | None, names: list[str]
) -> dict[str, Any]:
    """Flag values that were actually given (None means "not given").

    A Namespace may carry other attributes (subcommand, --config, ...), so only
    schema fields are read from it; a Mapping is explicit overrides and must
    name known fields only.
    """
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        given = {name: getattr(args, name, None) for name in names}
    else:
        for key in args:
            if key not in names:
                raise _unknown_key(key, "args", names)
        given = dict(args)
    return {name: value for name, value in given.items() if value is not None}


def load(
    schema: type[T],
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    toml_path: str | Path | None = None,
    section: str | None = None,
) -> tuple[T, dict[str, str]]:
    """Build a ``schema`` instance from flags, environment, TOML file and defaults.

    Returns the config and, per field, where its value came from: "flag",
    "env", "file" or "default". ``env`` defaults to ``os.environ``; only the
    ``MORPHLING_<FIELD>`` variables of this schema are read. A Namespace's
    ``config`` attribute (from ``--config``), when set, replaces ``toml_path``.
    With ``section``, settings are read from that table of the file and every
    top-level key must be a table. Raises ConfigError on any invalid value.
    """
    fields = _fields(schema)
    keys = _keys(fields)
    environ = os.environ if env is None else env
    flags = _given_flags(args, keys)
    if isinstance(args, argparse.Namespace) and getattr(args, "config", None) is not None:
        toml_path = args.config
    file_values: dict[str, Any] = {}
    file_where = ""
    if toml_path is not None:
        file_values, file_where = _read_toml(Path(toml_path), section, keys)
    given = (  # per source: what it gives, how errors name a key of it, whether it is text
        ("flag", flags, lambda key: f"flag {_flag(key)}", True),
        (
            "env",
            {k: environ[_env(k)] for k in keys if _env(k) in environ},
            lambda key: f"env {_env(key)}",
            True,
        ),
        ("file", file_values, lambda key: f"{file_where} {key}", False),
    )

    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in fields:
        layers: list[tuple[str, Any, str, bool]] = []
        for source, supplied, spell, text_ok in given:
            if f.name in supplied:
                layers.append((source, supplied[f.name], spell(f.name), text_ok))
            if f.secret and f.file_key in supplied:
                path, where = supplied[f.file_key], spell(f.file_key)
                if f.name in supplied:
                    raise ConfigError(f"{spell(f.name)} and {where}: give one, not both")
                if not isinstance(path, str):
                    raise ConfigError(f"{where}: expected a file path, got {path!r}")
                layers.append((source, read_secret(path, where), where, False))
        layers.append(("default", f.default, f"default {schema.__name__}.{f.name}", False))
        for source, raw, where, text_ok in layers:
            value = _convert(f, raw, where, text_ok=text_ok)
            if f.name not in values:
                values[f.name], sources[f.name] = value, source
    return schema(**values), sources


def describe(config: Any, sources: Mapping[str, str]) -> str:
    """The effective configuration, one ``name = value  (source)`` line per field, for logs
    (which end up in the journal: secrets are masked)."""
    return "\n".join(
        f"{f.name} = {f.show(getattr(config, f.name))}  ({sources[f.name]})"
        for f in _fields(type(config))
    )
