"""Typed configuration: dataclasses with help text and validation, loaded from YAML.

Every stage has a dataclass config (fields carry ``help`` metadata and a
``check`` that validates them); presets in ``configs/`` mirror them. Unknown
keys, wrong types and out-of-range values are errors naming the file and the
field. The resolved config is written into every output/run directory.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from qevolve_cli.errors import ConfigError

T = TypeVar("T", bound="ConfigBase")


def field(default: Any = dataclasses.MISSING, *, help: str, choices: tuple | None = None,
          ge: float | None = None, le: float | None = None, gt: float | None = None,
          lt: float | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with help text and simple range/choice validation."""
    md = {"help": help, "choices": choices, "ge": ge, "le": le, "gt": gt, "lt": lt}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=md)
    return dataclasses.field(default=default, metadata=md)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str, source: Any) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errs = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where, source)
            except ConfigError as e:
                errs.append(str(e))
        raise ConfigError(source, where, f"expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(source, where, f"expected a mapping, got {value!r}")
        return tp.from_dict(value, source=source, prefix=f"{where}.")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(source, where, f"expected a list, got {value!r}")
        inner = args[0] if args else Any
        out = [_coerce(v, inner, f"{where}[{i}]", source) for i, v in enumerate(value)]
        return out if origin is list else tuple(out)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(source, where, f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(source, where, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(source, where, f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(source, where, f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(source, where, f"expected a string, got {value!r}")
    return value


@dataclasses.dataclass
class ConfigBase:
    """Base class of all stage configs."""

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any], source: Any = None, prefix: str = "") -> T:
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(source, prefix + unknown[0], f"unknown key (known: {', '.join(sorted(names))})")
        kwargs = {k: _coerce(v, hints[k], prefix + k, source) for k, v in data.items()}
        obj = cls(**kwargs)
        obj.check(source, prefix)
        return obj

    def check(self, source: Any = None, prefix: str = "") -> None:
        """Validate ranges and choices from field metadata, then :meth:`validate`."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            md = f.metadata
            where = prefix + f.name
            if md.get("choices") and v not in md["choices"]:
                raise ConfigError(source, where, f"must be one of {', '.join(map(str, md['choices']))}, got {v!r}")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if md.get("ge") is not None and v < md["ge"]:
                    raise ConfigError(source, where, f"must be >= {md['ge']}, got {v}")
                if md.get("le") is not None and v > md["le"]:
                    raise ConfigError(source, where, f"must be <= {md['le']}, got {v}")
                if md.get("gt") is not None and v <= md["gt"]:
                    raise ConfigError(source, where, f"must be > {md['gt']}, got {v}")
                if md.get("lt") is not None and v >= md["lt"]:
                    raise ConfigError(source, where, f"must be < {md['lt']}, got {v}")
            if isinstance(v, ConfigBase):
                v.check(source, where + ".")
        self.validate(source, prefix)

    def validate(self, source: Any = None, prefix: str = "") -> None:
        """Cross-field checks; override in subclasses."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self: T, **changes: Any) -> T:
        d = self.to_dict()
        d.update({k: v for k, v in changes.items() if v is not None})
        return type(self).from_dict(d, source="override")

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True, default=str).encode()).hexdigest()[:16]

    @classmethod
    def help_table(cls) -> list[tuple[str, str, str]]:
        return [(f.name, repr(getattr(cls, f.name, "")), f.metadata.get("help", "")) for f in dataclasses.fields(cls)]


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    path = Path(path)
    if not path.exists():
        raise ConfigError(path, None, "no such file")
    try:
        # libyaml's parser when PyYAML has it (same safe subset, a few ms less per file)
        data = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except yaml.YAMLError as e:
        raise ConfigError(path, None, f"invalid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(path, None, "expected a mapping at the top level")
    return data


def load_config(cls: type[T], path: str | Path | None = None, section: str | None = None,
                overrides: dict[str, Any] | None = None) -> T:
    """Build ``cls`` from an optional YAML file (optionally one top-level section) plus overrides."""
    data: dict[str, Any] = {}
    source: Any = "defaults"
    if path is not None:
        data = load_yaml(path)
        source = path
        if section is not None:
            sub = data.get(section, {})
            if not isinstance(sub, dict):
                raise ConfigError(path, section, "expected a mapping")
            data = sub
    if overrides:
        data = {**data, **{k: v for k, v in overrides.items() if v is not None}}
    return cls.from_dict(data, source=source)


def load_preset_config(cls: type[T], path: str | Path | None, preset: str | None,
                       overrides: dict[str, Any] | None, default_path: Path) -> T:
    """``cls`` from ``path`` + ``preset`` + overrides, where ``path`` is a flat mapping or a presets file.

    A presets file (like ``configs/policy.yaml``) maps names to partial configs;
    every preset inherits its ``default`` section, which is also used when no
    preset is named. Naming a preset without a file reads ``default_path``.
    """
    if path is None and preset is not None:
        path = default_path
    if path is None:
        return load_config(cls, None, None, overrides)
    data = load_yaml(path)
    is_presets = bool(data) and all(isinstance(v, dict) for v in data.values())
    if not is_presets:
        if preset is not None:
            raise ConfigError(path, preset, "the file has no named presets")
        return load_config(cls, path, None, overrides)
    name = preset or "default"
    if name not in data:
        raise ConfigError(path, name, f"no such preset (known: {', '.join(sorted(data))})")
    merged = {**data.get("default", {}), **data[name]}
    merged = {**merged, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return cls.from_dict(merged, source=path)


def dump_yaml(obj: ConfigBase | dict[str, Any], path: str | Path) -> None:
    import yaml

    from qevolve_cli.atomic import write_text

    d = obj.to_dict() if isinstance(obj, ConfigBase) else obj
    write_text(path, yaml.safe_dump(d, sort_keys=False))


def configs_dir() -> Path:
    """The project's ``configs/`` folder (repository checkout or installed share)."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "configs", here / "configs"):
        if cand.is_dir():
            return cand
    raise ConfigError(None, None, "cannot find the configs/ directory")
