"""The config's building blocks: ``opt`` (a field with its description, range and choices), ``Section`` (a
config section that refuses unknown keys), the seed ranges, and building a section from a mapping with one
line per problem."""

from __future__ import annotations

import difflib
import math
import typing

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..errors import ConfigError

SEED_MAX = 2 ** 32 - 1  # train.seed: (seed, iteration) seeds a generator as seed * 1000003 + iteration, within 64 bits
SAMPLE_SEED_MAX = 2 ** 63 - 1  # a sample seed seeds a generator on its own


def iteration_seed(seed: int, iteration: int) -> int:
    """The seed of iteration ``iteration``'s random draws in a run with ``train.seed=seed`` (within 64 bits for
    seeds up to :data:`SEED_MAX`), so a resumed run draws what the uninterrupted one would have."""
    return seed * 1_000_003 + iteration


def check_seeds(seeds: list[int], key: str) -> None:
    """Each seed a whole number in [0, 2^63 - 1], or one line naming the first that is not."""
    bad = next((s for s in seeds if not 0 <= s <= SAMPLE_SEED_MAX), None)
    if bad is not None:
        raise ConfigError(f"{key}: seed {bad} is outside 0..{SAMPLE_SEED_MAX}; give seeds such as 0, 1, 2, 3")


def opt(default, doc: str = "", *, lo=None, hi=None, lo_open: bool = False, choices=None):
    """A field with a default, a description and optional range / choice checks (``lo_open``: > lo, not >=)."""
    extra = None
    if choices is not None:  # YAML 1.1 reads `no` as false: accelerate's documented word is "no"
        extra = {"enum": list(choices) + ([False] if "no" in choices else [])}
    bounds = {"gt" if lo_open else "ge": lo} if lo is not None else {}
    if hi is not None:
        bounds["le"] = hi
    if isinstance(default, (list, dict)):
        return Field(default_factory=lambda d=default: type(d)(d), description=doc or None, json_schema_extra=extra,
                     **bounds)
    return Field(default=default, description=doc or None, json_schema_extra=extra, **bounds)


class Section(BaseModel):
    """A config section: unknown keys, wrong types (no silent conversion: 2.5 is not an integer, 1 is not true)
    and non-finite numbers are refused; a string written as a number (YAML 1.1 reads ``1e-4`` as text) is one."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_spellings(cls, value, info):
        field = cls.model_fields[info.field_name]
        choices = _choices(field)
        if isinstance(value, bool) and choices and ("yes" if value else "no") in choices:
            return "yes" if value else "no"
        if isinstance(value, str) and _expects_number(field.annotation):
            try:
                number = float(value)
            except ValueError:
                return value
            if not math.isfinite(number):  # nan passes every range check (nan < lo is false)
                raise ValueError(f"{value!r} is not a finite number")
            return number
        return value

    @field_validator("*", mode="after")
    @classmethod
    def _one_of_the_choices(cls, value, info):
        choices = _choices(cls.model_fields[info.field_name])
        if choices is not None and value is not None and value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"{value!r} is not one of {', '.join(map(str, choices))}{hint}")
        return value


def _choices(field) -> list | None:
    """A field's choices (its schema's enum, less the ``false`` that YAML 1.1 makes of ``no``)."""
    if not isinstance(field.json_schema_extra, dict) or "enum" not in field.json_schema_extra:
        return None
    return [c for c in field.json_schema_extra["enum"] if c is not False]


def _expects_number(tp) -> bool:
    return tp is float or (typing.get_origin(tp) is typing.Union and float in typing.get_args(tp))




def _section_type(tp):
    """The Section class a field holds (directly, in a list or optional), else None."""
    for t in (tp, *typing.get_args(tp)):
        if isinstance(t, type) and issubclass(t, Section):
            return t
    return None


def _all_keys(cls, prefix="") -> list[str]:
    keys = []
    for name, f in cls.model_fields.items():
        keys.append(f"{prefix}{name}")
        sub = _section_type(f.annotation)
        if sub is not None and typing.get_origin(f.annotation) is not list:
            keys += _all_keys(sub, f"{prefix}{name}.")
    return keys


def _unknown(key: str, cls, prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(cls, prefix), n=1, cutoff=0.5)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def _type_name(tp) -> str:
    if typing.get_origin(tp) is typing.Union:
        args = typing.get_args(tp)
        names = " or ".join(_type_name(a) for a in args if a is not type(None))
        return names + (" or null" if type(None) in args else "")
    if typing.get_origin(tp) is typing.Annotated:
        return _type_name(typing.get_args(tp)[0])
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if typing.get_origin(tp) is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


_EXPECTED = {"int": "an integer", "bool": "true or false", "float": "a number", "string": "a string",
             "dict": "a mapping"}


def _one_line(exc: ValidationError, cls, prefix: str) -> ConfigError:
    """The first problem pydantic found, as the one line flowrl prints (the key, what was wrong, what to write)."""
    err = exc.errors(include_url=False)[0]
    # ('train', 'lr') or ('rewards', 0, 'name') -> train.lr, rewards[0].name; a union's branch tags dropped
    loc = tuple(p for p in err["loc"] if isinstance(p, int) or not (p.startswith(("constrained-", "literal[")) or
                                                                   p in ("int", "str", "float", "bool")))
    key = prefix
    for part in loc:
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx", {})
    if kind == "extra_forbidden":
        return _unknown(key, cls, f"{prefix}." if prefix else "")
    if kind == "value_error":  # the messages of flowrl's own checks (choices, text that reads as a number)
        return ConfigError(f"{key}: {str(ctx.get('error', err['msg']))}")
    if kind == "finite_number":
        return ConfigError(f"{key}: {value!r} is not a finite number")
    bounds = {"greater_than_equal": (">=", "ge"), "greater_than": (">", "gt"), "less_than_equal": ("<=", "le")}
    if kind in bounds:
        sign, name = bounds[kind]
        return ConfigError(f"{key}: {value!r} is out of range; it must be {sign} {ctx[name]}")
    field = _field_at(cls, loc)
    if kind in ("model_type", "model_attributes_type"):
        section = _section_type(field.annotation) if field is not None else None
        return ConfigError(f"{key}: expected a mapping of {section.__name__ if section else 'section'} fields, got "
                           f"{value!r}")
    if kind == "list_type":
        return ConfigError(f"{key}: expected {_type_name(field.annotation) if field else 'a list'}, got {value!r}")
    base = kind.split("_")[0]
    if field is not None and any(typing.get_origin(a) is typing.Literal for a in typing.get_args(field.annotation)):
        return ConfigError(f"{key}: expected {_type_name(field.annotation)}, got {value!r}")  # a number or a word
    return ConfigError(f"{key}: expected {_EXPECTED.get(base, base)}, got {value!r}")


def _field_at(cls, loc):
    """The field the error location ends in (list indices skipped), or None."""
    field = None
    for part in loc:
        if isinstance(part, int) or cls is None:
            continue
        field = cls.model_fields.get(part)
        cls = _section_type(field.annotation) if field is not None else None
    return field


def _build(cls, data, prefix: str = ""):
    """A section from its mapping, or one ConfigError naming the first problem."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of {cls.__name__} fields, got {data!r}")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _one_line(exc, cls, prefix) from None
