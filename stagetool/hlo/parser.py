"""A small, total parser for compiled HLO module text.

The input is what ``jax.jit(f).lower(...).compile().as_text()`` returns: the optimized,
partitioned (per-device) HLO module as text. jaxlib also ships an object model
(``compiled.runtime_executable().hlo_modules()``), but its accessors expose names, opcodes and the
operand graph only: no shapes, no attributes, no metadata (its serialized proto holds them, but
jaxlib ships no public class to decode it). The text carries all of these, so it is the
source of truth here, and this module reads nothing else
(tests/hlo/test_hlo_object_model.py holds its names, opcodes and operands against that
object model).

What the parser gives (all plain frozen records):

* :class:`HloModule`: module name, header attributes (raw strings, e.g. ``num_partitions``,
  ``entry_computation_layout``, ``input_output_alias``), every computation in text order, and the
  source tables (``FileNames``, ``FunctionNames``, ``FileLocations``, ``StackFrames``).
* :class:`HloComputation`: name, whether it is the entry, its raw signature, its instructions.
* :class:`HloInstruction`: name, opcode, result shape (:class:`ArrayShape` or :class:`TupleShape`,
  ``None`` when the text is not a shape this parser knows), operand names, raw attributes
  (``name -> raw text``), called computations and :class:`OpMetadata`.

The parser is syntactic: it reads structure (lines, names, shapes, brackets, ``k=v`` pairs)
and keeps attribute values as printed. What a value means is left to the analyses that use it:
device groups and mesh axes of ``replica_groups`` / ``source_target_pairs`` are read by
:mod:`stagetool.hlo.collectives`. The one exception is the mesh form of replica groups,
whose value holds a top-level comma (``mesh[...], device_ids=(...) {...}``): the parser folds it
back into one value, which is syntax too.

The parser is total: a line it does not understand is kept verbatim in
:attr:`HloModule.unparsed_lines` and never raises. It reads the text once, line by line, and
every step is linear in the length of the line, so the whole parse is linear in the text size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import re
from collections.abc import Iterator, Mapping

from stagetool.core.dtypes import BY_HLO

__all__ = [
    "CALL_ATTRIBUTES",
    "AliasEntry",
    "ArrayShape",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "OpMetadata",
    "Shape",
    "SourceFrame",
    "TupleShape",
    "array_leaves",
    "backend_config_json",
    "dtype_bits",
    "parse_input_output_alias",
    "parse_hlo_module",
    "parse_int_list",
    "parse_shape",
    "paused_gc",
    "shape_bytes",
]

# --------------------------------------------------------------------------------------------
# Shapes




def dtype_bits(dtype: str) -> int | None:
    """Storage bits of one element of an HLO primitive type, from the one dtype table
    (:mod:`stagetool.core.dtypes`): ``pred`` 8 (a byte), ``f32`` 32, ``s4`` 4, ...; ``token`` and
    ``opaque`` 0 bits. Returns None for a type the table does not know."""
    if dtype in ("token", "opaque", "opaque-type"):
        return 0
    known = BY_HLO.get(dtype)
    return known.bits if known is not None else None


_ELEMENT_BITS_RE = re.compile(r"E\((\d+)\)")


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayShape:
    """One dense array shape as HLO prints it, e.g. ``bf16[1024,4096]{1,0:T(8,128)(2,1)}``.

    Attributes:
      dtype: the HLO primitive type name (``f32``, ``bf16``, ``s32``, ``pred``, ``token``...).
      dims: the dimension sizes; a bounded dynamic dimension ``<=N`` is given as its bound N.
      layout: the text inside the layout braces (``"1,0:T(8,128)(2,1)"``), or None when printed
        without a layout. Tiling and memory-space annotations are kept verbatim.
      dynamic: True when any dimension is bounded-dynamic (``<=N``) or unknown (``?``).
    """

    dtype: str
    dims: tuple[int, ...]
    layout: str | None = None
    dynamic: bool = False

    @property
    def element_count(self) -> int:
        """Number of elements (1 for a scalar)."""
        n = 1
        for d in self.dims:
            n *= d
        return n

    @property
    def byte_size(self) -> int | None:
        """Bytes of the array: elements × element size, None for an unknown dtype.

        The element size is the dtype's width rounded up to whole bytes (``pred`` is 1 byte,
        ``token``/``opaque`` 0), except that a layout with an element-size annotation ``E(n)``
        (packed sub-byte types on TPU) packs n bits per element, rounded up to whole bytes for
        the array. Padding from tiled layouts is not counted: this is the logical size.
        """
        bits = dtype_bits(self.dtype)
        if bits is None:
            return None
        if self.layout and bits and bits < 8:
            m = _ELEMENT_BITS_RE.search(self.layout)
            if m:
                return (self.element_count * int(m.group(1)) + 7) // 8
        return self.element_count * ((bits + 7) // 8)

    def type_text(self) -> str:
        """The shape as ``dtype[d0,d1]`` without the layout (e.g. ``f32[32,16]``)."""
        return f"{self.dtype}[{','.join(map(str, self.dims))}]"


@dataclasses.dataclass(frozen=True, slots=True)
class TupleShape:
    """A tuple shape ``(s0, s1, ...)``; elements may be tuples again."""

    elements: tuple[Shape, ...]

    def arrays(self) -> Iterator[ArrayShape]:
        """The array leaves, depth first, in order."""
        for e in self.elements:
            if isinstance(e, TupleShape):
                yield from e.arrays()
            else:
                yield e


Shape = ArrayShape | TupleShape


def array_leaves(shape: Shape | None) -> tuple[ArrayShape, ...]:
    """The arrays of a shape in order: itself for an array, the leaves of a tuple, () for None."""
    if shape is None:
        return ()
    if isinstance(shape, ArrayShape):
        return (shape,)
    return tuple(shape.arrays())


def shape_bytes(shape: Shape | None) -> int | None:
    """Bytes of a shape: an array's :attr:`ArrayShape.byte_size`, a tuple's sum over its leaves.

    Returns None when the shape is None or any leaf has an unknown dtype.
    """
    if shape is None:
        return None
    if isinstance(shape, ArrayShape):
        return shape.byte_size
    total = 0
    for a in shape.arrays():
        b = a.byte_size
        if b is None:
            return None
        total += b
    return total


_ARRAY_SHAPE_RE = re.compile(r"([a-z][a-z0-9\-]*)\[([^\]]*)\](?:\{([^}]*)\})?")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


@functools.lru_cache(maxsize=1 << 14)
def parse_shape(text: str) -> Shape | None:
    """Parse one HLO shape: ``f32[2,3]{1,0}``, ``bf16[8]{0:T(128)}``, ``pred[]``, ``token[]``,
    ``(f32[2], (s32[], u32[]))`` (``/*index=N*/`` comments allowed). Returns None when the text
    is not a shape (never raises). Results are cached (shapes are immutable)."""
    text = text.strip()
    if "/*" in text:
        text = _COMMENT_RE.sub("", text).strip()
    if not text:
        return None
    if text[0] == "(":
        end = _match_close(text, 0)
        if end != len(text) - 1:
            return None
        inner = text[1:-1].strip()
        if not inner:
            return TupleShape(())
        elements = []
        for part in _split_top_level(inner, 0, len(inner)):
            s = parse_shape(part)
            if s is None:
                return None
            elements.append(s)
        return TupleShape(tuple(elements))
    m = _ARRAY_SHAPE_RE.fullmatch(text)
    if m is None:
        return None
    dims: list[int] = []
    dynamic = False
    dims_text = m.group(2).strip()
    if dims_text and "<" not in dims_text and "?" not in dims_text:
        try:
            return ArrayShape(m.group(1), tuple(map(int, dims_text.split(","))), m.group(3))
        except ValueError:
            return None
    if dims_text:
        for d in dims_text.split(","):
            d = d.strip()
            if d.startswith("<="):
                dynamic = True
                d = d[2:]
            if d == "?":
                dynamic = True
                d = "0"
            if not d.isdigit():
                return None
            dims.append(int(d))
    return ArrayShape(m.group(1), tuple(dims), m.group(3), dynamic)


# --------------------------------------------------------------------------------------------
# Low-level scanning: matching brackets and top-level splitting, skipping quoted strings.

# One token per match: a whole quoted string, or one structural character. Iterating these with
# finditer keeps the per-character work inside the regex engine.
_TOKEN_RE = re.compile(r""""(?:[^"\\]|\\.)*"?|'(?:[^'\\]|\\.)*'?|[(){}\[\],]""", re.DOTALL)


def _match_close(s: str, pos: int) -> int:
    """Index of the bracket closing the one at ``s[pos]``; -1 when unbalanced."""
    depth = 0
    for m in _TOKEN_RE.finditer(s, pos):
        c = m.group()
        if c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth == 0:
                return m.start()
    return -1


def _split_top_level(s: str, start: int, end: int) -> list[str]:
    """Split ``s[start:end]`` at commas outside brackets and quotes; parts are stripped."""
    parts = []
    depth = 0
    seg = start
    for m in _TOKEN_RE.finditer(s, start, end):
        c = m.group()
        if c == ",":
            if depth == 0:
                i = m.start()
                parts.append(s[seg:i].strip())
                seg = i + 1
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
    last = s[seg:end].strip()
    if last or parts:
        parts.append(last)
    return parts


def _parse_attributes(s: str, start: int) -> dict[str, str]:
    """Parse ``, k=v, k=v`` (from ``start``) into a dict of raw values.

    The mesh form of replica groups prints a top-level comma inside the value
    (``mesh[...], device_ids=(...) {...}``); that ``device_ids`` part is folded back into the
    value of the attribute before it. A part without ``=`` is kept with an empty value.
    """
    attrs: dict[str, str] = {}
    prev_key = None
    for part in _split_top_level(s, start, len(s)):
        if not part:
            continue
        eq = part.find("=")
        if eq <= 0:
            attrs[part] = ""
            prev_key = part
            continue
        key = part[:eq].strip()
        value = part[eq + 1 :].strip()
        if key == "device_ids" and prev_key is not None and attrs[prev_key].startswith("mesh["):
            attrs[prev_key] = attrs[prev_key] + ", " + part
            continue
        attrs[key] = value
        prev_key = key
    return attrs


_ESCAPE_RE = re.compile(rb"\\([0-7]{1,3}|x[0-9a-fA-F]{1,2}|.)", re.DOTALL)
_SIMPLE_ESCAPES = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"'": b"'", b'"': b'"', b"\\": b"\\"}


def _unescape(body: str) -> str:
    """Undo C-style escaping (absl::CEscape) of a quoted HLO string body."""
    if "\\" not in body:
        return body

    def repl(m: re.Match[bytes]) -> bytes:
        e = m.group(1)
        if e[:1].isdigit():
            return bytes([int(e, 8) & 0xFF])
        if e[:1] == b"x" and len(e) > 1:
            return bytes([int(e[1:], 16)])
        return _SIMPLE_ESCAPES.get(e, e)

    return _ESCAPE_RE.sub(repl, body.encode("utf-8")).decode("utf-8", errors="replace")


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return _unescape(value[1:-1])
    return value


# --------------------------------------------------------------------------------------------
# Metadata and source locations


@dataclasses.dataclass(frozen=True, slots=True)
class SourceFrame:
    """One Python frame a source location resolves to.

    Attributes:
      file: the file name as JAX recorded it (usually absolute).
      line: 1-based line number.
      function: the function name (``<module>``, ``step.<locals>.<lambda>``), or None.
      column: 1-based column as XLA prints it, or None when not recorded.
    """

    file: str
    line: int
    function: str | None = None
    column: int | None = None


_KV_RE = re.compile(r'([A-Za-z_]\w*)=("(?:[^"\\]|\\.)*"|[^\s}]+)')


@dataclasses.dataclass(frozen=True, slots=True)
class OpMetadata:
    """An instruction's ``metadata={...}``.

    Attributes:
      op_name: JAX's name path of the op (``jit(step)/transpose(jvp())/dot_general``); for an
        entry parameter, the argument's key path (``p['w1']``).
      op_type: the ``op_type`` field (older modules), or None.
      stack_frame_id: id into the module's ``StackFrames`` table, or None.
      source_file, source_line: the older direct source fields, or None.
      fields: every ``key=value`` in the metadata, values unquoted.
    """

    op_name: str | None
    op_type: str | None
    stack_frame_id: int | None
    source_file: str | None
    source_line: int | None
    fields: Mapping[str, str] = dataclasses.field(compare=False, hash=False)


@functools.lru_cache(maxsize=1 << 14)
def _parse_metadata(raw: str) -> OpMetadata:
    body = raw.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1]
    fields = {k: _unquote(v) for k, v in _KV_RE.findall(body)}

    def as_int(key: str) -> int | None:
        v = fields.get(key)
        return int(v) if v is not None and v.lstrip("-").isdigit() else None

    return OpMetadata(
        op_name=fields.get("op_name"),
        op_type=fields.get("op_type"),
        stack_frame_id=as_int("stack_frame_id"),
        source_file=fields.get("source_file"),
        source_line=as_int("source_line"),
        fields=fields,
    )


# --------------------------------------------------------------------------------------------
# Instructions, computations, module

CALL_ATTRIBUTES: tuple[str, ...] = (
    "calls",
    "to_apply",
    "body",
    "condition",
    "branch_computations",
    "true_computation",
    "false_computation",
    "called_computations",
)
"""Instruction attributes that name called computations (``to_apply`` names a reducer)."""
_NAME_RE = re.compile(r"%?([A-Za-z_][\w.\-]*)")
_PCT_NAME_RE = re.compile(r"%([\w.\-]+)")
_NO_OPERAND_OPCODES = frozenset({"constant", "parameter", "iota", "partition-id", "replica-id"})


@dataclasses.dataclass(frozen=True, slots=True)
class HloInstruction:
    """One instruction line of a computation.

    Attributes:
      name: instruction name without ``%``.
      opcode: HLO opcode text (``fusion``, ``all-reduce``, ``all-gather-start``...).
      shape: the result shape, or None when its text is not a shape this parser knows.
      shape_text: the result shape as printed (layouts included).
      operands: operand instruction names without ``%``, in order (empty for ``constant``,
        ``parameter``, ``iota``).
      operand_text: the raw text between the opcode's parentheses (a constant's literal, a
        parameter's number).
      attributes: every ``name=value`` after the operands, values raw (``{...}`` kept).
      called_computations: computations named by ``calls=``, ``to_apply=``, ``body=``,
        ``condition=``, ``branch_computations=``, ``true_computation=``, ``false_computation=``,
        ``called_computations=``, in that order.
      metadata: the parsed ``metadata={...}``, or None.
      is_root: True for the computation's ``ROOT`` instruction.
      line_number: 1-based line in the module text.
    """

    name: str
    opcode: str
    shape: Shape | None
    shape_text: str
    operands: tuple[str, ...]
    operand_text: str
    attributes: Mapping[str, str] = dataclasses.field(compare=False, hash=False)
    called_computations: tuple[str, ...] = ()
    metadata: OpMetadata | None = None
    is_root: bool = False
    line_number: int = 0

    @property
    def parameter_number(self) -> int | None:
        """For a ``parameter(N)`` instruction, N; otherwise None."""
        if self.opcode != "parameter":
            return None
        t = self.operand_text.strip()
        return int(t) if t.isdigit() else None


@dataclasses.dataclass(frozen=True, slots=True)
class HloComputation:
    """One computation (entry, fusion body, while body/condition, reducer, async wrapper...).

    Attributes:
      name: computation name without ``%``.
      is_entry: True for the ``ENTRY`` computation.
      signature: the raw ``(params) -> result`` text of the header ("" if none was printed).
      instructions: instructions in text order.
      line_number: 1-based line of the header.
    """

    name: str
    is_entry: bool
    signature: str
    instructions: tuple[HloInstruction, ...]
    line_number: int = 0
    _by_name: Mapping[str, HloInstruction] = dataclasses.field(
        default_factory=dict, repr=False, compare=False, hash=False
    )

    def instruction(self, name: str) -> HloInstruction | None:
        """The instruction called ``name`` (without ``%``), or None."""
        return self._by_name.get(name)

    def behind(self, name: str, opcodes: frozenset[str], hops: int) -> HloInstruction | None:
        """The instruction behind ``name``: followed through single-operand instructions whose opcode
        is one of ``opcodes`` (copies, bitcasts, ...), looking at ``hops`` instructions of the chain
        at most (``name``'s own included); None when ``name`` names nothing or the chain is longer."""
        ins = self.instruction(name)
        for _ in range(hops):
            if ins is None or ins.opcode not in opcodes or len(ins.operands) != 1:
                return ins
            ins = self.instruction(ins.operands[0])
        return None

    @property
    def root(self) -> HloInstruction | None:
        """The ``ROOT`` instruction (the last one if none is marked), or None if empty."""
        for ins in reversed(self.instructions):
            if ins.is_root:
                return ins
        return self.instructions[-1] if self.instructions else None

    def parameters(self) -> tuple[HloInstruction, ...]:
        """The ``parameter(N)`` instructions, ordered by N."""
        ps = [i for i in self.instructions if i.opcode == "parameter"]
        return tuple(sorted(ps, key=lambda i: (i.parameter_number is None, i.parameter_number or 0)))


@dataclasses.dataclass(frozen=True, slots=True)
class HloModule:
    """A parsed HLO module.

    Attributes:
      name: module name (``jit_step``).
      attributes: header attributes, raw (``num_partitions`` -> ``"8"``,
        ``entry_computation_layout`` -> ``"{(f32[16,32]{1,0})->f32[16,32]{1,0}}"``).
      computations: every computation in text order.
      entry_name: the entry computation's name, or None if no ``ENTRY`` was found.
      tables: the source tables (``FileNames``, ``FunctionNames``, ``FileLocations``,
        ``StackFrames``, and any other ``Name`` section of ``N value`` lines): section name ->
        {id -> raw value}.
      unparsed_lines: ``(line_number, text)`` of every non-blank line the parser did not
        understand, kept verbatim.
    """

    name: str
    attributes: Mapping[str, str] = dataclasses.field(compare=False, hash=False)
    computations: tuple[HloComputation, ...] = ()
    entry_name: str | None = None
    tables: Mapping[str, Mapping[int, str]] = dataclasses.field(default_factory=dict, compare=False, hash=False)
    unparsed_lines: tuple[tuple[int, str], ...] = ()
    _by_name: Mapping[str, HloComputation] = dataclasses.field(
        default_factory=dict, repr=False, compare=False, hash=False
    )
    _frames: Mapping[int, tuple[int, int]] = dataclasses.field(
        default_factory=dict, repr=False, compare=False, hash=False
    )
    _locations: dict = dataclasses.field(default_factory=dict, repr=False, compare=False, hash=False)
    _op_frames: dict = dataclasses.field(default_factory=dict, repr=False, compare=False, hash=False)

    # -- lookup -------------------------------------------------------------------------------

    def computation(self, name: str) -> HloComputation | None:
        """The computation called ``name`` (without ``%``), or None."""
        return self._by_name.get(name)

    @property
    def entry(self) -> HloComputation | None:
        """The entry computation, or None."""
        return self._by_name.get(self.entry_name) if self.entry_name else None

    @property
    def num_partitions(self) -> int | None:
        """The header's ``num_partitions`` (devices of one SPMD program), or None if absent."""
        v = self.attributes.get("num_partitions", "")
        return int(v) if v.isdigit() else None

    @property
    def replica_count(self) -> int | None:
        """The header's ``replica_count``, or None if absent (XLA then means 1)."""
        v = self.attributes.get("replica_count", "")
        return int(v) if v.isdigit() else None

    def entry_parameters(self) -> tuple[HloInstruction, ...]:
        """The entry computation's parameters ordered by number; ``metadata.op_name`` is the
        argument's key path as JAX names it (``p['w1']``, ``x``)."""
        e = self.entry
        return e.parameters() if e else ()

    # -- source locations ---------------------------------------------------------------------

    def stack(self, stack_frame_id: int) -> tuple[SourceFrame, ...]:
        """The call chain of a ``stack_frame_id``, innermost frame first (the op's own line,
        then its callers). Empty when the id is not in the ``StackFrames`` table."""
        out: list[SourceFrame] = []
        seen: set[int] = set()
        fid: int | None = stack_frame_id
        while fid and fid not in seen and fid in self._frames:
            seen.add(fid)
            loc_id, parent = self._frames[fid]
            frame = self._file_location(loc_id)
            if frame is not None:
                out.append(frame)
            fid = parent
        return tuple(out)

    def source_stack(self, instruction: HloInstruction) -> tuple[SourceFrame, ...]:
        """An instruction's source chain, innermost first: from ``stack_frame_id`` when present,
        else the single frame of the older ``source_file``/``source_line`` metadata, else ()."""
        md = instruction.metadata
        if md is None:
            return ()
        if md.stack_frame_id is not None:
            chain = self.stack(md.stack_frame_id)
            if chain:
                return chain
        if md.source_file is not None and md.source_line is not None:
            col = md.fields.get("source_column")
            return (SourceFrame(md.source_file, md.source_line, None, int(col) if col and col.isdigit() else None),)
        return ()

    def _file_location(self, loc_id: int) -> SourceFrame | None:
        try:
            return self._locations[loc_id]
        except KeyError:
            frame = self._locations[loc_id] = self._read_file_location(loc_id)
            return frame

    def _read_file_location(self, loc_id: int) -> SourceFrame | None:
        raw = self.tables.get("FileLocations", {}).get(loc_id)
        if raw is None:
            return None
        f = dict(_KV_RE.findall(raw))
        try:
            file = _unquote(self.tables["FileNames"][int(f["file_name_id"])])
            line = int(f["line"])
        except (KeyError, ValueError):
            return None
        fn_raw = self.tables.get("FunctionNames", {}).get(int(f.get("function_name_id", "0") or 0))
        col = f.get("column")
        return SourceFrame(
            file,
            line,
            _unquote(fn_raw) if fn_raw is not None else None,
            int(col) if col and col.isdigit() else None,
        )


# --------------------------------------------------------------------------------------------
# The parser

_INSTR_RE = re.compile(r"\s*(ROOT\s+)?%?([^\s=,(){}]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-_.]*)\(")
_HEADER_RE = re.compile(r"(ENTRY\s+)?%?([^\s(){}]+)\s*(.*?)\s*\{\s*$")
_TABLE_ENTRY_RE = re.compile(r"(\d+)\s+(.*)$")
_SECTION_RE = re.compile(r"[A-Z][A-Za-z]+$")


def _parse_instruction(line: str, line_number: int) -> HloInstruction | None:
    m = _INSTR_RE.match(line)
    if m is None:
        return None
    pos = m.end()
    if pos >= len(line):
        return None
    if line[pos] == "(":
        close = _match_close(line, pos)
        if close < 0:
            return None
        shape_end = close + 1
    else:
        shape_end = line.find(" ", pos)
        if shape_end < 0:
            return None
    shape_text = line[pos:shape_end]
    om = _OPCODE_RE.match(line, shape_end)
    if om is None:
        return None
    opcode = om.group(1)
    open_paren = om.end() - 1
    close = _match_close(line, open_paren)
    if close < 0:
        return None
    operand_text = line[open_paren + 1 : close]
    if opcode in _NO_OPERAND_OPCODES:
        operands: tuple[str, ...] = ()
    elif "%" in operand_text:
        operands = tuple(_PCT_NAME_RE.findall(operand_text))
    else:
        # Short style without '%': an operand is its last word (older style put a shape first).
        names = []
        for part in _split_top_level(operand_text, 0, len(operand_text)):
            word = part.rsplit(" ", 1)[-1]
            nm = _NAME_RE.fullmatch(word)
            if nm and not word[0].isdigit() and word not in ("true", "false"):
                names.append(nm.group(1))
        operands = tuple(names)
    attrs = _parse_attributes(line, close + 1) if close + 1 < len(line) else {}
    called: list[str] = []
    for key in CALL_ATTRIBUTES:
        v = attrs.get(key)
        if v:
            called.extend(_NAME_RE.findall(v))
    md_raw = attrs.get("metadata")
    return HloInstruction(
        name=m.group(2),
        opcode=opcode,
        shape=parse_shape(shape_text),
        shape_text=shape_text,
        operands=operands,
        operand_text=operand_text,
        attributes=attrs,
        called_computations=tuple(called),
        metadata=_parse_metadata(md_raw) if md_raw else None,
        is_root=m.group(1) is not None,
        line_number=line_number,
    )


def parse_hlo_module(text: str) -> HloModule:
    """Parse the text of one HLO module (``compiled.as_text()``) into an :class:`HloModule`.

    Never raises on content: lines it does not understand go to
    :attr:`HloModule.unparsed_lines`. Runs in time linear in ``len(text)``. When the text holds
    no ``HloModule`` header, the name is "".
    """
    # The parse allocates many small objects and frees none: pausing the cyclic collector
    # saves its repeated full scans (about a quarter of the time on large modules).
    with paused_gc():
        return _parse(text)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Pause Python's cyclic garbage collector inside the block (restored on exit).

    Building or walking a large module allocates many long-lived objects; every automatic
    collection would rescan all of them, which makes big modules pay more than linear time.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _parse(text: str) -> HloModule:
    name = ""
    attrs: dict[str, str] = {}
    computations: list[HloComputation] = []
    entry_name: str | None = None
    tables: dict[str, dict[int, str]] = {}
    unparsed: list[tuple[int, str]] = []

    section: dict[int, str] | None = None
    comp_header: tuple[str, bool, str, int] | None = None
    comp_instrs: list[HloInstruction] = []

    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if comp_header is not None:
            if stripped == "}":
                cname, is_entry, sig, cline = comp_header
                comp = HloComputation(cname, is_entry, sig, tuple(comp_instrs), cline, {i.name: i for i in comp_instrs})
                computations.append(comp)
                if is_entry:
                    entry_name = cname
                comp_header = None
                comp_instrs = []
                continue
            if not stripped:
                continue
            ins = _parse_instruction(line, number)
            if ins is None:
                unparsed.append((number, line))
            else:
                comp_instrs.append(ins)
            continue
        if not stripped:
            section = None
            continue
        if section is not None:
            tm = _TABLE_ENTRY_RE.match(stripped)
            if tm:
                section[int(tm.group(1))] = tm.group(2)
                continue
            section = None
        if stripped.startswith("HloModule ") or stripped == "HloModule":
            rest = stripped[len("HloModule") :].strip()
            comma = rest.find(",")
            name = (rest if comma < 0 else rest[:comma]).strip()
            if comma >= 0:
                attrs = _parse_attributes(rest, comma)
            continue
        if _SECTION_RE.match(stripped):
            section = tables.setdefault(stripped, {})
            continue
        if stripped.endswith("{") and not line[:1].isspace():
            hm = _HEADER_RE.match(stripped)
            if hm:
                comp_header = (hm.group(2), hm.group(1) is not None, hm.group(3), number)
                comp_instrs = []
                continue
        unparsed.append((number, line))

    if comp_header is not None:  # unterminated last computation: keep what was read
        cname, is_entry, sig, cline = comp_header
        computations.append(
            HloComputation(cname, is_entry, sig, tuple(comp_instrs), cline, {i.name: i for i in comp_instrs})
        )
        if is_entry:
            entry_name = cname

    return HloModule(
        name=name,
        attributes=attrs,
        computations=tuple(computations),
        entry_name=entry_name,
        tables=tables,
        unparsed_lines=tuple(unparsed),
        _by_name={c.name: c for c in computations},
        _frames=_frame_table(tables.get("StackFrames", {})),
    )


def _frame_table(raw: Mapping[int, str]) -> dict[int, tuple[int, int]]:
    """``StackFrames`` rows -> {frame id: (file location id, parent frame id or 0)}.

    XLA's text printer (as of jaxlib 0.10) prints ``parent_frame_id`` one higher than the id it
    means, with "no parent" printed as 1 (so frame 1, always a root, reads
    ``parent_frame_id=1``). A table whose frame 1 names itself as parent is read that way;
    one whose roots print 0 is read as written.
    """
    rows: dict[int, tuple[int, int]] = {}
    for fid, value in raw.items():
        f = dict(_KV_RE.findall(value))
        try:
            rows[fid] = (int(f.get("file_location_id", "0")), int(f.get("parent_frame_id", "0")))
        except ValueError:
            continue
    first = rows.get(1)
    if first is not None and first[1] == 1:
        return {fid: (loc, parent - 1) for fid, (loc, parent) in rows.items()}
    return rows


# --------------------------------------------------------------------------------------------
# Attribute values
#
# Values stay raw text in :attr:`HloInstruction.attributes`. What a ``replica_groups`` or
# ``source_target_pairs`` value *means* (which devices form a group, which mesh axes they run
# over) is not syntax: :mod:`stagetool.hlo.collectives` reads it.

_INT_RE = re.compile(r"-?\d+")


# --------------------------------------------------------------------------------------------
# The header's input_output_alias


@dataclasses.dataclass(frozen=True)
class AliasEntry:
    """One entry of the HLO module's ``input_output_alias``.

    Attributes:
      output_index: shape index of the output (``(0,)`` is the first element of the result tuple;
        ``()`` the whole, non-tuple result).
      parameter_number: entry computation parameter number (jit prunes unused arguments, so
        this is not always the flat input-leaf index).
      parameter_index: shape index within that parameter (``()`` for a non-tuple parameter).
      kind: ``"may-alias"`` or ``"must-alias"``.
    """

    output_index: tuple[int, ...]
    parameter_number: int
    parameter_index: tuple[int, ...]
    kind: str


_ALIAS_ENTRY = re.compile(
    r"\{\s*([\d,\s]*)\}\s*:\s*\(\s*(\d+)\s*,\s*\{\s*([\d,\s]*)\}\s*(?:,\s*([\w-]+)\s*)?\)")


def _index(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.replace(" ", "").split(",") if p)


def parse_input_output_alias(hlo_text: str) -> tuple[AliasEntry, ...]:
    """Parse ``input_output_alias={ ... }`` from the ``HloModule`` header of compiled HLO text.

    Args:
      hlo_text: ``Compiled.as_text()`` (only the first ``HloModule`` line is read).

    Returns:
      The entries sorted by output index; ``()`` when the header has no alias clause
      (nothing donated, or no donation usable).
    """
    header = next((ln for ln in hlo_text.splitlines() if ln.startswith("HloModule")), "")
    start = header.find("input_output_alias={")
    if start < 0:
        return ()
    i = start + len("input_output_alias=")
    depth = 0
    for j in range(i, len(header)):
        depth += {"{": 1, "}": -1}.get(header[j], 0)
        if depth == 0:
            body = header[i + 1:j]
            break
    else:
        body = header[i + 1:]
    entries = [AliasEntry(_index(m.group(1)), int(m.group(2)), _index(m.group(3)), m.group(4) or "may-alias")
               for m in _ALIAS_ENTRY.finditer(body)]
    return tuple(sorted(entries, key=lambda e: (e.output_index, e.parameter_number)))


def parse_int_list(raw: str | None) -> tuple[int, ...] | None:
    """``{0,2}`` / ``0`` -> (0, 2) / (0,); None for None or text without integers."""
    if raw is None:
        return None
    vals = _INT_RE.findall(raw)
    return tuple(int(v) for v in vals) if vals else None


def backend_config_json(instruction: HloInstruction) -> dict | None:
    """The instruction's ``backend_config`` parsed as JSON, or None if absent or not JSON."""
    raw = instruction.attributes.get("backend_config")
    if not raw or raw[0] != "{":
        return None
    try:
        v = json.loads(raw)
    except ValueError:
        return None
    return v if isinstance(v, dict) else None
