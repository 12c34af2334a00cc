"""The installed package (pip install .): its version is the library's (one source: CMakeLists'
project version), and an offload build (-C cmake.define.FORKATTN_OFFLOAD=...) carries LLVM's
offload runtime beside libforkattn in the package folder and finds it there through an $ORIGIN
runpath, with no LD_LIBRARY_PATH: on a node with only the NVIDIA driver nothing else provides it.
Skipped for a source checkout's package, and the runtime checks for CPU builds and for libraries
loaded from outside the package (a build folder)."""

import os
import struct
import subprocess
import sys

import pytest

import forkattn

# what the offload library loads from LLVM 19 (cmake/ForkattnBundleRuntime.cmake bundles them)
BUNDLED = ("libomptarget.so", "libomp.so", "libLLVM.so", "libz3.so")
PT_LOAD, PT_DYNAMIC = 1, 2
DT_NEEDED, DT_STRTAB, DT_RPATH, DT_RUNPATH = 1, 5, 15, 29


def dynamic_entries(path):
    """{tag: [string, ...]} of an ELF64 little-endian file's NEEDED, RPATH and RUNPATH entries."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:6] == b"\x7fELF\x02\x01", "%s: not an ELF64 little-endian file" % path
    (phoff,) = struct.unpack_from("<Q", data, 32)
    phentsize, phnum = struct.unpack_from("<HH", data, 54)
    loads, dyn = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dyn = (p_offset, p_filesz)
    assert dyn is not None, "%s has no dynamic section" % path
    pairs = [struct.unpack_from("<qQ", data, dyn[0] + o) for o in range(0, dyn[1], 16)]
    strtab = next(val for tag, val in pairs if tag == DT_STRTAB)
    strtab = next(off + strtab - va for va, off, size in loads if va <= strtab < va + size)
    out = {}
    for tag, val in pairs:
        if tag in (DT_NEEDED, DT_RPATH, DT_RUNPATH):
            s = data[strtab + val:data.index(b"\0", strtab + val)].decode()
            out.setdefault(tag, []).append(s)
    return out


def runpath(path):
    entries = dynamic_entries(path)
    return ":".join(entries.get(DT_RUNPATH, []) + entries.get(DT_RPATH, [])).split(":")


def test_installed_version_is_the_library_version():
    try:
        from importlib import metadata
        dist = metadata.distribution("forkattn")
    except Exception:  # Python 3.7's importlib, or no installed distribution
        pytest.skip("forkattn is not installed (a source checkout's python/forkattn)")
    init = os.path.realpath(str(dist.locate_file("forkattn/__init__.py")))
    if init != os.path.realpath(forkattn.__file__):
        pytest.skip("the imported forkattn (%s) is not the installed distribution's" % forkattn.__file__)
    assert dist.version == forkattn.version() == forkattn.__version__


@pytest.fixture(scope="module")
def package_library():
    if not forkattn.build_has_offload():
        pytest.skip("a CPU build of libforkattn: no offload runtime to bundle")
    lib = os.path.realpath(forkattn.library_path())
    pkg = os.path.dirname(os.path.realpath(forkattn.__file__))
    if os.path.dirname(lib) != pkg:
        pytest.skip("%s is not the installed package's library (%s): pip install the repository" % (lib, pkg))
    return lib, pkg


def test_library_and_bundled_runtime_have_origin_runpaths(package_library):
    lib, pkg = package_library
    assert runpath(lib)[0] == "$ORIGIN", (lib, runpath(lib))
    omptarget = [f for f in os.listdir(pkg) if f.startswith("libomptarget.so")]
    assert omptarget, "no libomptarget bundled in %s: %s" % (pkg, sorted(os.listdir(pkg)))
    assert "$ORIGIN" in runpath(os.path.join(pkg, omptarget[0]))


def test_bundled_runtime_resolves_inside_the_package(package_library):
    lib, pkg = package_library
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    out = subprocess.run(["ldd", lib], capture_output=True, text=True, env=env, check=True).stdout
    resolved = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            resolved[parts[0]] = parts[2]
    assert not [n for n, p in resolved.items() if p == "not"], "unresolved libraries:\n" + out
    for prefix in BUNDLED:
        names = [n for n in resolved if n.startswith(prefix)]
        assert names, "%s does not load %s*:\n%s" % (lib, prefix, out)
        for n in names:
            assert os.path.dirname(os.path.realpath(resolved[n])) == pkg, (n, resolved[n], pkg)


def test_this_process_maps_the_bundled_libomptarget(package_library):
    _, pkg = package_library
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/maps is Linux's")
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "libomptarget" in line}
    assert mapped and all(os.path.dirname(os.path.realpath(p)) == pkg for p in mapped), mapped
