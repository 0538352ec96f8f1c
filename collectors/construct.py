"""Records built fast for calls that always set the same fields (:func:`constructor`).

Building is all this does: the records are checked at the store's boundary
(:func:`audit.records.validate_record`), as every record is, however it was built.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from itertools import repeat
from typing import Any, Generic, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

_IMMUTABLE = (type(None), bool, int, float, str, bytes)
_set = object.__setattr__


def _consume(iterator: Iterator[Any]) -> None:
    """Run ``iterator`` to its end, keeping nothing."""
    deque(iterator, maxlen=0)


def _slot_setter(cls: type, name: str) -> Any:
    """The setter of ``cls``'s instance slot ``name`` (pydantic's ``__dict__`` and
    ``__pydantic_*__`` slots), called directly: a thousand records a step, four slots each, and
    ``object.__setattr__`` looks the descriptor up on every call. ``object.__setattr__`` bound to
    the name where the class holds no such descriptor."""
    for klass in cls.__mro__:
        found = vars(klass).get(name)
        if found is not None:
            setter = getattr(found, "__set__", None)
            if setter is not None:
                return setter
            break
    return lambda record, value: _set(record, name, value)


class Construct(Generic[M]):
    """``cls.model_construct(**values)`` for calls that always give the same field names, at a
    fraction of its cost: a step with every region fingerprinted builds about a thousand records,
    and ``model_construct`` resolves every field's default for each (a ``default_factory`` through
    ``inspect.signature``, each time). Here the defaults are resolved once and each record is the
    template's dict updated with the values, a factory's default made fresh for each record.

    The first record is also built by ``model_construct`` and compared (dict, fields set, extras):
    if they differ (another pydantic, a model with a post-init or a mutable default), every record
    is built by ``model_construct`` instead."""

    def __init__(self, cls: type[M], names: frozenset[str]) -> None:
        self.cls = cls
        self.names = names
        self._template: dict[str, Any] | None = {}
        self._checked = False
        self._fields_set = set(names)  # copied into each record
        #: fields whose default is a fresh object per record (``default_factory`` without arguments)
        self._factories: list[tuple[str, Any]] = []
        self._setters = tuple(
            _slot_setter(cls, slot)
            for slot in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
        )
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
            elif info.default_factory is not None and not getattr(
                info, "default_factory_takes_validated_data", True
            ):
                self._template[name] = None  # its place in field order; a fresh value per record
                self._factories.append((name, info.default_factory))
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
        for name, factory in self._factories:
            fields[name] = factory()
        record = self._new(fields)
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
        # each step of the records at once, for all of them (the loops run in C, not bytecode)
        rest = many[1:]
        n = len(rest)
        for name, factory in self._factories:
            for fields in rest:
                fields[name] = factory()
        out = list(map(self.cls.__new__, repeat(self.cls, n)))
        set_dict, set_fields, set_extra, set_private = self._setters
        _consume(map(set_dict, out, rest))
        _consume(map(set_fields, out, map(set.copy, repeat(self._fields_set, n))))
        _consume(map(set_extra, out, repeat(None, n)))
        _consume(map(set_private, out, repeat(None, n)))
        return [first, *out]

    def _new(self, fields: dict[str, Any]) -> M:
        """A record whose ``__dict__`` is ``fields``, every name of this constructor set."""
        record = self.cls.__new__(self.cls)
        set_dict, set_fields, set_extra, set_private = self._setters
        set_dict(record, fields)
        set_fields(record, self._fields_set.copy())
        set_extra(record, None)
        set_private(record, None)
        return record


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
