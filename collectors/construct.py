"""Records built fast for calls that always set the same fields (:func:`constructor`).

Building is all this does: the records are checked at the store's boundary
(:func:`audit.records.validate_record`), as every record is, however it was built.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_IMMUTABLE = (type(None), bool, int, float, str, bytes)
_set = object.__setattr__


class Construct(Generic[M]):
    """``cls.model_construct(**values)`` for calls that always give the same field names, at a
    fraction of its cost: a step with every region fingerprinted builds about a thousand records,
    and ``model_construct`` resolves every field's default for each. Here the defaults are resolved
    once and each record is the template's dict updated with the values.

    The first record is also built by ``model_construct`` and compared (dict, fields set, extras):
    if they differ (another pydantic, a model with a post-init or a mutable default), every record
    is built by ``model_construct`` instead."""

    def __init__(self, cls: type[M], names: frozenset[str]) -> None:
        self.cls = cls
        self.names = names
        self._template: dict[str, Any] | None = {}
        self._checked = False
        if (
            cls.__pydantic_post_init__
            or cls.__pydantic_root_model__
            or cls.model_config.get("extra") == "allow"
        ):
            self._template = None
            return
        for name, info in cls.__pydantic_fields__.items():
            if info.alias is not None or info.validation_alias is not None:
                self._template = None
                return
            if name in names:
                self._template[name] = None  # its place in field order; every call sets it
            elif info.default_factory is None and not info.is_required() and type(info.default) in _IMMUTABLE:
                self._template[name] = info.default
            else:  # a fresh default per record, or a missing required field: model_construct's way
                self._template = None
                return
        if set(names) - set(self._template):
            self._template = None  # names that are not fields: model_construct drops them

    def __call__(self, values: dict[str, Any]) -> M:
        template = self._template
        if template is None or values.keys() != self.names:
            return self.cls.model_construct(**values)
        fields = template.copy()
        fields.update(values)
        return self.complete(fields)

    def prefilled(self, values: dict[str, Any]) -> dict[str, Any] | None:
        """Every field in order, the defaults filled in and ``values`` set: the start of records
        that share those values, each a copy with the other names set, then built by
        :meth:`complete`. ``None``: this model has no fast path (call this instead)."""
        if self._template is None:
            return None
        return {**self._template, **values}

    def complete(self, fields: dict[str, Any]) -> M:
        """The record of ``fields``, a copy of :meth:`prefilled`'s dict with every name of this
        constructor set (the caller's promise: nothing checks it but the first record)."""
        if self._template is None:
            return self.cls.model_construct(**{name: fields[name] for name in self.names})
        record = self.cls.__new__(self.cls)
        _set(record, "__dict__", fields)
        _set(record, "__pydantic_fields_set__", set(self.names))
        _set(record, "__pydantic_extra__", None)
        _set(record, "__pydantic_private__", None)
        if not self._checked:
            self._checked = True
            slow = self.cls.model_construct(**{name: fields[name] for name in self.names})
            if not _same_construction(record, slow):
                self._template = None
                return slow
        return record

    def complete_all(self, many: list[dict[str, Any]]) -> list[M]:
        """:meth:`complete` of each of ``many``, in order."""
        if not many:
            return []
        first = self.complete(many[0])
        if self._template is None:
            return [first, *(self.complete(fields) for fields in many[1:])]
        cls, names, new = self.cls, self.names, self.cls.__new__
        out = [first]
        append = out.append
        for fields in many[1:]:
            record = new(cls)
            _set(record, "__dict__", fields)
            _set(record, "__pydantic_fields_set__", set(names))
            _set(record, "__pydantic_extra__", None)
            _set(record, "__pydantic_private__", None)
            append(record)
        return out


def _same_construction(a: BaseModel, b: BaseModel) -> bool:
    da, db = a.__dict__, b.__dict__
    try:  # values given are the same objects; defaults are immutable scalars
        if list(da) != list(db) or any(da[k] is not db[k] and bool(da[k] != db[k]) for k in da):
            return False
        return bool(
            a.__pydantic_fields_set__ == b.__pydantic_fields_set__
            and a.__pydantic_extra__ == b.__pydantic_extra__
            and a.__pydantic_private__ == b.__pydantic_private__
        )
    except Exception:  # noqa: BLE001 - anything not comparable: not the same, model_construct it is
        return False


@lru_cache(maxsize=32)
def constructor(cls: type[M], names: frozenset[str]) -> Construct[M]:
    """The shared :class:`Construct` of ``cls`` for these field names."""
    return Construct(cls, names)
