"""Typed configuration: dataclasses with help text and validation, loaded from YAML.

Every stage has a dataclass config (fields carry ``help`` metadata and a
``check`` that validates them); presets in ``configs/`` mirror them. Unknown
keys, wrong types and out-of-range values are errors naming the file and the
field. The resolved config is written into every output/run directory.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, ClassVar, TypeVar

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


@functools.cache
def _fields_of(cls: type) -> tuple[dict[str, Any], frozenset[str]]:
    """A config class's resolved type hints and field names (typing.get_type_hints is slow: once per class)."""
    return typing.get_type_hints(cls), frozenset(f.name for f in dataclasses.fields(cls))


@dataclasses.dataclass
class ConfigBase:
    """Base class of all stage configs."""

    @classmethod
    def from_dict(cls: type[T], data: dict[str, Any], source: Any = None, prefix: str = "") -> T:
        hints, names = _fields_of(cls)
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

    #: (flag, field, ...): while the boolean field ``flag`` is false, these fields (the flag included) are
    #: left out of :meth:`hash`, so runs started before an opt-in option existed still resume
    SELECT_FIELDS: ClassVar[tuple[str, ...]] = ()

    #: fields added after runs were made with the class: left out of :meth:`hash` while they hold their
    #: default, so those runs still resume (a non-default value is a new configuration)
    HASH_OMIT_AT_DEFAULT: ClassVar[tuple[str, ...]] = ()

    #: fields that say how a stage runs, not what it makes (how often it checkpoints): hashed at their
    #: default value, so changing one on resume keeps the finished stages and the checkpoints of an
    #: interrupted one (docs/evolve.md, "Run directory and resume")
    OPERATIONAL: ClassVar[tuple[str, ...]] = ()

    def _defaults(self) -> dict[str, Any]:
        return {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default)
                for f in dataclasses.fields(self)}

    def hash(self) -> str:
        """The configuration's identity (16 hex digits): what a finished stage records and a resume compares."""
        return self._hash(operational=False)

    def legacy_hash(self) -> str | None:
        """The hash this configuration had before :data:`OPERATIONAL` fields left it (they counted at their
        value), when that differs from :meth:`hash`: a stage finished then is still this configuration's."""
        old = self._hash(operational=True)
        return old if old != self.hash() else None

    def hash_extra(self) -> dict[str, Any]:
        """What the configuration's result depends on beyond its fields (e.g. the order a split's tasks come in),
        added to :meth:`hash`; empty by default, so existing hashes stay."""
        return {}

    def _hash(self, operational: bool) -> str:
        d = self.to_dict()
        if self.SELECT_FIELDS and not getattr(self, self.SELECT_FIELDS[0]):
            for k in self.SELECT_FIELDS:
                d.pop(k, None)
        if self.HASH_OMIT_AT_DEFAULT or self.OPERATIONAL:
            defaults = self._defaults()
            for k in self.HASH_OMIT_AT_DEFAULT:
                if d.get(k) == defaults[k]:
                    d.pop(k, None)
            if not operational:
                d.update({k: defaults[k] for k in self.OPERATIONAL})
        d.update(self.hash_extra())
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

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


# ---------------------------------------------------------------- layered resolution
# A config is resolved from layers, later ones winning key by key: the dataclass defaults (the one source of
# every default), then the YAML files (a presets file's `default` section and a named preset, or a flat
# `--config` file), then `--set KEY=VALUE`, then the command's own flags. Every resolved value remembers the
# layer that set it: `qevolve <cmd> --print-config` shows it, and an invalid value is blamed on its layer.


@dataclasses.dataclass
class Layer:
    """One layer of a resolution: a name (shown by --print-config and in errors) and the values it sets.

    ``flags`` names single keys differently (``{"lr": "--lr"}``: a flag, not the layer); ``keep_none``: a
    ``None`` is a value (YAML ``null``, ``--set k=null``) rather than "not given" (an unset flag)."""

    name: str
    values: dict[str, Any]
    flags: dict[str, str] = dataclasses.field(default_factory=dict)
    keep_none: bool = True

    def label(self, key: str) -> str:
        return self.flags.get(key, self.name)


@dataclasses.dataclass
class Resolved(typing.Generic[T]):
    """A resolved config and, for each of its fields, the layer that set it."""

    config: T
    origin: dict[str, str]

    def rows(self) -> list[tuple[str, Any, str]]:
        """(field, value, layer) for every field, in the dataclass's order."""
        return [(f.name, getattr(self.config, f.name), self.origin[f.name]) for f in dataclasses.fields(self.config)]


def default_layer_name(cls: type) -> str:
    return f"default ({cls.__name__})"


def _set_hint(key: str, value: Any, problem: str) -> str:
    """The spelling ``--set`` accepts for a value of the wrong type (``arms=rft`` -> ``'arms=[rft]'``)."""
    if problem.startswith("expected a list"):
        inner = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        return f" (write --set '{key}=[{inner}]')"
    if problem.startswith("expected a mapping"):
        return f" (write --set '{key}={{NAME: VALUE}}')"
    if problem.startswith("expected true/false"):
        return f" (write --set {key}=true or --set {key}=false)"
    if problem.startswith("expected a string"):
        return f" (write --set '{key}=\"{value}\"')"
    return ""


def blame(err: ConfigError, origin: dict[str, str], data: dict[str, Any]) -> ConfigError:
    """``err`` about the resolved mapping, re-addressed to the layer that set the offending field.

    A file keeps its ``FILE: field 'k': ...`` form; a flag names itself (``--lr: must be > 0``); a value from
    ``--set`` also shows the accepted spelling when its type is wrong."""
    key = (err.field or "").split(".")[0].split("[")[0]
    where = origin.get(key)
    if where is None:
        return err
    if where.startswith("--"):
        sub = err.field[len(key):].lstrip(".") if err.field else ""
        hint = _set_hint(key, data.get(key), err.problem) if where.startswith("--set") and not sub else ""
        return ConfigError(where, sub or None, err.problem + hint)
    return ConfigError(where, err.field, err.problem)


def resolve_layers(cls: type[T], layers: list[Layer]) -> Resolved[T]:
    """``cls`` from the dataclass defaults and ``layers`` (later wins, key by key), validated; errors name
    the layer that set the bad value."""
    data: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for layer in layers:
        for k, v in layer.values.items():
            if v is None and not layer.keep_none:
                continue
            data[k] = v
            origin[k] = layer.label(k)
    try:
        cfg = cls.from_dict(data, source="resolved config")
    except ConfigError as e:
        raise blame(e, origin, data) from None
    for f in dataclasses.fields(cls):
        origin.setdefault(f.name, default_layer_name(cls))
    return Resolved(cfg, origin)


def set_layer(sets: dict[str, Any]) -> Layer:
    """``--set KEY=VALUE`` overrides (parsed as YAML; ``null`` is a value)."""
    return Layer("--set", dict(sets), flags={k: f"--set {k}" for k in sets})


def flag_layer(values: dict[str, Any], rename: dict[str, str] | None = None) -> Layer:
    """The command's own flags (``None`` = not given); each names itself (``--max-tasks``, or ``rename``'s)."""
    return Layer("flags", dict(values), keep_none=False,
                 flags={k: (rename or {}).get(k, "--" + k.replace("_", "-")) for k in values})


def file_layers(path: str | Path | None, section: str | None = None) -> list[Layer]:
    """A flat YAML config file (optionally one top-level ``section`` of it) as a layer."""
    if path is None:
        return []
    data = load_yaml(path)
    if section is not None:
        data = data.get(section, {})
        if not isinstance(data, dict):
            raise ConfigError(path, section, "expected a mapping")
        return [Layer(f"{path} ({section})", data)]
    return [Layer(str(path), data)]


def scale_parts(data: dict[str, Any], stage: str, iteration: int) -> list[tuple[str, dict[str, Any]]]:
    """The parts of a presets mapping (``configs/presets/*.yaml``, an evolve config) that set ``stage`` at
    ``iteration``, in order: the stage section, then ``iterations[iteration-1].<stage>`` (not for ``bc``).

    One rule for ``qevolve evolve`` and for ``qevolve policy/critic --preset NAME``: the same preset gives a
    stage the same numbers whichever command runs it."""
    parts = [(stage, data.get(stage) or {})]
    its = data.get("iterations") or []
    if stage != "bc" and 1 <= iteration <= len(its):
        parts.append((f"iterations[{iteration - 1}].{stage}", its[iteration - 1].get(stage) or {}))
    return parts


def presets_dir() -> Path:
    return configs_dir() / "presets"


def _split_iteration(name: str) -> tuple[str, int]:
    """``sciworld_iter2`` -> ``("sciworld", 2)``; ``cpu`` -> ``("cpu", 1)``."""
    head, sep, k = name.rpartition("_iter")
    if sep and head and k.isdigit() and int(k) >= 1:
        return head, int(k)
    return name, 1


def stage_preset_layers(path: str | Path | None, preset: str | None, default_path: Path,
                        stages: tuple[str, ...], implied: dict[str, Any] | None = None) -> list[Layer]:
    """Layers of ``--config PATH --preset NAME`` for a stage command (``qevolve policy``, ``qevolve critic``).

    ``PATH`` is a flat mapping or a file of named presets (like ``configs/policy.yaml``; every preset inherits
    its ``default`` section, also used when no preset is named; naming a preset without a file reads
    ``default_path``). A preset not in ``default_path`` may name a file of ``configs/presets/`` (``cpu``,
    ``smoke``, ``sciworld``, ...), optionally with an iteration (``cpu_iter2``, ``sciworld_iter1``): the
    stage then gets exactly what ``qevolve evolve --preset NAME`` gives it at that iteration
    (:func:`scale_parts`): ``stages`` names the section, e.g. ``("bc",)`` or ``("policy",)``, where the
    stage's objective decides; ``implied``: what evolve gives that stage when the preset does not
    (the policy stage's objective bppo)."""
    if path is None and preset is None:
        return []
    # a file of your own holds its own presets; the project's (default_path) also reaches configs/presets/
    explicit = path is not None and Path(path).resolve() != default_path.resolve()
    path = Path(path) if path is not None else default_path
    data = load_yaml(path)
    is_presets = bool(data) and all(isinstance(v, dict) for v in data.values())
    if not is_presets:
        if preset is not None:
            raise ConfigError(path, preset, "the file has no named presets")
        return [Layer(str(path), data)]
    name = preset or "default"
    layers = [Layer(f"{path} (default)", data.get("default") or {})]
    if name in data:
        return layers + ([Layer(f"{path} (preset {name})", data[name])] if name != "default" else [])
    scale, k = _split_iteration(name)
    scale_file = presets_dir() / f"{scale}.yaml"
    if explicit or not scale_file.is_file():
        known = sorted(data) + ([] if explicit else sorted(p.stem for p in presets_dir().glob("*.yaml")))
        raise ConfigError(path, name, f"no such preset (known: {', '.join(known)}"
                                      + ("" if explicit else "; a preset of configs/presets/ takes _iterK") + ")")
    sdata = load_yaml(scale_file)
    sdata.pop("envs", None)  # per-environment blocks apply under `qevolve evolve --env`
    rel = f"configs/presets/{scale}.yaml"
    out = [Layer(f"preset {name} (the {'/'.join(stages)} stage of qevolve evolve)", implied)] if implied else []
    for stage in stages:
        out += [Layer(f"preset {name} ({rel}: {part})", vals) for part, vals in scale_parts(sdata, stage, k) if vals]
    return layers + out


def load_config(cls: type[T], path: str | Path | None = None, section: str | None = None,
                overrides: dict[str, Any] | None = None) -> T:
    """Build ``cls`` from an optional YAML file (optionally one top-level section) plus overrides."""
    return resolve_layers(cls, file_layers(path, section) + [Layer("overrides", overrides or {}, keep_none=False)]).config


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
