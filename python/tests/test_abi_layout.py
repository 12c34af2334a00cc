"""The binding's ctypes copies of the C structs against the C layouts (no PyTorch or numpy).

tests/abi_layout.c (built next to the library as <build>/tests/abi_layout) prints the size,
alignment and field offsets of every public struct; the field lists of the public headers are
read from include/. Three things must agree: the headers' declarations, what abi_layout
prints, and the ctypes.Structure copies in forkattn/_lib.py (names, order, offsets, sizes).
A field added to a C struct without its Python copy fails here."""

import ctypes
import json
import os
import re
import subprocess

import pytest

from forkattn import _lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEADERS = [os.path.join(REPO, "include", h) for h in ("forkattn.h", "forkattn_experimental.h")]

# C struct -> its copy in _lib.py. Every struct with fields in the public headers is listed.
MIRRORS = {
    "forkattn_tensor": _lib.Tensor,
    "forkattn_ctx_options": _lib.CtxOptions,
    "forkattn_prefix_layout": _lib.PrefixLayout,
    "forkattn_tree_layout": _lib.TreeLayoutC,
    "forkattn_layout": _lib.LayoutC,
    "forkattn_kept_set": _lib.KeptSetC,
    "forkattn_kv_policy": _lib.KvPolicy,
    "forkattn_kl_options": _lib.KlOptions,
    "forkattn_kv_cache_options": _lib.KvCacheOptions,
    "forkattn_kv_cache_stats": _lib.KvCacheStats,
    "forkattn_tree_cost_model": _lib.TreeCostModelC,
}

# Option structs (struct_size first) and the C function that initializes one.
OPTIONS = {
    "forkattn_ctx_options": ("forkattn_ctx_options_init", ()),
    "forkattn_kl_options": ("forkattn_kl_options_init", ()),
    "forkattn_kv_cache_options": ("forkattn_kv_cache_options_init", ()),
    "forkattn_kv_policy": ("forkattn_kv_policy_init", (0, 8)),
}


def _header_structs():
    """{struct name: [field names in order]} of every struct with a body in the headers."""
    out = {}
    for path in HEADERS:
        text = open(path).read()
        text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
        text = re.sub(r"//[^\n]*", "", text)
        for m in re.finditer(r"typedef\s+struct\s+(\w+)\s*\{(.*?)\}\s*(\w+)\s*;", text, flags=re.S):
            assert m.group(1) == m.group(3), "typedef name differs from the struct tag: %s" % m.group(1)
            names = []
            for decl in m.group(2).split(";"):
                decl = decl.strip()
                if decl:
                    name = re.search(r"(\w+)\s*(\[[^\]]*\])?$", decl)
                    assert name, "cannot parse the field %r of %s" % (decl, m.group(1))
                    names.append(name.group(1))
            out[m.group(1)] = names
    return out


def _abi_layout_program():
    override = os.environ.get("FORKATTN_ABI_LAYOUT")
    if override:
        return override
    lib = os.environ.get("FORKATTN_LIBRARY") or _lib.library_path()
    return os.path.join(os.path.dirname(os.path.abspath(lib)), "tests", "abi_layout")


@pytest.fixture(scope="module")
def c_layout():
    prog = _abi_layout_program()
    if not os.path.isfile(prog):
        pytest.skip("%s not found: build the C tests (tests/abi_layout.c) next to the library, or set "
                    "FORKATTN_ABI_LAYOUT" % prog)
    out = subprocess.run([prog], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


@pytest.fixture(scope="module")
def header_structs():
    if not all(os.path.isfile(h) for h in HEADERS):
        pytest.skip("the public headers are not in %s/include (not a source checkout)" % REPO)
    return _header_structs()


def test_abi_layout_program_lists_every_header_field(c_layout, header_structs):
    assert sorted(c_layout) == sorted(header_structs), "tests/abi_layout.c must print every public struct"
    for name, fields in header_structs.items():
        assert [f[0] for f in c_layout[name]["fields"]] == fields, \
            "tests/abi_layout.c lists other fields of %s than the header" % name


def test_every_public_struct_has_a_python_copy(header_structs):
    assert sorted(MIRRORS) == sorted(header_structs)


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_ctypes_copy_matches_c_layout(name, c_layout):
    cls, c = MIRRORS[name], c_layout[name]
    py_fields = [f[0] for f in cls._fields_]
    assert py_fields == [f[0] for f in c["fields"]], "%s: field names or order differ from C" % cls.__name__
    for fname, offset, size in c["fields"]:
        desc = getattr(cls, fname)
        assert (desc.offset, desc.size) == (offset, size), \
            "%s.%s: offset/size (%d, %d) in Python, (%d, %d) in C" % (cls.__name__, fname, desc.offset,
                                                                      desc.size, offset, size)
    assert ctypes.sizeof(cls) == c["size"], "%s: sizeof differs from C" % cls.__name__
    assert ctypes.alignment(cls) == c["align"], "%s: alignment differs from C" % cls.__name__


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_option_structs_carry_their_size(name, c_layout):
    cls = MIRRORS[name]
    assert cls._fields_[0][0] == "struct_size"
    assert cls().struct_size == c_layout[name]["size"], "the ctypes copy must set struct_size"
    assert cls(**{cls._fields_[1][0]: 0}).struct_size == c_layout[name]["size"]
    fn, args = OPTIONS[name]
    opt = cls()
    opt.struct_size = 0
    getattr(_lib.load_library(), fn)(ctypes.byref(opt), *args)
    assert opt.struct_size == c_layout[name]["size"], "%s() sets struct_size to the C size" % fn


def test_unset_struct_size_is_refused():
    lib = _lib.load_library()
    opt = _lib.CtxOptions()
    opt.struct_size = 0
    h = ctypes.c_void_p()
    assert lib.forkattn_ctx_create(ctypes.byref(h), ctypes.byref(opt)) == _lib.ERR_INVALID_ARGUMENT
    assert not h.value
    assert b"forkattn_ctx_options_init" in lib.forkattn_ctx_create_error()
