"""docs/api.md stays complete and current (CPU only).

The C++ half is read from include/graphed/*.h without building; the Python half
imports graphed, and is skipped, with the reason, where graphed cannot be
imported. Regenerate with ``python scripts/api_reference.py``."""

import importlib.util
import os
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "api_reference", os.path.join(ROOT, "scripts", "api_reference.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


api = _load_script()

# Public Python names whose documentation lives in src/bindings (pybind11
# docstrings) and is still missing. Shrink this list; never grow it: the test
# fails both when a name outside it lacks docs and when a name in it has
# gained them.
KNOWN_UNDOCUMENTED = set()


def _python_entries():
    try:
        return api.python_entries()
    except ImportError as error:
        pytest.skip(f"graphed is not importable here ({error}); build it with make install")


def _api_md():
    with open(api.API_MD, encoding="utf-8") as f:
        return f.read()


def test_every_public_cpp_declaration_has_a_doc_comment():
    missing = [f"{d.where}: {d.kind} {d.name}" for d in api.undocumented_cpp(api.parse_headers())]
    assert not missing, (
        "Public declarations in include/graphed/ without a /// comment right above them "
        "(or a trailing ///<):\n  " + "\n  ".join(missing))


def test_every_public_python_name_has_a_docstring():
    missing = {e.name for e in api.undocumented_python(_python_entries())}
    new = sorted(missing - KNOWN_UNDOCUMENTED)
    assert not new, "Public Python names without a docstring:\n  " + "\n  ".join(new)
    fixed = sorted(KNOWN_UNDOCUMENTED - missing)
    assert not fixed, ("Documented now; remove them from KNOWN_UNDOCUMENTED in "
                       "tests/python/test_api_docs.py:\n  " + "\n  ".join(fixed))


def test_cpp_half_of_api_md_is_current():
    expected = api.split_sections(api.render(api.parse_headers(), None))[2]
    assert api.split_sections(_api_md())[2] == expected, (
        "docs/api.md is stale (C++ headers changed): run python scripts/api_reference.py")


def test_python_half_of_api_md_is_current():
    expected = api.render(api.parse_headers(), _python_entries())
    assert _api_md() == expected, (
        "docs/api.md is stale (Python docstrings changed): run python scripts/api_reference.py")


def _parse(tmp_path, text):
    path = tmp_path / "sample.h"
    path.write_text(textwrap.dedent(text))
    return api.parse_header(str(path))


def test_scanner_finds_public_declarations_and_skips_private_ones(tmp_path):
    header = _parse(tmp_path, """\
        #pragma once

        /// \\file sample.h
        /// A sample.

        namespace graphed {
        namespace detail {
        void hidden();
        }  // namespace detail

        /// Documented.
        class Widget {
         public:
          /// Makes one.
          Widget();
          ~Widget();
          Widget(const Widget&) = delete;
          /// Runs `x`.
          void run(int x);
          void run(double x);
          int undocumented() const { return value_; }
          /// Options.
          struct Options {
            int plain = 0;
          };

         private:
          int value_{0};
          void secret();
        };

        /// Kinds.
        enum class Kind {
          /// First.
          kA,
          kB,  ///< Second.
          kC,
        };

        /// A macro.
        #define GRAPHED_SAMPLE(x) (x)
        int free_function(int a,
                          int b);
        }  // namespace graphed
        """)
    assert header.file_doc == ["A sample."]
    names = [d.name for d in header.decls]
    assert "hidden" not in names and "Widget::secret" not in names
    assert "Widget::value_" not in names
    missing = sorted(d.name for d in header.decls if not d.doc and not d.exempt)
    assert missing == ["Kind::kC", "Widget::Options::plain", "Widget::undocumented",
                       "free_function"]
    run = [d for d in header.decls if d.name == "Widget::run"]
    assert [d.exempt for d in run] == [False, True]  # the overload shares the comment
    assert [d.signature for d in header.decls if d.name == "free_function"] == [
        "int free_function(int a, int b);"]
    assert [d.doc for d in header.decls if d.name == "GRAPHED_SAMPLE"] == [["A macro."]]
