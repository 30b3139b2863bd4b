"""Where a run's settings come from: the TOML presets shipped in the package (``presets/NAME.toml``,
which may start from another with ``base = "NAME"``), a ``--config FILE.toml`` of the same keys, and
the command-line flags, one per field, built from the fields of train/config.py (each field's ``help``
metadata is its flag's help). Flags override the preset; each source is read into the nested form
(``nest_config``), its values checked, so an error names the file or flag and the key.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from importlib import resources
from typing import Any, Optional, get_type_hints

from gpt2lab.model.config import GPTConfig, config_value, field_type
from gpt2lab.system.choices import finite_float
from gpt2lab.system.errors import ConfigError
from gpt2lab.train.config import (
    SECTIONS,
    TOP_FIELDS,
    TrainConfig,
    check_nested_types,
    default_model,
    default_value,
    merge_config,
    nest_config,
)

try:
    import tomllib  # Python >= 3.11
except ModuleNotFoundError:  # Python 3.10: the same parser, packaged as tomli
    import tomli as tomllib


# -- presets ----------------------------------------------------------------------------
def preset_names() -> list[str]:
    folder = resources.files("gpt2lab") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def preset_values(name: str, _seen: tuple = ()) -> dict:
    """The fields a preset sets (its ``base`` chain resolved), nested, not yet a TrainConfig."""
    if name not in preset_names():
        hint = "".join(f"; did you mean {near}?" for near in difflib.get_close_matches(name, preset_names(), n=1))
        raise ConfigError(f"unknown preset {name!r}{hint} (the presets: {', '.join(preset_names())})")
    if name in _seen:
        raise ConfigError(f"preset {name!r}: base presets form a cycle ({' -> '.join(_seen + (name,))})")
    path = resources.files("gpt2lab") / "presets" / f"{name}.toml"
    return _toml_values(path.read_text(), str(path), _seen + (name,))


def config_file_values(path: str) -> dict:
    """``train --config FILE``: a TOML file with the presets' keys (``base = "PRESET"`` starts from a
    packaged preset), nested, its values checked here so that an error names the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file; pass a TOML file with the presets' keys") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--config {path}: cannot be read ({e})") from None
    values = _toml_values(text, path, ())
    check_nested_types(values, path)
    return values


def _toml_values(text: str, where: str, seen: tuple) -> dict:
    """A preset's or config file's fields, nested, on top of its ``base`` preset's: flat keys
    (``max_lr = 3e-4``) and section tables (``[optim]``) alike, merged field by field."""
    try:
        values = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML ({e})") from e
    base = values.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{where}: base must be a preset name (text), got {base!r}")
    own = nest_config(values, where)
    return merge_config(preset_values(base, seen), own, source=where) if base else own


def prompt_written_for(preset: Optional[str] = None, path: Optional[str] = None) -> str:
    """The data directory the sample prompt of a preset (or ``--config`` file) was written for: the
    data of the preset or file that sets ``sample_prompt`` (its own, or the one it inherits), found
    along the ``base`` chain; the built-in default prompt's, the default data."""
    if preset is not None:
        text, where = (resources.files("gpt2lab") / "presets" / f"{preset}.toml").read_text(), preset
        values = preset_values(preset)
    else:
        with open(str(path), encoding="utf-8") as f:
            text, where = f.read(), str(path)
        values = config_file_values(str(path))
    own = tomllib.loads(text)
    base = own.pop("base", None)
    if config_value(nest_config(own, where), "sample_prompt", None) is not None:
        return str(config_value(values, "data", default_value("data")))
    return prompt_written_for(preset=base) if base else str(default_value("data"))


def load_preset(name: str, **overrides: Any) -> TrainConfig:
    """A preset with ``overrides`` over it: flat names (``max_lr=1e-3``) or sections (``optim={...}``)."""
    source = f"preset {name!r} with overrides"
    return TrainConfig.from_dict(merge_config(preset_values(name), overrides, source=source), source=source)


# -- command line -----------------------------------------------------------------------
def parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _converter(tp: Any, optional: bool):
    base = parse_bool if tp is bool else finite_float if tp is float else tp

    def convert(text: str):
        if optional and text.lower() in ("none", "null", ""):
            return None
        return base(text)

    convert.__name__ = getattr(tp, "__name__", "value")  # argparse names the type in its errors
    return convert


def _flag_fields() -> list[tuple[dataclasses.Field, Any, Any]]:
    """(field, type annotation, base default) per flag: GPTConfig's settable fields, then
    TrainConfig's top-level ones, then each section's. A flag's name is its field's flat name."""
    model_hints, model = get_type_hints(GPTConfig), default_model()
    out = [
        (f, model_hints[f.name], getattr(model, f.name))
        for f in dataclasses.fields(GPTConfig)
        if not f.metadata["derived"]
    ]
    hints = get_type_hints(TrainConfig)
    out += [(f, hints[f.name], f.default) for f in dataclasses.fields(TrainConfig) if f.name in TOP_FIELDS]
    for section in SECTIONS.values():
        if section is not GPTConfig:
            hints = get_type_hints(section)
            out += [(f, hints[f.name], f.default) for f in dataclasses.fields(section)]
    return out


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--field-name VALUE`` flag per config field, flat whatever its section; unset flags
    stay out of the overrides."""
    group = parser.add_argument_group("config fields (override the preset)")
    for f, hint, default in _flag_fields():
        tp, optional = field_type(hint)
        kwargs: dict = dict(
            dest=f.name,
            default=argparse.SUPPRESS,
            type=_converter(tp, optional),
            help=f"{f.metadata['help']} (base default {default!r}; the preset may set it)",
        )
        kwargs["metavar"] = {bool: "true|false", int: "N", float: "X"}.get(tp, "TEXT")
        if f.metadata.get("choices"):  # text fields that name their values
            kwargs.update(choices=f.metadata["choices"], type=str.lower, metavar="|".join(f.metadata["choices"]))
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def overrides_from_args(args: argparse.Namespace) -> dict:
    """The flags given, nested (``--max-lr 1e-3`` -> ``{"optim": {"max_lr": 0.001}}``)."""
    names = {f.name for f, _, _ in _flag_fields()}
    return nest_config({k: v for k, v in vars(args).items() if k in names}, "the flags")
