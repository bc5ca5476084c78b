"""Writes docs/api.md, the public API reference of graphed, from the Python
docstrings (the names in ``graphed.__all__``) and the ``///`` comments of the
C++ public headers (include/graphed/*.h).

    python scripts/api_reference.py            # rewrite docs/api.md
    python scripts/api_reference.py --check    # exit 1 if docs/api.md is stale
                                                # or a public name has no docs

The headers are read as text, without building: a line-based scanner follows
namespaces, classes and their access sections, and records every declaration
at namespace scope or in a public section, with the ``///`` comment right
above it (or a trailing ``///<``). ``namespace detail`` is private. Exempt:
deleted functions, destructors, defaulted members, friends, forward
declarations, inheriting constructors (``using Base::Base;``) and an overload
that directly follows a documented declaration of the same name (one comment
for the group).

The Python half imports graphed (built and installed); where that fails, the
C++ half is still produced and checked, and the Python half is reported as
unavailable. tests/python/test_api_docs.py runs both checks.
"""

import argparse
import dataclasses
import importlib
import inspect
import os
import re
import sys
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEADER_DIR = os.path.join(ROOT, "include", "graphed")
API_MD = os.path.join(ROOT, "docs", "api.md")
PYTHON_MARKER = "<!-- python-api -->"
CPP_MARKER = "<!-- cpp-api -->"


# --------------------------------------------------------------------------
# C++ headers
# --------------------------------------------------------------------------

@dataclasses.dataclass
class Decl:
    header: str            # file name, e.g. "graph.h"
    line: int              # 1-based line of the declaration's first line
    kind: str              # "class", "enum", "enumerator", "function", "alias", "variable", "macro"
    name: str              # qualified inside namespace graphed, e.g. "Graph::replay"
    signature: str         # the declaration, one line, body removed
    doc: List[str]         # comment lines without the leading "///"
    parent: Optional[str]  # enclosing class or enum, qualified
    exempt: bool = False   # needs no comment (see the module docstring)

    @property
    def where(self):
        return f"include/graphed/{self.header}:{self.line}"


@dataclasses.dataclass
class Header:
    name: str
    file_doc: List[str]
    decls: List[Decl]


@dataclasses.dataclass
class _Scope:
    kind: str          # "namespace", "class", "enum"
    name: str
    public: bool       # current access (classes) / visible (namespaces)
    hidden: bool       # inside namespace detail or a non-public section


_CLASS_HEAD = re.compile(
    r"^(?:template\s*<.*>\s*)?(class|struct|union)\s+(?:\[\[.*?\]\]\s*)?(?:alignas\(.*?\)\s*)?"
    r"([A-Za-z_]\w*)(?:\s+final)?\s*(?::[^{]*)?$")
_ENUM_HEAD = re.compile(r"^enum(?:\s+class|\s+struct)?\s+([A-Za-z_]\w*)(?:\s*:\s*[\w:]+)?$")
_NAMESPACE_HEAD = re.compile(r"^(?:inline\s+)?namespace\s*([\w:]*)$")
_ACCESS = re.compile(r"^(public|private|protected)\s*:")
_IDENT = re.compile(r"[A-Za-z_~]\w*")


def _strip_comment(line):
    """The code of `line` without a trailing // comment; the trailing ///<
    comment, if any, separately."""
    in_string = None
    i = 0
    while i < len(line):
        c = line[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == in_string:
                in_string = None
        elif c in "\"'":
            # A digit separator (1'000) is not a character literal.
            if c == "'" and i > 0 and line[i - 1].isalnum() and i + 1 < len(line) and line[i + 1].isalnum():
                pass
            else:
                in_string = c
        elif line.startswith("//", i):
            rest = line[i:]
            trailing = rest[4:].strip() if rest.startswith("///<") else None
            return line[:i], trailing
        i += 1
    return line, None


def _decl_name(text):
    """The declared name of a statement (function, variable, alias)."""
    text = re.sub(r"\s+", " ", text).strip()
    if text.startswith("using ") and "=" in text:
        return text[len("using "):].split("=")[0].strip()
    if text.startswith("#define"):
        return text.split()[1].split("(")[0]
    depth = 0
    for i, c in enumerate(text):
        if c == "<":
            depth += 1
        elif c == ">":
            depth = max(0, depth - 1)
        elif c == "(" and depth == 0:
            head = text[:i].rstrip()
            m = re.search(r"(operator\s*\S+|~?[A-Za-z_]\w*)$", head)
            return m.group(1).replace(" ", "") if m else head
    head = re.split(r"[=;{\[]", text)[0].strip()
    idents = _IDENT.findall(head)
    return idents[-1] if idents else head


def _is_exempt(text, name, class_name):
    t = re.sub(r"\s+", " ", text)
    if re.search(r"=\s*delete\b", t) or re.search(r"=\s*default\b", t):
        return True
    if t.startswith("friend ") or t.startswith("static_assert"):
        return True
    if name.startswith("~"):
        return True
    m = re.match(r"^using ([\w:]+)::(\w+)\s*;?$", t.strip())
    if m and m.group(1).split("::")[-1] == m.group(2):
        return True  # inheriting constructor
    return False


def _kind_of(text):
    t = re.sub(r"\s+", " ", text).strip()
    if t.startswith("using ") or t.startswith("typedef "):
        return "alias"
    if re.search(r"\boperator\s*\S*?\s*\(", t):
        return "function"
    if "(" in t.split("=")[0]:
        return "function"
    return "variable"


def _clean_signature(text):
    t = re.sub(r"\s+", " ", text).strip()
    t = re.sub(r"\s*\{\s*$", "", t)
    t = t.rstrip(";").rstrip()
    if re.match(r"^(?:template\s*<.*>\s*)?(class|struct|union|enum)\b", t) and "(" not in t:
        return t
    # Constructor initializer lists belong to the body.
    t = re.sub(r"\)(\s*noexcept)?\s*:\s*[A-Za-z_]\w*\s*[({].*$", r")\1", t)
    return t + ";" if not t.startswith("#define") else t


def parse_header(path):
    """The public declarations of one header, in order."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    name = os.path.basename(path)
    decls: List[Decl] = []
    file_doc: List[str] = []
    scopes: List[_Scope] = []
    pending_doc: List[str] = []
    doc_is_file = False
    stmt = ""            # code of the statement being read
    stmt_line = 0
    stmt_doc: List[str] = []
    skip_depth = 0       # > 0 while inside a function body or brace initializer
    continue_after_skip = False
    paren = 0
    macro = None         # lines of a #define being read
    previous: Optional[Decl] = None
    blank_since_previous = True

    def qualified(n):
        parts = [s.name for s in scopes if s.kind in ("class", "enum")]
        return "::".join(parts + [n])

    def visible():
        return all(not s.hidden for s in scopes) and all(
            s.public for s in scopes if s.kind == "class")

    def parent():
        names = [s.name for s in scopes if s.kind in ("class", "enum")]
        return "::".join(names) if names else None

    def record(kind, text, line_no, doc, decl_name=None):
        nonlocal previous, blank_since_previous
        n = decl_name or _decl_name(text)
        class_name = scopes[-1].name if scopes and scopes[-1].kind == "class" else None
        d = Decl(name, line_no, kind, qualified(n), _clean_signature(text), list(doc), parent(),
                 exempt=_is_exempt(text, n, class_name))
        if not d.doc and previous is not None and not blank_since_previous and \
                previous.name == d.name and (previous.doc or previous.exempt):
            d.exempt = True  # an overload documented with the one above
        if visible():
            decls.append(d)
        previous = d
        blank_since_previous = False
        return d

    for index, raw in enumerate(lines):
        line_no = index + 1
        stripped = raw.strip()
        if macro is not None:
            macro.append(stripped)
            if not stripped.endswith("\\"):
                macro = None
            continue
        if skip_depth == 0 and not stmt:
            if not stripped:
                if doc_is_file and pending_doc:
                    file_doc = pending_doc
                pending_doc = []
                doc_is_file = False
                blank_since_previous = True
                continue
            if stripped.startswith("///"):
                text = stripped[3:]
                if text.startswith(" "):
                    text = text[1:]
                if text.startswith("\\file"):
                    doc_is_file = True
                    continue
                pending_doc.append(text)
                continue
            if stripped.startswith("//"):
                continue
            if stripped.startswith("#"):
                m = re.match(r"#\s*define\s+([A-Za-z_]\w*)", stripped)
                if m and visible() and not m.group(1).startswith("_"):
                    record("macro", "#define " + re.sub(r"\\$", "", stripped[len("#"):]
                                                         .split("define", 1)[1]).strip()
                           .split(" ")[0], line_no, pending_doc, m.group(1))
                if stripped.endswith("\\"):
                    macro = [stripped]
                pending_doc = []
                continue
            m = _ACCESS.match(stripped)
            if m and scopes and scopes[-1].kind == "class":
                scopes[-1].public = m.group(1) == "public"
                pending_doc = []
                rest = stripped[m.end():].strip()
                if not rest:
                    continue
                stripped = rest
            if scopes and scopes[-1].kind == "enum" and not stripped.startswith("}"):
                code, trailing = _strip_comment(stripped)
                for part in [p.strip() for p in code.split(",") if p.strip()]:
                    enumerator = part.split("=")[0].strip()
                    doc = pending_doc or ([trailing] if trailing else [])
                    record("enumerator", enumerator, line_no, doc, enumerator)
                pending_doc = []
                continue
        code, trailing = _strip_comment(raw)
        if not stmt and skip_depth == 0:
            stmt_line = line_no
            stmt_doc = pending_doc + ([trailing] if trailing else [])
            pending_doc = []
        elif trailing and skip_depth == 0:
            stmt_doc = stmt_doc + [trailing]
        i = 0
        in_string = None
        while i < len(code):
            c = code[i]
            if in_string:
                if c == "\\":
                    i += 2
                    continue
                if c == in_string:
                    in_string = None
                if skip_depth == 0:
                    stmt += c
                i += 1
                continue
            if c in "\"'" and not (c == "'" and i > 0 and code[i - 1].isalnum()):
                in_string = c
                if skip_depth == 0:
                    stmt += c
                i += 1
                continue
            if skip_depth > 0:
                if c == "{":
                    skip_depth += 1
                elif c == "}":
                    skip_depth -= 1
                    if skip_depth == 0:
                        if continue_after_skip:
                            stmt += "{}"
                        else:
                            stmt = ""
                i += 1
                continue
            if c == "(":
                paren += 1
            elif c == ")":
                paren -= 1
            if c == "{" and paren == 0:
                head = re.sub(r"\s+", " ", stmt).strip()
                mc, me, mn = _CLASS_HEAD.match(head), _ENUM_HEAD.match(head), _NAMESPACE_HEAD.match(head)
                if mn:
                    ns = mn.group(1)
                    hidden = ns == "detail" or ns.endswith("::detail") or ns == ""
                    # Only namespace graphed (and nested public ones) is API.
                    if not scopes and ns != "graphed":
                        hidden = True
                    scopes.append(_Scope("namespace", ns, True, hidden))
                    stmt = ""
                elif mc or me:
                    kind = "class" if mc else "enum"
                    decl_name = mc.group(2) if mc else me.group(1)
                    record(kind, head, stmt_line, stmt_doc, decl_name)
                    is_struct = mc is not None and mc.group(1) in ("struct", "union")
                    hidden = False
                    scopes.append(_Scope(kind, decl_name, is_struct or kind == "enum", hidden))
                    stmt = ""
                elif "(" in head or head.startswith("extern"):
                    if head.startswith("extern"):
                        scopes.append(_Scope("namespace", "", True, False))
                        stmt = ""
                    else:
                        record(_kind_of(head), head, stmt_line, stmt_doc)
                        skip_depth = 1
                        continue_after_skip = False
                else:
                    skip_depth = 1
                    continue_after_skip = True
                i += 1
                continue
            if c == "}" and paren == 0:
                if scopes:
                    scopes.pop()
                stmt = ""
                # `};` or `} name;` closing a class or enum: the rest is ignored.
                rest = code[i + 1:].strip()
                if rest.startswith(";"):
                    i = i + 1 + code[i + 1:].index(";")
                i += 1
                continue
            if c == ";" and paren == 0:
                text = stmt.strip()
                stmt = ""
                if text:
                    forward = re.match(r"^(?:template\s*<.*>\s*)?(class|struct|union)\s+[\w:]+$", text)
                    if not forward:
                        record(_kind_of(text), text + ";", stmt_line, stmt_doc)
                i += 1
                continue
            stmt += c
            i += 1
        if stmt and skip_depth == 0:
            stmt += " "
            if not stmt.strip():
                stmt = ""
    return Header(name, file_doc, decls)


def parse_headers(header_dir=HEADER_DIR):
    return [parse_header(os.path.join(header_dir, n))
            for n in sorted(os.listdir(header_dir)) if n.endswith(".h")]


def undocumented_cpp(headers):
    return [d for h in headers for d in h.decls if not d.doc and not d.exempt]


def _doc_markdown(lines, indent=""):
    """Comment lines as markdown: Note underlines dropped, the title kept."""
    out = []
    for text in lines:
        if re.fullmatch(r"~{3,}", text.strip()):
            continue
        m = re.match(r"^Note \[(.*)\]$", text.strip())
        if m:
            out.append(f"{indent}*Note [{m.group(1)}]*")
            continue
        out.append(indent + text if text else "")
    while out and not out[-1].strip():
        out.pop()
    return out


def render_cpp(headers):
    out = [CPP_MARKER, "", "## C++ (`#include <graphed/graphed.h>`, namespace `graphed`)", ""]
    out.append("One section per public header. Declarations in `namespace graphed::detail` "
               "are private and not listed.")
    out.append("")
    for h in headers:
        if out[-1] != "":
            out.append("")
        out.append(f"### `graphed/{h.name}`")
        out.append("")
        if h.file_doc:
            out.extend(_doc_markdown(h.file_doc))
            out.append("")
        for d in h.decls:
            if d.exempt and not d.doc:
                continue
            if d.kind in ("class", "enum") or d.parent is None:
                if out[-1] != "":
                    out.append("")
                out.append(f"#### `{d.name}`")
                out.append("")
                out.append("```cpp")
                out.append(d.signature if d.kind != "macro" else d.signature)
                out.append("```")
                out.append("")
                out.extend(_doc_markdown(d.doc))
                out.append("")
            else:
                sig = d.signature.rstrip(";") if d.kind != "enumerator" else d.name.split("::")[-1]
                first, *rest = _doc_markdown(d.doc, "  ") or [""]
                out.append(f"- `{sig}`: {first.strip()}")
                for r in rest:
                    out.append(r if r.strip() else "")
                out.append("") if rest else None
        if out[-1] != "":
            out.append("")
    return out


# --------------------------------------------------------------------------
# Python
# --------------------------------------------------------------------------

def _rst_to_md(text):
    text = re.sub(r":(?:meth|class|func|attr|mod|data):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    return text


def _signature(name, obj):
    doc = inspect.getdoc(obj) or ""
    try:
        return f"{name}{inspect.signature(obj)}"
    except (TypeError, ValueError):
        pass
    # pybind11 puts the signature on the docstring's first line.
    first = doc.split("\n", 1)[0]
    m = re.match(r"^\w+(\(.*\)(?: -> .*)?)$", first)
    if m:
        return name + re.sub(r"self: [\w.]+(, )?", "self\\1", m.group(1))
    return name


def _pybind_doc(obj):
    """The docstring without pybind11's signature line."""
    doc = inspect.getdoc(obj) or ""
    lines = doc.split("\n")
    if lines and re.match(r"^\w+\(.*\)( -> .*)?$", lines[0]):
        lines = lines[1:]
        while lines and not lines[0].strip():
            lines = lines[1:]
    # pybind11 overloads: "Overloaded function." followed by numbered signatures.
    return "\n".join(lines).strip()


_AST_CACHE = {}


def _source_doc(obj):
    """The docstring of a Python-defined object as this checkout's source has
    it (python/graphed/...), so that the reference follows the source even
    when the installed graphed is older; None when the object is not found
    there (compiled objects, other packages)."""
    target = obj.fget if isinstance(obj, property) else obj
    module = getattr(target, "__module__", None) or ""
    qualname = getattr(target, "__qualname__", None)
    if inspect.ismodule(target):
        module, qualname = target.__name__, ""
    if not module.startswith("graphed") or module.startswith("graphed._C") or qualname is None:
        return None
    parts = module.split(".")[1:]
    path = os.path.join(ROOT, "python", "graphed", *parts)
    path = os.path.join(path, "__init__.py") if os.path.isdir(path) else path + ".py"
    if not os.path.exists(path):
        return None
    if path not in _AST_CACHE:
        import ast
        with open(path, encoding="utf-8") as f:
            _AST_CACHE[path] = ast.parse(f.read())
    import ast
    node = _AST_CACHE[path]
    for name in [p for p in qualname.split(".") if p and p != "<locals>"]:
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    child.name == name:
                found = child  # the last definition wins (property setters)
                if not isinstance(obj, property):
                    break
        if found is None:
            return None
        node = found
    return (ast.get_docstring(node) or "").strip()


def _own_doc(obj):
    """A docstring the object has itself, not one inherited from its type."""
    from_source = _source_doc(obj)
    if from_source is not None:
        return from_source
    if isinstance(obj, property):
        return (obj.__doc__ or "").strip()
    doc = _pybind_doc(obj)
    if not (inspect.isroutine(obj) or inspect.isclass(obj) or inspect.ismodule(obj)):
        return ""
    if inspect.isclass(obj):
        if obj.__doc__ is None:
            return ""
        for base in obj.__mro__[1:]:
            if base.__doc__ == obj.__doc__:
                return ""
    return doc


def _members(cls):
    """Public methods and properties defined on `cls` itself (data fields of
    dataclasses and plain class attributes are described in the class's
    docstring)."""
    out = []
    for n, v in vars(cls).items():
        if n.startswith("_"):
            continue
        if isinstance(v, (staticmethod, classmethod)):
            v = v.__func__
        kind = type(v).__name__
        if isinstance(v, property) or inspect.isroutine(v) or kind in ("instancemethod",):
            out.append((n, v))
    return out


def _source_attribute_docs():
    """`#:` comments above module-level assignments of python/graphed/__init__.py
    (the Sphinx convention)."""
    with open(os.path.join(ROOT, "python", "graphed", "__init__.py"), encoding="utf-8") as f:
        source = f.read()
    docs, pending = {}, []
    for line in source.split("\n"):
        s = line.strip()
        if s.startswith("#:"):
            pending.append(s[2:].strip())
            continue
        m = re.match(r"^([A-Za-z_]\w*)\s*(?::[^=]*)?=", line)
        if m and pending:
            docs[m.group(1)] = " ".join(pending)
        pending = []
    return docs


@dataclasses.dataclass
class PyEntry:
    name: str        # e.g. "TrainStep.step"
    kind: str        # "class", "function", "property", "method", "module", "data"
    signature: str
    doc: str


def python_entries():
    """Every public Python name of graphed with its docs, in __all__ order
    (sorted); raises ImportError where graphed is not importable."""
    graphed = importlib.import_module("graphed")
    attribute_docs = _source_attribute_docs()
    entries: List[PyEntry] = []

    def add_class(qual, cls):
        entries.append(PyEntry(qual, "class", _signature(qual, cls), _own_doc(cls)))
        for n, v in sorted(_members(cls), key=lambda item: item[0]):
            kind = "property" if isinstance(v, property) else "method"
            sig = f"{qual}.{n}" if kind == "property" else _signature(f"{qual}.{n}", v)
            entries.append(PyEntry(f"{qual}.{n}", kind, sig, _own_doc(v)))

    for name in sorted(graphed.__all__, key=str.lower):
        obj = getattr(graphed, name)
        qual = f"graphed.{name}"
        if inspect.isclass(obj):
            add_class(qual, obj)
        elif inspect.ismodule(obj):
            entries.append(PyEntry(qual, "module", qual, _own_doc(obj)))
            public = getattr(obj, "__all__", None)
            if public is None:
                public = [n for n, v in vars(obj).items()
                          if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
                          and getattr(v, "__module__", None) == obj.__name__]
            for n in sorted(public, key=str.lower):
                v = getattr(obj, n)
                if inspect.isclass(v):
                    add_class(f"{qual}.{n}", v)
                else:
                    entries.append(PyEntry(f"{qual}.{n}", "function", _signature(f"{qual}.{n}", v),
                                           _own_doc(v)))
        elif inspect.isroutine(obj):
            entries.append(PyEntry(qual, "function", _signature(qual, obj), _own_doc(obj)))
        else:
            entries.append(PyEntry(qual, "data", f"{qual}: {type(obj).__name__}",
                                   attribute_docs.get(name, "")))
    return entries


def undocumented_python(entries):
    return [e for e in entries if not e.doc.strip()]


def render_python(entries):
    out = [PYTHON_MARKER, "", "## Python (`import graphed`)", ""]
    out.append("The names in `graphed.__all__`, with the public methods and properties of "
               "each class. Errors are described in [troubleshooting.md](troubleshooting.md).")
    out.append("")
    for e in entries:
        if e.kind in ("class", "function", "module", "data"):
            if out[-1] != "":
                out.append("")
            out.append(f"### `{e.name}`")
            out.append("")
            out.append("```python")
            out.append(("class " if e.kind == "class" else "") + e.signature)
            out.append("```")
            out.append("")
            if e.doc:
                out.extend(_rst_to_md(e.doc).split("\n"))
                out.append("")
        else:
            first, *rest = _rst_to_md(e.doc).split("\n") if e.doc else ["(undocumented)"]
            out.append(f"- `{e.signature}`: {first}")
            for r in rest:
                out.append("  " + r if r.strip() else "")
            if rest:
                out.append("")
    if out[-1] != "":
        out.append("")
    return out


PYTHON_UNAVAILABLE = ("(The Python half could not be generated here: graphed is not importable. "
                      "Run `make install`, then `python scripts/api_reference.py`.)")


def render(headers, entries):
    head = ["# API reference", "",
            "Generated by `scripts/api_reference.py` from the Python docstrings and the `///` "
            "comments of `include/graphed/*.h`; do not edit by hand. "
            "`tests/python/test_api_docs.py` fails when this file is stale or a public name "
            "has no documentation.", "",
            "- [Python](#python-import-graphed)",
            "- [C++](#c-include-graphedgraphedh-namespace-graphed)", ""]
    python = render_python(entries) if entries is not None else [PYTHON_MARKER, "", PYTHON_UNAVAILABLE, ""]
    return "\n".join(head + python + render_cpp(headers)).rstrip("\n") + "\n"


def split_sections(text):
    """(head, python half, C++ half) of an api.md text."""
    p, c = text.find(PYTHON_MARKER), text.find(CPP_MARKER)
    if p < 0 or c < 0 or c < p:
        return text, "", ""
    return text[:p], text[p:c], text[c:]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if docs/api.md is stale or a public name lacks docs")
    args = parser.parse_args(argv)
    headers = parse_headers()
    try:
        entries = python_entries()
    except ImportError as error:
        print(f"graphed is not importable ({error}); writing the C++ half only", file=sys.stderr)
        entries = None
    missing = [f"{d.where}: {d.kind} {d.name}" for d in undocumented_cpp(headers)]
    missing += [f"python: {e.kind} {e.name}" for e in undocumented_python(entries or [])]
    text = render(headers, entries)
    if args.check:
        with open(API_MD, encoding="utf-8") as f:
            current = f.read()
        stale = current != text if entries is not None else split_sections(current)[2] != split_sections(text)[2]
        for m in missing:
            print("undocumented:", m)
        if stale:
            print("docs/api.md is stale: run python scripts/api_reference.py")
        return 1 if (stale or missing) else 0
    os.makedirs(os.path.dirname(API_MD), exist_ok=True)
    with open(API_MD, "w", encoding="utf-8") as f:
        f.write(text)
    for m in missing:
        print("undocumented:", m)
    print(f"wrote {os.path.relpath(API_MD, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
