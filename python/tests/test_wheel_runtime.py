"""The installed package (pip install .): its version is the library's (one source: CMakeLists'
project version), and an offload build (-C cmake.define.FORKATTN_OFFLOAD=...) carries every shared
library it loads beside libforkattn in the package folder (LLVM's offload runtime, OpenBLAS, hwloc,
ICU, ...), except glibc and the compiler runtime (system_libraries.txt, installed from
cmake/forkattn_system_libraries.txt), and finds them there through $ORIGIN runpaths with an empty
environment: on a node with only the NVIDIA driver nothing else provides them. libcuda.so.1 is not
linked: libomptarget's CUDA plugin dlopens it, so the node's driver supplies it at run time.
Skipped for a source checkout's package, for CPU wheels (they bundle nothing) and for libraries
loaded from outside the package (a build folder)."""

import os
import shutil
import struct
import subprocess
import sys

import pytest

import forkattn

# what the offload library loads from LLVM 19 (cmake/ForkattnBundleRuntime.cmake bundles them, and
# all else it loads)
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


def shared_libraries(pkg):
    """The ELF shared libraries in the package folder (libforkattn and what it bundles)."""
    return sorted(os.path.join(pkg, f) for f in os.listdir(pkg) if ".so" in f and not f.endswith(".txt"))


def system_sonames(path):
    """The allow-list: soname stems (before ".so") that may resolve outside the package."""
    with open(path) as f:
        return {line.strip() for line in f if line.strip() and not line.startswith("#")}


def ldd(path):
    """{needed name: resolved path or None} from ldd with an empty environment (no LD_LIBRARY_PATH)."""
    out = subprocess.run([shutil.which("ldd"), path], capture_output=True, text=True, env={}, check=True).stdout
    resolved = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == "=>":
            resolved[parts[0]] = None if parts[2:4] == ["not", "found"] else parts[2]
        elif parts and parts[0].startswith("/"):  # the dynamic loader itself
            resolved[os.path.basename(parts[0])] = parts[0]
    return resolved


@pytest.fixture(scope="module")
def package_library():
    lib = os.path.realpath(forkattn.library_path())
    pkg = os.path.dirname(os.path.realpath(forkattn.__file__))
    if os.path.dirname(lib) != pkg:
        pytest.skip("%s is not the installed package's library (%s): pip install the repository" % (lib, pkg))
    allow = os.path.join(pkg, "system_libraries.txt")
    if not os.path.exists(allow):
        assert not forkattn.build_has_offload(), "an offload build installed without its bundle: no %s" % allow
        pytest.skip("a CPU wheel: it bundles nothing, the system provides OpenBLAS, hwloc and libgomp")
    return lib, pkg, system_sonames(allow)


def test_library_and_bundled_libraries_have_origin_runpaths(package_library):
    lib, pkg, _ = package_library
    libs = shared_libraries(pkg)
    assert lib in libs and any(os.path.basename(p).startswith("libomptarget.so") for p in libs), libs
    for path in libs:
        assert runpath(path) == ["$ORIGIN"], (path, runpath(path))


def test_every_dependency_resolves_inside_the_package_or_the_system(package_library):
    _, pkg, system = package_library
    for path in shared_libraries(pkg):
        resolved = ldd(path)
        assert set(dynamic_entries(path).get(DT_NEEDED, [])) <= set(resolved), (path, resolved)
        assert None not in resolved.values(), "%s: unresolved %s" % (path, resolved)
        outside = {name: where for name, where in resolved.items()
                   if os.path.dirname(os.path.realpath(where)) != pkg and name.split(".so")[0] not in system}
        assert not outside, "%s loads these from outside %s and the allow-list: %s" % (path, pkg, outside)


def test_offload_runtime_is_bundled(package_library):
    lib, pkg, _ = package_library
    resolved = ldd(lib)
    for prefix in BUNDLED:
        names = [n for n in resolved if n.startswith(prefix)]
        assert names, "%s does not load %s*: %s" % (lib, prefix, resolved)
        assert all(os.path.dirname(os.path.realpath(resolved[n])) == pkg for n in names), (names, resolved)
    assert not [n for p in shared_libraries(pkg) for n in dynamic_entries(p).get(DT_NEEDED, [])
                if n.startswith("libcuda.so")], "libcuda linked: the plugin must dlopen the node's driver"


def test_this_process_maps_the_bundled_libomptarget(package_library):
    _, pkg, _ = package_library
    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/maps is Linux's")
    with open("/proc/self/maps") as f:
        mapped = {line.split()[-1] for line in f if "libomptarget" in line}
    assert mapped and all(os.path.dirname(os.path.realpath(p)) == pkg for p in mapped), mapped
