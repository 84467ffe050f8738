"""Schemas shared by Spark and timely: Spark DDL strings, their Arrow types, and comparisons.

The bridge speaks Spark's type names (``"key bigint, value double"``) on both sides, so that a
timely job can declare the schema of a stream without importing PySpark. A schema is normalised to
a list of ``(name, type)`` pairs where ``type`` is Spark's canonical simple string (``bigint``,
``decimal(10,2)``, ``array<int>``, ``struct<a:int,b:string>`` ...). Arrow is the wire format; the
mapping is explicit and exact (Spark does not cast Arrow types):

=============  =======================  ==============================================
Spark          Arrow                    Python value in a row
=============  =======================  ==============================================
boolean        bool                     bool
tinyint        int8                     int
smallint       int16                    int
int            int32                    int
bigint         int64                    int
float          float32                  float
double         float64                  float
string         utf8 (large_utf8 ok)     str
binary         binary                   bytes
date           date32                   datetime.date
timestamp      timestamp[us, UTC]       datetime.datetime (aware, UTC)
timestamp_ntz  timestamp[us]            datetime.datetime (naive)
decimal(p,s)   decimal128(p, s)         decimal.Decimal
array<T>       list<T>                  list
map<K,V>       map<K, V>                list of (key, value) pairs
struct<...>    struct<...>              dict
=============  =======================  ==============================================
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

Field = tuple[str, str]

_ALIASES = {
    "long": "bigint", "integer": "int", "short": "smallint", "byte": "tinyint", "real": "float",
    "bool": "boolean", "str": "string", "text": "string", "timestamp_ltz": "timestamp",
    "varchar": "string", "char": "string",
}
_PRIMITIVE = {
    "boolean", "tinyint", "smallint", "int", "bigint", "float", "double", "string", "binary", "date",
    "timestamp", "timestamp_ntz", "void",
}


class SchemaError(ValueError):
    """A schema that cannot be parsed, or two schemas that do not match."""


# -- parsing ---------------------------------------------------------------------------------------
_TOKEN = re.compile(r"\s*(?:(`(?:[^`]|``)*`)|([A-Za-z_][A-Za-z0-9_]*)|(\d+)|([<>(),:]))")


def _tokens(text: str) -> list[str]:
    out, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            raise SchemaError(f"cannot parse schema {text!r} at position {pos}: {text[pos:pos + 20]!r}")
        tok = m.group(1) or m.group(2) or m.group(3) or m.group(4)
        out.append(tok)
        pos = m.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, expect: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expect is not None and tok.lower() != expect):
            raise SchemaError(f"cannot parse schema {self.text!r}: expected {expect or 'more'}, found {tok!r}")
        self.i += 1
        return tok

    def name(self) -> str:
        tok = self.take()
        if tok.startswith("`"):
            return tok[1:-1].replace("``", "`")
        if not re.match(r"[A-Za-z_]", tok):
            raise SchemaError(f"cannot parse schema {self.text!r}: expected a column name, found {tok!r}")
        return tok

    def type(self) -> str:
        word = self.take().lower()
        word = _ALIASES.get(word, word)
        if word in ("decimal", "dec", "numeric"):
            p, s = 10, 0
            if self.peek() == "(":
                self.take("(")
                p = int(self.take())
                if self.peek() == ",":
                    self.take(",")
                    s = int(self.take())
                self.take(")")
            return f"decimal({p},{s})"
        if word == "string" and self.peek() == "(":  # varchar(n) / char(n)
            self.take("(")
            self.take()
            self.take(")")
            return "string"
        if word == "array":
            self.take("<")
            inner = self.type()
            self.take(">")
            return f"array<{inner}>"
        if word == "map":
            self.take("<")
            k = self.type()
            self.take(",")
            v = self.type()
            self.take(">")
            return f"map<{k},{v}>"
        if word == "struct":
            self.take("<")
            fields = []
            while self.peek() != ">":
                n = self.name()
                if self.peek() == ":":
                    self.take(":")
                fields.append(f"{_quote(n)}:{self.type()}")  # (quoted as it was: `a b`, `c,d`)
                self._skip_not_null()
                if self.peek() == ",":
                    self.take(",")
            self.take(">")
            return f"struct<{','.join(fields)}>"
        if word not in _PRIMITIVE:
            raise SchemaError(f"unsupported type {word!r} in schema {self.text!r}")
        return word

    def _skip_not_null(self) -> None:
        word = self.peek()
        if word and word.lower() == "not":
            self.take()
            self.take("null")

    def fields(self) -> list[Field]:
        out = []
        while self.peek() is not None:
            n = self.name()
            if self.peek() == ":":
                self.take(":")
            out.append((n, self.type()))
            self._skip_not_null()
            if self.peek() is not None:
                self.take(",")
        return out


def parse(schema: Any) -> list[Field]:
    """Normalise a schema to ``[(name, spark_type), ...]``.

    Accepts a Spark DDL string (``"key bigint, value double"``; also ``struct<key:bigint,...>``), a
    sequence of ``(name, type)`` pairs, a ``pyarrow.Schema``, or a PySpark ``StructType``.
    """
    if schema is None:
        raise SchemaError("no schema given")
    if isinstance(schema, str):
        text = schema.strip()
        if text.lower().startswith("struct<") and text.endswith(">"):
            text = text[len("struct<"):-1]
        fields = _Parser(text).fields()
    elif hasattr(schema, "fields") and hasattr(schema, "simpleString"):  # pyspark StructType
        fields = [(f.name, _Parser(_spark_type_text(f.dataType)).type()) for f in schema.fields]
    elif _is_arrow_schema(schema):
        fields = [(f.name, from_arrow_type(f.type)) for f in schema]
    else:
        try:
            pairs = [(str(n), t) for n, t in schema]
        except (TypeError, ValueError):
            raise SchemaError(f"cannot use {schema!r} as a schema: give a DDL string, (name, type) pairs, "
                              "a pyarrow.Schema or a StructType") from None
        fields = [(n, _type_of(t)) for n, t in pairs]
    if not fields:
        raise SchemaError(f"schema {schema!r} has no columns")
    names = [n for n, _ in fields]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SchemaError(f"schema {schema!r} repeats column(s) {', '.join(dupes)}")
    return fields


def _type_of(t: Any) -> str:
    if isinstance(t, str):
        return _Parser(t).type()
    if hasattr(t, "simpleString"):
        return _Parser(t.simpleString()).type()
    import pyarrow as pa

    if isinstance(t, pa.DataType):
        return from_arrow_type(t)
    raise SchemaError(f"cannot use {t!r} as a column type")


def _is_arrow_schema(obj: Any) -> bool:
    try:
        import pyarrow as pa
    except ImportError:  # pragma: no cover
        return False
    return isinstance(obj, pa.Schema)


def _spark_type_text(dt: Any) -> str:
    """A pyspark ``DataType`` as a type string the parser reads: ``simpleString()``, but with the
    names of nested struct fields quoted (Spark's own leaves ``struct<a b:int>`` unquoted)."""
    fields = getattr(dt, "fields", None)
    if fields is not None:  # StructType
        return "struct<" + ",".join(f"{_quote(f.name)}:{_spark_type_text(f.dataType)}" for f in fields) + ">"
    element = getattr(dt, "elementType", None)
    if element is not None:  # ArrayType
        return f"array<{_spark_type_text(element)}>"
    key = getattr(dt, "keyType", None)
    if key is not None:  # MapType
        return f"map<{_spark_type_text(key)},{_spark_type_text(dt.valueType)}>"
    return str(dt.simpleString())


def ddl(fields: Sequence[Field]) -> str:
    """The Spark DDL string of a normalised schema (``"key bigint, value double"``)."""
    return ", ".join(f"{_quote(n)} {t}" for n, t in fields)


def _quote(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) else "`" + name.replace("`", "``") + "`"


# -- comparison ------------------------------------------------------------------------------------
def mismatch(stream: str, declared: Sequence[Field], actual: Sequence[Field], side: str = "the DataFrame") -> str | None:
    """None when ``actual`` matches ``declared`` (same column names in the same order, same types);
    otherwise a message naming the first differing column and both types."""
    dnames = [n for n, _ in declared]
    anames = [n for n, _ in actual]
    dmap = dict(declared)
    amap = dict(actual)
    for n, t in actual:
        if n not in dmap:
            return (f"stream '{stream}': column '{n}' ({t}) of {side} is not in the schema declared by the "
                    f"timely job: {ddl(declared)}")
    for n, t in declared:
        if n not in amap:
            return (f"stream '{stream}': column '{n}' ({t}) declared by the timely job is missing from {side}, "
                    f"which has: {ddl(actual)}")
        if amap[n] != t:
            return (f"stream '{stream}': column '{n}' has type {amap[n]} in {side} but the timely job declares "
                    f"{t}")
    if dnames != anames:
        return (f"stream '{stream}': columns of {side} are in the order ({', '.join(anames)}), the timely job "
                f"declares ({', '.join(dnames)})")
    return None


# -- arrow -----------------------------------------------------------------------------------------
def _split_top(s: str, sep: str = ",") -> list[str]:
    """``s`` cut at each ``sep`` outside brackets and backquoted names."""
    parts, depth, cur, quoted = [], 0, "", False
    for ch in s:
        if ch == "`":
            quoted = not quoted  # (a doubled `` inside a name toggles twice)
        elif quoted:
            pass
        elif ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        if ch == sep and depth == 0 and not quoted:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def arrow_type(t: str) -> pa.DataType:
    """The Arrow type Spark uses for the Spark type string ``t`` (normalised)."""
    import pyarrow as pa

    simple = {
        "boolean": pa.bool_(), "tinyint": pa.int8(), "smallint": pa.int16(), "int": pa.int32(),
        "bigint": pa.int64(), "float": pa.float32(), "double": pa.float64(), "string": pa.string(),
        "binary": pa.binary(), "date": pa.date32(), "timestamp": pa.timestamp("us", tz="UTC"),
        "timestamp_ntz": pa.timestamp("us"), "void": pa.null(),
    }
    if t in simple:
        return simple[t]
    m = re.fullmatch(r"decimal\((\d+),(\d+)\)", t)
    if m:
        return pa.decimal128(int(m.group(1)), int(m.group(2)))
    if t.startswith("array<"):
        return pa.list_(arrow_type(t[6:-1]))
    if t.startswith("map<"):
        k, v = _split_top(t[4:-1])
        return pa.map_(arrow_type(k), arrow_type(v))
    if t.startswith("struct<"):
        fields = []
        for part in _split_top(t[7:-1]):
            n, ft = _split_top(part, ":")[0], ":".join(_split_top(part, ":")[1:])
            n = n.strip()
            fields.append(pa.field(n[1:-1].replace("``", "`") if n.startswith("`") else n, arrow_type(ft)))
        return pa.struct(fields)
    raise SchemaError(f"no Arrow type for Spark type {t!r}")


def arrow_schema(fields: Sequence[Field]) -> pa.Schema:
    """The ``pyarrow.Schema`` of a normalised schema (every column nullable)."""
    import pyarrow as pa

    return pa.schema([pa.field(n, arrow_type(t)) for n, t in fields])


def from_arrow_type(t: pa.DataType) -> str:
    """The Spark type string of an Arrow type."""
    import pyarrow.types as pt

    if pt.is_boolean(t):
        return "boolean"
    for check, name in ((pt.is_int8, "tinyint"), (pt.is_int16, "smallint"), (pt.is_int32, "int"),
                        (pt.is_int64, "bigint"), (pt.is_float32, "float"), (pt.is_float64, "double"),
                        (pt.is_date32, "date"), (pt.is_null, "void")):
        if check(t):
            return name
    if pt.is_string(t) or pt.is_large_string(t) or getattr(pt, "is_string_view", lambda _: False)(t):
        return "string"
    if pt.is_binary(t) or pt.is_large_binary(t):
        return "binary"
    if pt.is_timestamp(t):
        return "timestamp" if t.tz else "timestamp_ntz"
    if pt.is_decimal(t):
        return f"decimal({t.precision},{t.scale})"
    if pt.is_map(t):
        return f"map<{from_arrow_type(t.key_type)},{from_arrow_type(t.item_type)}>"
    if pt.is_list(t) or pt.is_large_list(t):
        return f"array<{from_arrow_type(t.value_type)}>"
    if pt.is_struct(t):
        return "struct<" + ",".join(f"{_quote(t.field(i).name)}:{from_arrow_type(t.field(i).type)}"
                                    for i in range(t.num_fields)) + ">"
    raise SchemaError(f"Arrow type {t} has no Spark equivalent supported by the bridge")


def conform(batch: pa.RecordBatch, schema: pa.Schema) -> pa.RecordBatch:
    """Return ``batch`` (a RecordBatch) with exactly ``schema``'s column names and types, casting
    safely where needed; a clear :class:`SchemaError` when that is impossible."""
    if batch.schema.equals(schema):
        return batch
    import pyarrow as pa

    if batch.num_columns != len(schema):
        raise SchemaError(f"batch has columns {batch.schema.names}, expected {schema.names}")
    cols = []
    for i, field in enumerate(schema):
        col = batch.column(i)
        if not col.type.equals(field.type):
            try:
                col = col.cast(field.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise SchemaError(f"column '{field.name}': cannot convert {col.type} to {field.type}: {e}") from e
        cols.append(col)
    return pa.RecordBatch.from_arrays(cols, schema=schema)
