"""The typed record codec (stagetool.core.codec): JSON values checked against type hints, naming the
key path of the first wrong value; the table of distinct values the facts cache writes."""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Annotated, Literal

import pytest

from stagetool.core import codec
from stagetool.core.codec import Check, CodecError, decode, encode, omitted, pack, unpack


class Colour(enum.Enum):
    red = "red"
    blue = "blue"


@dataclasses.dataclass(frozen=True)
class Inner:
    name: str
    sizes: tuple[int, ...]
    weight: float | None = None


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    items: tuple[Inner, ...]
    by_name: dict[str, int]
    colour: Colour
    kind: Literal["a", "b"]
    count: Annotated[int, Check(lambda n: n >= 0, "not negative")]
    pair: tuple[int, str]
    chosen: bool = omitted(False)
    note: str | None = omitted(None)


@dataclasses.dataclass(frozen=True)
class Packed:
    """What a facts-cache entry holds: no enums (a table holds scalars, tuples, lists, dicts, records)."""

    inner: Inner
    items: tuple[Inner, ...]
    kind: Literal["a", "b"]
    pair: tuple[int, str] | None


def _packed(items=None) -> Packed:
    a = Inner("a", (1, 2), 0.5)
    return Packed(a, items or (a, Inner("b", ())), "a", (1, "one"))


def _outer(**changes) -> Outer:
    a = Inner("a", (1, 2), 0.5)
    return dataclasses.replace(Outer(a, (a, Inner("b", ())), {"x": 1}, Colour.red, "a", 3, (1, "one")), **changes)


def test_encode_writes_fields_in_order_and_leaves_omitted_defaults_out():
    doc = encode(_outer())
    assert list(doc) == ["inner", "items", "by_name", "colour", "kind", "count", "pair"]
    assert doc["inner"] == {"name": "a", "sizes": [1, 2], "weight": 0.5} and doc["colour"] == "red"
    assert encode(_outer(chosen=True, note="n"))["chosen"] is True
    assert decode(Outer, json.loads(json.dumps(encode(_outer(note="n"))))) == _outer(note="n")


@pytest.mark.parametrize("change,message", [
    (lambda d: d["inner"].update(sizes=[1, "x"]), "inner.sizes: must be a list of integers"),
    (lambda d: d["items"][1].update(weight="heavy"), "items[1].weight: must be a number or null, not a string"),
    (lambda d: d["items"][0].pop("name"), "items[0]: missing 'name'"),
    (lambda d: d["by_name"].update(y=True), "by_name.y: must be an integer, not a boolean"),
    (lambda d: d.update(colour="green"), "colour: must be one of 'red', 'blue', not 'green'"),
    (lambda d: d.update(kind="c"), "kind: must be one of 'a', 'b'"),
    (lambda d: d.update(count=-1), "count: must be an integer, not negative"),
    (lambda d: d.update(pair=[1]), "pair: must be a list of 2, not a list"),
    (lambda d: d.update(extra=1), "unknown 'extra'"),
    (lambda d: d["inner"].update(weight=float("nan")), "inner.weight: must be a number or null"),
    (lambda d: d.update(items={}), "items: must be a list, not an object"),
])
def test_decode_names_the_key_path_of_the_first_wrong_value(change, message):
    doc = encode(_outer())
    change(doc)
    with pytest.raises(CodecError) as e:
        decode(Outer, doc)
    assert str(e.value).startswith(message), str(e.value)


def test_decode_can_leave_unknown_keys_aside():
    assert decode(Outer, {**encode(_outer()), "newer": 1}, unknown=True) == _outer()


def test_pack_writes_each_distinct_value_once_and_unpack_reads_it_back_checked():
    a, b = Inner("a", (1, 2), 0.5), Inner("b", ())
    values = {"packed": _packed(items=(a, b) * 50), "lists": [[1], [1]]}
    payload = json.loads(json.dumps(pack(values)))
    assert sum(1 for n in payload["table"] if n[:2] == ["r", "Inner"]) == 2
    got = unpack(payload, {"packed": Packed, "lists": list[list[int]]})
    assert got == values and got["lists"][0] is not got["lists"][1]  # lists are never shared
    assert got["packed"].items[0] is got["packed"].items[2]  # a distinct record is one object
    with pytest.raises(CodecError, match="not a table of the fields asked for"):
        unpack(payload, {"packed": Packed})
    with pytest.raises(CodecError, match=r"lists: must be a list"):
        unpack(payload, {"packed": Packed, "lists": list[list[str]]})
    with pytest.raises(TypeError, match="cannot pack a Colour"):
        pack({"c": Colour.red})


@pytest.mark.parametrize("damage,message", [
    (lambda p: p["records"]["Inner"].reverse(), "Inner: its fields are not this stagetool's"),
    (lambda p: p["table"].__setitem__(0, ["t", len(p["table"]) - 1]), "does not point back"),
    (lambda p: p["table"].__setitem__(0, ["x", 1]), "a node of no known form"),
    (lambda p: p["table"].__setitem__(0, ["v", [1]]), "a node of no known form"),
])
def test_unpack_refuses_a_table_it_did_not_write(damage, message):
    payload = json.loads(json.dumps(pack({"packed": _packed()})))
    damage(payload)
    with pytest.raises(CodecError, match=message):
        unpack(payload, {"packed": Packed})


def test_unpack_checks_each_record_field_against_its_type():
    payload = json.loads(json.dumps(pack({"inner": Inner("a", (1,))})))
    name = next(i for i, n in enumerate(payload["table"]) if n == ["v", "a"])
    payload["table"][name] = ["v", 7]
    with pytest.raises(CodecError, match=r"table\[\d+\]\.name: must be a string"):
        unpack(payload, {"inner": Inner})


def test_map_strings_keeps_what_did_not_change():
    outer = _outer()
    assert codec.map_strings(outer, str) is outer
    up = codec.map_strings(outer, str.upper, skip=frozenset({"kind"}))
    assert up.inner.name == "A" and up.items[1].name == "B" and up.kind == "a" and up.pair == (1, "ONE")
    assert codec.map_strings({"k": "v"}, str.upper) == {"k": "V"}
    assert codec.map_strings({"k": "v"}, str.upper, keys=True) == {"K": "V"}
