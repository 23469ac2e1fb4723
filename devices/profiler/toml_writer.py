"""Writing TOML: the standard library reads it (``tomllib``) but does not write it.

Enough of it for a profile file: top-level tables of str/int/float/bool values, lists of
them, and lists of flat records (the compute model's exact cache), one record a line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

TomlValue = bool | int | float | str | Mapping[str, "TomlValue"] | Sequence["TomlValue"]
Table = Mapping[str, TomlValue]


def _toml_value(value: TomlValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(float(value))  # Python's float spellings are TOML's (inf, nan too)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are a subset of TOML's
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        if value and isinstance(value[0], Mapping):  # a list of records: one per line
            return "[\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]"
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ValueError(f"cannot write {type(value).__name__} to TOML")


def dump_toml(tables: Mapping[str, Table]) -> str:
    """TOML for top-level tables of str/int/float/bool values and lists of them or of flat
    records."""
    return "\n".join(
        f"[{name}]\n" + "".join(f"{key} = {_toml_value(value)}\n" for key, value in table.items())
        for name, table in tables.items()
    )
