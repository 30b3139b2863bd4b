"""Where a run's settings come from: the TOML presets shipped in the package (``presets/NAME.toml``,
which may start from another with ``base = "NAME"``), a ``--config FILE.toml`` of the same keys, and
the command-line flags, one per field, built from the fields of train/config.py (each field's ``help``
metadata is its flag's help). Flags override the preset; each source is read into the nested form
(``nest_config``), its values checked, so an error names the file or flag and the key.
"""

from __future__ import annotations

import argparse
import difflib
from importlib import resources
from typing import Any, Optional

from gpt2lab.model.config import config_value, field_type
from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import ConfigError
from gpt2lab.train.config import (
    FIELDS,
    HINTS,
    TrainConfig,
    check_nested_types,
    default_value,
    merge_config,
    nest_config,
)

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib


# -- presets and --config files: each a chain of layers, its base presets' first ------------------
def preset_names() -> list[str]:
    folder = resources.files("gpt2lab") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def _preset_layers(name: str, seen: tuple = ()) -> list[dict]:
    if name not in preset_names():
        hint = "".join(f"; did you mean {near}?" for near in difflib.get_close_matches(name, preset_names(), n=1))
        raise ConfigError(f"unknown preset {name!r}{hint} (the presets: {', '.join(preset_names())})")
    if name in seen:
        raise ConfigError(f"preset {name!r}: base presets form a cycle ({' -> '.join(seen + (name,))})")
    path = resources.files("gpt2lab") / "presets" / f"{name}.toml"
    return _layers(path.read_text(), str(path), seen + (name,))


def _file_layers(path: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; pass a TOML file with the presets' keys") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot be read ({e})") from None
    return _layers(text, path)


def _layers(text: str, where: str, seen: tuple = ()) -> list[dict]:
    """A preset's or config file's own fields, nested (flat keys, ``max_lr = 3e-4``, and section tables,
    ``[optim]``, alike), after those of its ``base`` preset's chain."""
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML ({e})") from e
    base = values.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{where}: base must be a preset name (text), got {base!r}")
    return (_preset_layers(base, seen) if base else []) + [nest_config(values, where)]


def preset_values(name: str) -> dict:
    """The fields a preset sets (its ``base`` chain resolved), nested, not yet a TrainConfig."""
    return merge_config(*_preset_layers(name))


def config_file_values(path: str) -> dict:
    """``train --config FILE``: a TOML file with the presets' keys (``base = "PRESET"`` starts from a
    packaged preset), nested, its values checked here so that an error names the file and the key."""
    values = merge_config(*_file_layers(path), source=path)
    check_nested_types(values, path)
    return values


def prompt_written_for(preset: Optional[str] = None, path: Optional[str] = None) -> str:
    """The data directory the sample prompt of a preset (or ``--config`` file) was written for: the
    data of the preset or file that sets ``sample_prompt`` (its own, or the one it inherits), found
    along the ``base`` chain; the built-in default prompt's, the default data."""
    layers = _preset_layers(preset) if preset is not None else _file_layers(str(path))
    for n in range(len(layers), 0, -1):
        if config_value(layers[n - 1], "sample_prompt") is not None:
            return str(config_value(merge_config(*layers[:n]), "data", default_value("data")))
    return str(default_value("data"))


def load_preset(name: str, **overrides: Any) -> TrainConfig:
    """A preset with ``overrides`` over it: flat names (``max_lr=1e-3``) or sections (``optim={...}``)."""
    source = f"preset {name!r} with overrides"
    return TrainConfig.from_dict(merge_config(preset_values(name), overrides, source=source), source=source)


# -- command line: a flag per field, but the architecture's derived ones -----------------------------
FLAGS = {name: f for name, f in FIELDS.items() if not f.metadata.get("derived")}


BOOLS = dict.fromkeys(("true", "1", "yes", "on"), True) | dict.fromkeys(("false", "0", "no", "off"), False)


def parse_bool(text: str) -> bool:
    if text.lower() not in BOOLS:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return BOOLS[text.lower()]


def _converter(tp: Any, optional: bool):
    base = parse_bool if tp is bool else finite_float if tp is float else tp

    def convert(text: str):
        return None if optional and text.lower() in ("none", "null", "") else base(text)

    convert.__name__ = getattr(tp, "__name__", "value")  # argparse names the type in its errors
    return convert


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name VALUE`` flag per config field, flat whatever its section; unset flags
    stay out of the overrides."""
    group = parser.add_argument_group("config fields (override the preset)")
    for name, f in FLAGS.items():
        tp, optional = field_type(HINTS[name])
        choices = f.metadata.get("choices")  # text fields that name their values
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=argparse.SUPPRESS,
            type=str.lower if choices else _converter(tp, optional),
            choices=choices or None,
            metavar="|".join(choices) if choices else {bool: "true|false", int: "N", float: "X"}.get(tp, "TEXT"),
            help=f"{f.metadata['help']} (base default {default_value(name)!r}; the preset may set it)",
        )


def overrides_from_args(args: argparse.Namespace) -> dict:
    """The flags given, nested (``--max-lr 1e-3`` -> ``{"optim": {"max_lr": 0.001}}``)."""
    return nest_config({k: v for k, v in vars(args).items() if k in FLAGS}, "the flags")
