"""The layered config loader: precedence, parsing, strict errors, sections, describe()."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from morphling.config import ConfigError, add_arguments, describe, load, option


@dataclass(frozen=True)
class Example:
    block_size: int = field(default=1 << 20, metadata={"help": "tile size in bytes", "min": 1})
    window: int = field(default=4, metadata={"min": 1})
    ratio: float = field(default=0.5, metadata={"min": 0.0})
    listen_ip: str = field(
        default="127.0.0.1", metadata={"help": "address to bind", "aliases": ("--listen_ip",)}
    )
    mode: str = field(default="fast", metadata={"choices": ("fast", "exact")})
    pin_memory: bool = False


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    return parser.parse_args(argv)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def raises(match: str):
    return pytest.raises(ConfigError, match=re.escape(match))


# --- precedence ---------------------------------------------------------------------------------


def test_defaults_when_nothing_is_given():
    config, sources = load(Example, parse(), env={})
    assert config == Example()
    assert set(sources.values()) == {"default"}
    assert list(sources) == ["block_size", "window", "ratio", "listen_ip", "mode", "pin_memory"]


@pytest.mark.parametrize(
    ("use_file", "use_env", "use_flag", "expected", "source"),
    [
        (False, False, False, 4, "default"),
        (True, False, False, 8, "file"),
        (True, True, False, 16, "env"),
        (True, True, True, 32, "flag"),
        (False, True, False, 16, "env"),
        (False, False, True, 32, "flag"),
        (True, False, True, 32, "flag"),
    ],
)
def test_each_layer_overrides_the_one_below(
    tmp_path, use_file, use_env, use_flag, expected, source
):
    argv = ["--window", "32"] if use_flag else []
    if use_file:
        argv += ["--config", str(write(tmp_path, "window = 8\n"))]
    env = {"MORPHLING_WINDOW": "16"} if use_env else {}
    config, sources = load(Example, parse(*argv), env=env)
    assert config.window == expected
    assert sources["window"] == source


def test_fields_come_from_different_sources_in_one_load(tmp_path):
    path = write(tmp_path, 'ratio = 0.25\nmode = "exact"\nwindow = 2\n')
    args = parse("--window", "3", "--config", str(path))
    env = {"MORPHLING_MODE": "fast", "MORPHLING_BLOCK_SIZE": "64"}
    config, sources = load(Example, args, env=env)
    assert config == Example(block_size=64, window=3, ratio=0.25, mode="fast")
    assert sources == {
        "block_size": "env",
        "window": "flag",
        "ratio": "file",
        "listen_ip": "default",
        "mode": "env",
        "pin_memory": "default",
    }


def test_toml_path_argument_and_config_flag(tmp_path):
    default_file = tmp_path / "default.toml"
    default_file.write_text("window = 5\n")
    chosen = write(tmp_path, "window = 6\n")
    config, _ = load(Example, parse(), env={}, toml_path=default_file)
    assert config.window == 5
    config, _ = load(Example, parse("--config", str(chosen)), env={}, toml_path=default_file)
    assert config.window == 6  # --config replaces the caller's default path


def test_mapping_args_accept_typed_and_text_values_and_skip_none():
    args = {"window": 7, "block_size": "2KiB", "ratio": 1, "mode": None, "pin_memory": "yes"}
    config, sources = load(Example, args, env={"MORPHLING_MODE": "exact"})
    assert (config.window, config.block_size, config.ratio) == (7, 2048, 1.0)
    assert config.pin_memory is True
    assert (config.mode, sources["mode"]) == ("exact", "env")
    assert sources["window"] == "flag"


def test_mapping_args_reject_unknown_keys():
    with raises("unknown key 'windw' in args (known: block_size, window"):
        load(Example, {"windw": 3}, env={})


def test_other_morphling_variables_are_ignored():
    env = {"MORPHLING_FLEET_SIZE": "not a number", "MORPHLING_WINDOW": "9", "WINDOW": "1"}
    config, sources = load(Example, env=env)
    assert (config.window, sources["window"]) == (9, "env")


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("MORPHLING_WINDOW", "11")
    config, sources = load(Example)
    assert (config.window, sources["window"]) == (11, "env")


# --- flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["--listen_ip", "--listen-ip"])
def test_aliases(spelling):
    config, sources = load(Example, parse(spelling, "0.0.0.0"), env={})
    assert (config.listen_ip, sources["listen_ip"]) == ("0.0.0.0", "flag")


def test_bool_flags():
    assert load(Example, parse("--pin-memory"), env={})[0].pin_memory is True
    config, sources = load(Example, parse("--no-pin-memory"), env={"MORPHLING_PIN_MEMORY": "1"})
    assert (config.pin_memory, sources["pin_memory"]) == (False, "flag")
    config, sources = load(Example, parse(), env={"MORPHLING_PIN_MEMORY": "1"})
    assert (config.pin_memory, sources["pin_memory"]) == (True, "env")


def test_help_names_defaults_env_vars_and_choices():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Example)
    text = " ".join(parser.format_help().split())
    assert "tile size in bytes (default: 1048576; env: MORPHLING_BLOCK_SIZE)" in text
    assert "--listen-ip LISTEN_IP, --listen_ip LISTEN_IP" in text
    assert "--pin-memory, --no-pin-memory" in text
    assert "(default: False; env: MORPHLING_PIN_MEMORY)" in text
    assert "--mode {fast,exact}" in text
    assert "--config PATH" in text


def test_bad_flag_value_names_the_flag():
    with raises("flag --window: expected int (optionally with KiB, MiB, GiB), got 'abc'"):
        load(Example, parse("--window", "abc"), env={})


# --- parsing --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [("7", 7), (" 7 ", 7), ("4MiB", 4 << 20), ("1 KiB", 1024), ("2GiB", 2 << 30), ("+3", 3)],
)
def test_int_size_suffixes(text, value):
    assert load(Example, env={"MORPHLING_BLOCK_SIZE": text})[0].block_size == value
    assert load(Example, parse("--block-size", text), env={})[0].block_size == value


@pytest.mark.parametrize("text", ["4MB", "4mib", "1.5MiB", "0x10", "", "MiB"])
def test_bad_int_text(text):
    with raises(
        f"env MORPHLING_BLOCK_SIZE: expected int (optionally with KiB, MiB, GiB), got {text!r}"
    ):
        load(Example, env={"MORPHLING_BLOCK_SIZE": text})


@pytest.mark.parametrize(
    ("text", "value"),
    [("1", True), ("TRUE", True), ("Yes", True), ("0", False), ("false", False), ("NO", False)],
)
def test_env_bools(text, value):
    assert load(Example, env={"MORPHLING_PIN_MEMORY": text})[0].pin_memory is value


def test_bad_env_bool():
    with raises("env MORPHLING_PIN_MEMORY: expected bool (1/0, true/false, yes/no), got 'on'"):
        load(Example, env={"MORPHLING_PIN_MEMORY": "on"})


def test_floats():
    assert load(Example, env={"MORPHLING_RATIO": "2"})[0].ratio == 2.0
    with raises("env MORPHLING_RATIO: expected float, got 'x'"):
        load(Example, env={"MORPHLING_RATIO": "x"})
    with raises("env MORPHLING_RATIO: expected a finite float, got 'nan'"):
        load(Example, env={"MORPHLING_RATIO": "nan"})


def test_toml_values_must_have_the_field_type(tmp_path):
    config, _ = load(Example, env={}, toml_path=write(tmp_path, "ratio = 3\npin_memory = true\n"))
    assert (config.ratio, config.pin_memory) == (3.0, True)
    assert isinstance(config.ratio, float)

    path = write(tmp_path, "[emulator]\nblock_size = 'abc'\n")
    with raises(f"{path} [emulator] block_size: expected int, got 'abc'"):
        load(Example, env={}, toml_path=path, section="emulator")
    path = write(tmp_path, "window = true\n")
    with raises(f"{path} window: expected int, got True"):
        load(Example, env={}, toml_path=path)
    path = write(tmp_path, 'block_size = "4MiB"\n')
    with raises(f"{path} block_size: expected int, got '4MiB'"):
        load(Example, env={}, toml_path=path)
    path = write(tmp_path, "pin_memory = 1\n")
    with raises(f"{path} pin_memory: expected bool, got 1"):
        load(Example, env={}, toml_path=path)
    path = write(tmp_path, "listen_ip = 10\n")
    with raises(f"{path} listen_ip: expected str, got 10"):
        load(Example, env={}, toml_path=path)


# --- choices and min, whatever the source -------------------------------------------------------


def sources_of(tmp_path: Path, key: str, toml: str, text: str) -> list[tuple[dict, str]]:
    """(load kwargs, expected label) supplying one bad value through each source."""
    env_name = "MORPHLING_" + key.upper()
    path = write(tmp_path, f"{key} = {toml}\n")
    return [
        ({"args": parse(f"--{key.replace('_', '-')}", text), "env": {}}, f"flag --{key}"),
        ({"env": {env_name: text}}, f"env {env_name}"),
        ({"env": {}, "toml_path": path}, f"{path} {key}"),
    ]


def test_choices_are_enforced_for_every_source(tmp_path):
    for kwargs, label in sources_of(tmp_path, "mode", '"slow"', "slow"):
        with raises(f"{label}: 'slow' is not one of 'fast', 'exact'"):
            load(Example, **kwargs)


def test_min_is_enforced_for_every_source(tmp_path):
    for kwargs, label in sources_of(tmp_path, "window", "0", "0"):
        with pytest.raises(
            ConfigError, match=rf"^{re.escape(label)}: '?0'? is below the minimum 1$"
        ):
            load(Example, **kwargs)
    with raises("env MORPHLING_RATIO: '-0.5' is below the minimum 0.0"):
        load(Example, env={"MORPHLING_RATIO": "-0.5"})
    assert load(Example, env={"MORPHLING_WINDOW": "1"})[0].window == 1  # inclusive


def test_min_and_choices_apply_to_defaults():
    @dataclass(frozen=True)
    class BadMin:
        window: int = field(default=0, metadata={"min": 1})

    @dataclass(frozen=True)
    class BadChoice:
        mode: str = field(default="slow", metadata={"choices": ("fast",)})

    with raises("default BadMin.window: 0 is below the minimum 1"):
        load(BadMin, env={})
    with raises("default BadChoice.mode: 'slow' is not one of 'fast'"):
        load(BadChoice, env={})


def test_overridden_layers_are_still_validated(tmp_path):
    path = write(tmp_path, "window = 'x'\n")
    with raises(f"{path} window: expected int, got 'x'"):
        load(Example, parse("--window", "3"), env={"MORPHLING_WINDOW": "2"}, toml_path=path)
    with raises("env MORPHLING_WINDOW: expected int"):
        load(Example, parse("--window", "3"), env={"MORPHLING_WINDOW": "x"})


# --- files and sections ---------------------------------------------------------------------------


def test_unknown_key_in_section(tmp_path):
    path = write(tmp_path, "[emulator]\nblok_size = 4\n")
    with raises(
        f"unknown key 'blok_size' in {path} [emulator] (known: block_size, window, ratio, "
        "listen_ip, mode, pin_memory); did you mean 'block_size'?"
    ):
        load(Example, env={}, toml_path=path, section="emulator")


def test_unknown_key_without_section(tmp_path):
    path = write(tmp_path, "window = 2\nzzz = 1\n")
    with raises(f"unknown key 'zzz' in {path} (known: "):
        load(Example, env={}, toml_path=path)


def test_section_reads_its_table_and_allows_other_roles_tables(tmp_path):
    path = write(
        tmp_path,
        "[emulator]\nwindow = 12\n\n[device]\nanything = 'goes'\n\n[fleet.nested]\nx = 1\n",
    )
    config, sources = load(Example, env={}, toml_path=path, section="emulator")
    assert (config.window, sources["window"]) == (12, "file")
    config, sources = load(Example, env={}, toml_path=path, section="other")
    assert config == Example() and set(sources.values()) == {"default"}


def test_section_rejects_a_table_no_command_reads(tmp_path):
    path = write(tmp_path, "[emulatr]\nwindow = 3\n")
    with raises(f"{path}: unknown table [emulatr] (known: emulator, device, fleet, run); "
                "did you mean [emulator]?"):  # fmt: skip
        load(Example, env={}, toml_path=path, section="emulator")


def test_section_rejects_top_level_values(tmp_path):
    path = write(tmp_path, "window = 2\n\n[emulator]\nratio = 1.0\n")
    with raises(
        f"{path}: top-level key 'window' = 2 is not a table; settings belong under [emulator]"
    ):
        load(Example, env={}, toml_path=path, section="emulator")


def test_nested_table_inside_section_is_an_unknown_key(tmp_path):
    path = write(tmp_path, "[emulator]\nwindow = 2\n[emulator.extra]\nx = 1\n")
    with raises(f"unknown key 'extra' in {path} [emulator]"):
        load(Example, env={}, toml_path=path, section="emulator")


def test_missing_file_is_an_error(tmp_path):
    path = tmp_path / "nope.toml"
    with raises(f"cannot read config file {path}: No such file or directory"):
        load(Example, parse("--config", str(path)), env={})


def test_directory_is_an_error(tmp_path):
    with raises(f"cannot read config file {tmp_path}: "):
        load(Example, env={}, toml_path=tmp_path)


def test_invalid_toml_is_an_error(tmp_path):
    path = write(tmp_path, "window = = 3\n")
    with raises(f"invalid TOML in config file {path}: "):
        load(Example, env={}, toml_path=path)


def test_non_utf8_file_is_an_error(tmp_path):
    path = tmp_path / "config.toml"
    path.write_bytes(b"listen_ip = '\xff'\n")
    with raises(f"invalid TOML in config file {path}: "):
        load(Example, env={}, toml_path=path)


# --- describe and schema checks -------------------------------------------------------------------


def test_describe(tmp_path):
    path = write(tmp_path, "[emulator]\nratio = 0.75\n")
    args = parse("--listen_ip", "10.0.0.1", "--pin-memory", "--config", str(path))
    config, sources = load(Example, args, env={"MORPHLING_BLOCK_SIZE": "8MiB"}, section="emulator")
    assert describe(config, sources).splitlines() == [
        "block_size = 8388608  (env)",
        "window = 4  (default)",
        "ratio = 0.75  (file)",
        "listen_ip = '10.0.0.1'  (flag)",
        "mode = 'fast'  (default)",
        "pin_memory = True  (flag)",
    ]


# --- secrets ------------------------------------------------------------------------------------

SECRET = "s3cret-Token-7f1c"


@dataclass(frozen=True)
class Connect:
    server: str = option("127.0.0.1:39000", "emulator address")
    token: str = option("", "shared secret", secret=True)


def connect(*argv: str, env: dict[str, str] | None = None, toml: Path | None = None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, Connect)
    return load(Connect, parser.parse_args(argv), env=env or {}, toml_path=toml, section="device")


def secret_file(tmp_path: Path, text: str = SECRET + "\n", name: str = "token") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_secret_comes_from_a_file_in_every_layer(tmp_path):
    path = secret_file(tmp_path)
    toml = write(tmp_path, f"[device]\ntoken_file = {path!r}\n")
    for config, source in [
        (connect("--token-file", path), "flag"),
        (connect(env={"MORPHLING_TOKEN_FILE": path}), "env"),
        (connect(toml=toml), "file"),
    ]:
        assert (config[0].token, config[1]["token"]) == (SECRET, source)
    crlf = secret_file(tmp_path, SECRET + "\r\n", "crlf")
    assert connect("--token-file", crlf)[0].token == SECRET


def test_a_secret_file_obeys_the_precedence_of_its_layer(tmp_path):
    other = secret_file(tmp_path, "from-the-variable\n", "other")
    env = {"MORPHLING_TOKEN_FILE": other}
    toml = write(tmp_path, '[device]\ntoken = "from-the-file"\n')
    assert connect("--token-file", secret_file(tmp_path), env=env)[0].token == SECRET
    assert connect("--token", "from-the-flag", env=env)[0].token == "from-the-flag"
    assert connect(env=env, toml=toml)[0].token == "from-the-variable"


def test_a_secret_and_its_file_in_one_layer_is_an_error(tmp_path):
    path = secret_file(tmp_path)
    with raises("flag --token and flag --token-file: give one, not both"):
        connect("--token", "x", "--token-file", path)
    with raises("env MORPHLING_TOKEN and env MORPHLING_TOKEN_FILE: give one, not both"):
        connect(env={"MORPHLING_TOKEN": "x", "MORPHLING_TOKEN_FILE": path})
    toml = write(tmp_path, f'[device]\ntoken = "x"\ntoken_file = {path!r}\n')
    with raises(f"{toml} [device] token and {toml} [device] token_file: give one, not both"):
        connect(toml=toml)


@pytest.mark.parametrize(
    ("text", "problem"),
    [("", "is empty"), ("\n", "is empty"), ("a\nb\n", "has more than one line")],
)
def test_a_secret_file_must_hold_one_line(tmp_path, text, problem):
    path = secret_file(tmp_path, text)
    with raises(f"flag --token-file: {path} {problem}"):
        connect("--token-file", path)


def test_an_unreadable_secret_file_is_an_error(tmp_path):
    with raises(f"env MORPHLING_TOKEN_FILE: cannot read {tmp_path}/nope: No such file"):
        connect(env={"MORPHLING_TOKEN_FILE": str(tmp_path / "nope")})
    toml = write(tmp_path, "[device]\ntoken_file = 7\n")
    with raises(f"{toml} [device] token_file: expected a file path, got 7"):
        connect(toml=toml)


def test_a_secret_is_masked_in_describe_repr_and_errors(tmp_path):
    config, sources = connect("--token", SECRET)
    assert describe(config, sources).splitlines() == [
        "server = '127.0.0.1:39000'  (default)",
        "token = <secret>  (flag)",
    ]
    assert SECRET not in repr(config)
    assert "token = ''  (default)" in describe(*connect())
    toml = write(tmp_path, "[device]\ntoken = 271828\n")
    with pytest.raises(ConfigError) as info:
        connect(toml=toml)
    assert str(info.value) == f"{toml} [device] token: expected str, got int"


def test_help_offers_the_file_form_of_a_secret():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Connect)
    text = " ".join(parser.format_help().split())
    assert "ps shows it here: prefer --token-file" in text
    assert (
        "--token-file PATH read --token from this file, one line (env: MORPHLING_TOKEN_FILE" in text
    )


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_schema_mistakes_are_type_errors():
    @dataclass(frozen=True)
    class ListField:
        items: list = field(default_factory=list)

    @dataclass(frozen=True)
    class NoDefault:
        window: int

    @dataclass(frozen=True)
    class Reserved:
        config: str = ""

    @dataclass(frozen=True)
    class Typo:
        window: int = field(default=1, metadata={"minimum": 1})

    @dataclass(frozen=True)
    class NumericSecret:
        pin: int = option(0, "a PIN", secret=True)

    @dataclass(frozen=True)
    class TakenFileKey:
        token: str = option("", "a secret", secret=True)
        token_file: str = ""

    for schema, message in [
        (ListField, "is not one of int, float, bool, str"),
        (NoDefault, "every field needs a plain default"),
        (Reserved, "the name 'config' is taken by --config"),
        (Typo, "unknown metadata ['minimum']"),
        (NumericSecret, "NumericSecret.pin: a secret must be a str"),
        (TakenFileKey, "TakenFileKey.token_file: the name is taken by token's file"),
        (dict, "is not a dataclass"),
    ]:
        with pytest.raises(TypeError, match=re.escape(message)):
            load(schema, env={})
        with pytest.raises(TypeError, match=re.escape(message)):
            add_arguments(argparse.ArgumentParser(), schema)
