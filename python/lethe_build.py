"""PEP 517 build backend of the lethe Python package (in-tree, stdlib only).

build_wheel packs python/lethe/*.py, the engine's shared library and
include/lethe.h (its types) into a platform wheel. The library is $LETHE_LIBRARY when set, else
<repo>/$LETHE_BUILD/liblethe.so (LETHE_BUILD defaults to "build", as in the
Makefile); when that file is missing it runs `make lib` in the repository
(the compiler `make` already uses, nothing else)."""
import base64
import hashlib
import os
import subprocess
import sysconfig
import tarfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
NAME, VERSION = "lethe", "0.1.0"
TAG = "py3-none-" + sysconfig.get_platform().replace("-", "_").replace(".", "_")


def _library():
    env = os.environ.get("LETHE_LIBRARY")
    if env:
        if not os.path.isfile(env):
            raise RuntimeError(f"lethe build: LETHE_LIBRARY={env} is not a file")
        return env
    build = os.environ.get("LETHE_BUILD", "build")
    lib = os.path.join(REPO, build, "liblethe.so")
    if not os.path.isfile(lib):
        if not os.path.isfile(os.path.join(REPO, "Makefile")):
            raise RuntimeError(f"lethe build: {lib} is missing and {REPO} is not the lethe repository; "
                               "set LETHE_LIBRARY to a built liblethe.so")
        subprocess.check_call(["make", "-C", REPO, f"BUILD={build}", "lib"])
    return lib


def _metadata():
    return (f"Metadata-Version: 2.1\nName: {NAME}\nVersion: {VERSION}\n"
            "Summary: Python bindings of the lethe sparse-first inference engine\nRequires-Python: >=3.8\n")


def _files():
    """(archive name, bytes) of the package."""
    out = []
    pkg = os.path.join(HERE, NAME)
    for f in sorted(os.listdir(pkg)):
        if f.endswith(".py"):
            with open(os.path.join(pkg, f), "rb") as fh:
                out.append((f"{NAME}/{f}", fh.read()))
    with open(_library(), "rb") as fh:
        out.append((f"{NAME}/liblethe.so", fh.read()))
    # the header the library was built with: lethe/_ffi.py reads its structures
    with open(os.path.join(REPO, "include", "lethe.h"), "rb") as fh:
        out.append((f"{NAME}/lethe.h", fh.read()))
    return out


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def _dist_info(dist):
    return [(f"{dist}/METADATA", _metadata().encode()),
            (f"{dist}/WHEEL", f"Wheel-Version: 1.0\nGenerator: lethe_build\nRoot-Is-Purelib: false\nTag: {TAG}\n"
             .encode()),
            (f"{dist}/top_level.txt", f"{NAME}\n".encode())]


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    dist = f"{NAME}-{VERSION}.dist-info"
    for name, data in _dist_info(dist):
        path = os.path.join(metadata_directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(data)
    return dist


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    dist = f"{NAME}-{VERSION}.dist-info"
    wheel = f"{NAME}-{VERSION}-{TAG}.whl"
    entries = _files() + _dist_info(dist)
    record = [_record_line(n, d) for n, d in entries] + [f"{dist}/RECORD,,"]
    with zipfile.ZipFile(os.path.join(wheel_directory, wheel), "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            info.external_attr = (0o755 if name.endswith(".so") else 0o644) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
        z.writestr(f"{dist}/RECORD", "\n".join(record) + "\n")
    return wheel


def build_sdist(sdist_directory, config_settings=None):
    """The sources only (lethe/*.py, this backend, pyproject.toml); building a
    wheel from it needs LETHE_LIBRARY."""
    base = f"{NAME}-{VERSION}"
    name = f"{base}.tar.gz"
    with tarfile.open(os.path.join(sdist_directory, name), "w:gz") as t:
        for f in ["pyproject.toml", "lethe_build.py"] + [f"{NAME}/{p}" for p in sorted(os.listdir(
                os.path.join(HERE, NAME))) if p.endswith(".py")]:
            t.add(os.path.join(HERE, f), arcname=f"{base}/{f}")
        pkg_info = _metadata().encode()
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size = len(pkg_info)
        import io
        t.addfile(info, io.BytesIO(pkg_info))
    return name
