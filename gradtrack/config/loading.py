"""Where gradtrack's configuration comes from, and which source wins.

Precedence, lowest first: defaults < file named by ``GRADTRACK_CONFIG`` < ``GRADTRACK_*``
environment variables < ``config=`` (object, dict or file) < keyword overrides.

pydantic-settings reads the sources: its ``EnvSettingsSource`` the variables, its TOML, YAML
and JSON sources the files, each over `_Fields` (GradtrackConfig's fields as a
``BaseSettings``, never instantiated). Each source is read on its own and they are merged
here, so that the one validation, by `GradtrackConfig`, can say which source an invalid value
came from.
"""

from __future__ import annotations

import difflib
import os
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError, create_model
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    JsonConfigSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
    YamlConfigSettingsSource,
)
from pydantic_settings.sources import InitSettingsSource

from gradtrack.config.models import SWITCHED, GradtrackConfig, expand_switch, expanded
from gradtrack.errors import GradtrackConfigError

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

ENV_PREFIX = "GRADTRACK_"
ENV_CONFIG_FILE = "GRADTRACK_CONFIG"
ENV_DISABLED = "GRADTRACK_DISABLED"  # the off switch: sets enabled=False
ENV_SPOOL_DIR = "GRADTRACK_SPOOL_DIR"  # spool.dir (also read where no config is: gradtrack sync)
ENV_SOURCE = "environment variable"
ConfigSource = GradtrackConfig | Mapping[str, Any] | str | os.PathLike | None

_NESTED = "__"  # GRADTRACK_HISTOGRAMS__BINS is histograms.bins
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_NONE = ("", "none", "null")


class _Settings(BaseSettings):
    # Only the sources' settings_cls: never validated, so its schema is never built. A file's
    # keys are field names as written (the variables' case is the environment source's own);
    # a field may start with model_ (model_name), as in GradtrackConfig.
    model_config = SettingsConfigDict(
        defer_build=True, case_sensitive=True, protected_namespaces=("settings_",)
    )


# What the sources read: every field of GradtrackConfig, and three variables of their own.
_READ_FIELDS: dict[str, Any] = {
    "config": (str | None, None),  # GRADTRACK_CONFIG: the file read first
    "disabled": (str | None, None),  # GRADTRACK_DISABLED: the off switch
    "spool_dir": (str | None, None),  # GRADTRACK_SPOOL_DIR: spool.dir
    **{name: (field.annotation, None) for name, field in GradtrackConfig.model_fields.items()},
}
_Fields = create_model("GradtrackSources", __base__=_Settings, **_READ_FIELDS)


class _Environment(EnvSettingsSource):
    """pydantic-settings' environment source over a given mapping (``os.environ`` or a test's),
    reading two spellings JSON has not: a section's on/off switch (``GRADTRACK_SPOOL=0``) and
    a comma-separated list (``GRADTRACK_EXCLUDE=head.*,*.bias``; JSON lists still work)."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self._environ = environ
        super().__init__(
            _Fields, case_sensitive=False, env_prefix=ENV_PREFIX, env_nested_delimiter=_NESTED
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return {name.lower(): value for name, value in self._environ.items()}

    def decode_complex_value(self, field_name: str, field: FieldInfo | None, value: Any) -> Any:
        top = field is not None and field is _Fields.model_fields.get(field_name)
        variable = ENV_PREFIX + ("" if top else "*__") + field_name.upper()
        if top and field_name in SWITCHED:
            return expand_switch(field_name, _switch(variable, value))
        listed = field is not None and typing.get_origin(field.annotation) is tuple
        if listed and not value.lstrip().startswith("["):
            if value.strip().lower() in _NONE:
                return value  # None, by _none_words
            return [name.strip() for name in value.split(",") if name.strip()]
        try:
            return super().decode_complex_value(field_name, field, value)  # type: ignore[arg-type]
        except ValueError as exc:
            raise GradtrackConfigError(f"{variable}={value!r} is not JSON: {exc}") from None

    def unread(self) -> dict[str, str]:
        """The ``GRADTRACK_*`` variables no field reads (pydantic-settings passes over them),
        each as a field of that name: validation refuses it by name, so a typo is not ignored."""
        unread = {}
        for name, raw in self._environ.items():
            key = name[len(ENV_PREFIX) :].lower()
            head, nested, _ = key.partition(_NESTED)
            field = _Fields.model_fields.get(head)
            if name.upper().startswith(ENV_PREFIX) and (
                field is None or (nested and not self.field_is_complex(field))
            ):
                unread[key] = raw
        return unread


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Config fields from ``GRADTRACK_<FIELD>`` variables (``GRADTRACK_CONFIG`` names a file).

    A double underscore reaches into a nested field: ``GRADTRACK_HISTOGRAMS__BINS``.
    ``GRADTRACK_SPOOL_DIR`` is the spool's folder (``spool.dir``), as it always was.

    ``GRADTRACK_SPOOL=0``, ``GRADTRACK_HISTOGRAMS=0``, ``GRADTRACK_NOISE_SCALE=0`` and
    ``GRADTRACK_FLIGHT=0`` switch those off.

    >>> read_env({"GRADTRACK_HISTOGRAMS__BINS": "8", "GRADTRACK_SPOOL": "off"})
    {'histograms': {'bins': '8'}, 'spool': {'enabled': False}}
    """
    return _environment(environ)[1]


def _environment(environ: Mapping[str, str]) -> tuple[str | None, dict[str, Any]]:
    """The file ``GRADTRACK_CONFIG`` names, and the fields the other variables give."""
    source = _Environment(environ)
    try:
        values = source()
    except ValueError as exc:  # pydantic-settings' SettingsError, around what a value raised
        cause = exc.__cause__
        error = cause if isinstance(cause, GradtrackConfigError) else GradtrackConfigError(exc)
        raise error from None
    # The two variables named apart from their field, and the none words:
    if "disabled" in values:
        values["enabled"] = not _switch(ENV_DISABLED, values.pop("disabled"))
    if "spool_dir" in values:
        values["spool"] = {**values.get("spool", {}), "dir": values.pop("spool_dir")}
    values = _none_words(values)
    return values.pop("config", None), {**values, **source.unread()}


def _none_words(values: dict[str, Any]) -> dict[str, Any]:
    """A variable set to ``none``, ``null`` (any case) or nothing is None: pydantic-settings'
    ``env_parse_none_str`` takes one word, as written."""
    for key, value in values.items():
        if isinstance(value, dict):
            _none_words(value)
        elif isinstance(value, str) and value.strip().lower() in _NONE:
            values[key] = None
    return values


def _switch(name: str, raw: str) -> bool:
    """An on/off environment variable's value.

    >>> _switch("GRADTRACK_DISABLED", " Yes "), _switch("GRADTRACK_DISABLED", "0")
    (True, False)
    """
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise GradtrackConfigError(
            f"{name}={raw!r} is not a switch: use one of {', '.join(_TRUE + _FALSE[:-1])}"
        )
    return value in _TRUE


class _YamlFile(YamlConfigSettingsSource):
    """pydantic-settings' YAML source, for a file that must hold a mapping of fields."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        # An empty file holds no fields (pydantic-settings 2.3 reads it as None).
        return _mapping(file_path, super()._read_file(file_path) or {})


class _JsonFile(JsonConfigSettingsSource):
    """pydantic-settings' JSON source, for a file that must hold a mapping of fields."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        return _mapping(file_path, super()._read_file(file_path))


def _mapping(path: Path | Traversable, data: Any) -> dict[str, Any]:
    """A file's data, which must be a mapping of fields (a TOML file's always is)."""
    if not isinstance(data, dict):
        raise GradtrackConfigError(
            f"gradtrack config file {path} must hold a mapping of fields, not {type(data).__name__}"
        )
    return data


_FILE_SOURCES: dict[str, Callable[[Path], InitSettingsSource]] = {
    ".toml": lambda path: TomlConfigSettingsSource(_Fields, toml_file=path),
    ".yaml": lambda path: _YamlFile(_Fields, yaml_file=path),
    ".yml": lambda path: _YamlFile(_Fields, yaml_file=path),
    ".json": lambda path: _JsonFile(_Fields, json_file=path),
}


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """Read a YAML, TOML or JSON file holding config fields at its top level."""
    path = Path(path).expanduser()
    if not path.is_file():  # pydantic-settings passes over a missing file
        why = "not a file" if path.exists() else "no such file"
        raise GradtrackConfigError(f"cannot read gradtrack config file {path}: {why}")
    source = _FILE_SOURCES.get(path.suffix.lower())
    if source is None:
        raise GradtrackConfigError(
            f"gradtrack config file {path} must end in .toml, .yaml, .yml or .json"
        )
    try:
        return source(path)()
    except GradtrackConfigError:
        raise
    except OSError as exc:
        raise GradtrackConfigError(f"cannot read gradtrack config file {path}: {exc}") from exc
    except ImportError as exc:  # only YAML needs a package of its own
        raise GradtrackConfigError(
            f"{path} is YAML but PyYAML is not installed: pip install pyyaml"
        ) from exc
    except Exception as exc:  # each parser has its own error type
        raise GradtrackConfigError(f"cannot parse gradtrack config file {path}: {exc}") from exc


def load_config(
    config: ConfigSource = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> GradtrackConfig:
    """Merge every source of configuration, in the documented precedence, and validate once.

    >>> config = load_config({"log_every": 2}, {"histograms": {"every": None}}, environ={})
    >>> config.histograms.every is None
    True
    """
    file, env_fields = _environment(os.environ if environ is None else environ)
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if file:
        layers.append((f"file {file} (from {ENV_CONFIG_FILE})", read_config_file(file)))
    layers.append((ENV_SOURCE, env_fields))
    if isinstance(config, GradtrackConfig):
        layers.append(("config object", _explicit_fields(config)))
    elif isinstance(config, (str, os.PathLike)):
        layers.append((f"file {config}", read_config_file(config)))
    elif isinstance(config, Mapping):
        layers.append(("config dict", config))
    elif config is not None:
        raise GradtrackConfigError(
            "config must be a GradtrackConfig, a dict, or a path to a .toml/.yaml/.json file, "
            f"not {type(config).__name__}"
        )
    layers.append(("keyword argument", overrides or {}))

    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, given in layers:
        values = expanded(given)
        from_env = source == ENV_SOURCE
        merged = _merge(merged, values)
        for key, value in values.items():
            env_name = ENV_PREFIX + key.upper() + ("__*" if isinstance(value, Mapping) else "")
            origin[key] = env_name if from_env else source
    try:
        return GradtrackConfig(**merged)
    except ValidationError as exc:
        raise GradtrackConfigError(_describe(exc, origin)) from None


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def _explicit_fields(model: BaseModel) -> dict[str, Any]:
    """The fields set explicitly, nested models included (so they merge field by field)."""
    fields: dict[str, Any] = {}
    for name in model.model_fields_set:
        value = getattr(model, name)
        fields[name] = _explicit_fields(value) if isinstance(value, BaseModel) else value
    return fields


def _describe(error: ValidationError, origin: Mapping[str, str]) -> str:
    lines = ["invalid gradtrack config:"]
    for item in error.errors():
        loc = [str(part) for part in item["loc"]]
        field = ".".join(loc)
        prefixes = (".".join(loc[:n]) for n in range(len(loc), 0, -1))
        where = next((origin[p] for p in prefixes if p in origin), "?")
        if item["type"] == "extra_forbidden":
            section, known = _section_fields(item["loc"][:-1])
            close = difflib.get_close_matches(loc[-1], list(known), n=1)
            suggested = ".".join([*section, close[0]]) if close else ""
            hint = f"; did you mean {suggested!r}?" if close else ""
            of = f" of {'.'.join(section)}" if section else ""
            lines.append(
                f"  unknown field {field!r} (from {where}){hint} "
                f"Known fields{of}: {', '.join(known)}"
            )
        else:
            lines.append(f"  {field} = {item['input']!r} (from {where}): {item['msg']}")
    return "\n".join(lines)


def _section_fields(loc: tuple[int | str, ...]) -> tuple[list[str], tuple[str, ...]]:
    """The section a misspelt field sits in, and that section's own fields: a typo in
    ``alerts.exploding`` is answered with the exploding rule's fields, not the top level's.

    >>> section, known = _section_fields(("alerts", "exploding"))
    >>> section, "threshold" in known, "log_every" in known
    (['alerts', 'exploding'], True, False)
    """
    model: type[BaseModel] = GradtrackConfig
    section: list[str] = []
    for part in loc:
        field = model.model_fields.get(str(part))
        nested = _model_in(field.annotation) if field is not None else None
        if nested is None:
            break
        model = nested
        section.append(str(part))
    return section, tuple(model.model_fields)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (``X`` or ``X | None``), if any."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None
