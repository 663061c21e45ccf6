"""What leantune/native.py loads: only a library this user built and recorded (issue 41).

A library's constructor runs with the loading user's rights, and the library's file name is computed
from public inputs, so a file another user could put there must never be loaded. The planted cases
run the planting as a second local user (nobody, uid 65534, through `subprocess`'s user/group) into
a shared mode-0777 folder, and the planted library's constructor writes a marker file: the marker
must not exist afterwards. Those cases need root (CI runs as root) and skip, saying so, elsewhere.

Most cases build a tiny C file of one function (about 0.1 s); one builds the real host kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from leantune import native
from leantune.train import host_kernels

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting as a second local user (nobody) needs root "
                                                         "to start a process as that user; CI runs as root")
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on PATH ($CC, cc, gcc)")

TINY = "int lt_answer(void) { return %d; }\n"
# The planted library: what a hostile user would put at the library's name. Its constructor runs
# the moment it is loaded, before any function is called.
PLANTED = ('#include <stdio.h>\n'
           '__attribute__((constructor)) static void planted(void) {\n'
           '    FILE *f = fopen(MARKER, "w"); if (f) { fputs("ran", f); fclose(f); } }\n'
           'int lt_answer(void) { return 666; }\n')


def _declare(lib: ctypes.CDLL) -> None:
    lib.lt_answer.restype = ctypes.c_int
    lib.lt_answer.argtypes = []


def _tiny(folder: Path, value: int = 7, code: str | None = None) -> native.NativeLibrary:
    source = folder / "tiny.c"
    source.write_text(code if code is not None else TINY % value)
    return native.NativeLibrary(source, _declare, note="the test's note")


def _compiled(folder: Path, code: str, *flags: str) -> bytes:
    """A shared library of `code`, compiled outside any cache (what a planter or an old build made)."""
    src, out = folder / "other.c", folder / "other.so"
    src.write_text(code)
    subprocess.run([native.compiler(), "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True,
                   capture_output=True)
    return out.read_bytes()


def _as_nobody(script: str, *args: str, data: bytes = b"") -> None:
    """Run a shell script as nobody (umask 0: what it makes is writable by all)."""
    subprocess.run(["/bin/sh", "-c", "umask 0; " + script, "sh", *args], input=data, check=True, timeout=60,
                   user=NOBODY, group=NOBODY, extra_groups=[])


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))
    monkeypatch.delenv("LEANTUNE_HOST_KERNELS", raising=False)
    return root


@pytest.fixture
def shared(monkeypatch) -> Path:
    """A folder every local user can reach and write (tmp_path is root's own, mode 0700)."""
    folder = Path(tempfile.mkdtemp(prefix="leantune-shared-"))
    folder.chmod(0o777)
    monkeypatch.delenv("LEANTUNE_HOST_KERNELS", raising=False)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _plant(lib: native.NativeLibrary, tmp_path: Path, marker: Path) -> tuple[Path, bytes]:
    """nobody puts a library at `lib`'s file name, with its correct sha256 beside it (a planter can
    compute a digest as well as the build): only who owns and can write the files protects."""
    planted = _compiled(tmp_path, PLANTED, f'-DMARKER="{marker}"')
    path = lib.library_path()
    digest = f"{hashlib.sha256(planted).hexdigest()}  {path.name}\n".encode()
    _as_nobody('mkdir -p "$1" && cat > "$2"', str(path.parent), str(path), data=planted)
    _as_nobody('cat > "$1"', str(path) + ".sha256", data=digest)
    return path, planted


@as_root
@needs_cc
@pytest.mark.parametrize("who_made_the_root", ["this user, mode 0777", "nobody"])
def test_a_library_planted_by_another_user_is_refused_and_never_loaded(tmp_path, shared, monkeypatch, caplog,
                                                                       who_made_the_root):
    """The issue's case: a cache root another user can write (a team's shared cache made 0777, or
    a folder another user created); nobody makes host_kernels/ and plants the library there."""
    root = shared / "cache"
    if who_made_the_root == "nobody":
        _as_nobody('mkdir "$1"', str(root))
        expect = f"{root} is owned by another user (nobody, uid {NOBODY})"
    else:
        root.mkdir()
        root.chmod(0o777)
        expect = f"{root} is writable by group and others (mode 0777)"
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))
    marker = tmp_path / "constructor-ran"
    lib = _tiny(tmp_path)
    path, _ = _plant(lib, tmp_path, marker)
    assert os.stat(path).st_uid == NOBODY and os.stat(path.parent).st_uid == NOBODY

    with caplog.at_level(logging.INFO, logger="leantune"):
        got = lib.get()
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert got is None
    assert lib.unavailable_reason() == (f"{expect}: not loading libraries from it ("
                                        + ("set LEANTUNE_CACHE_DIR to a folder of your own" if who_made_the_root
                                           == "nobody" else f"chmod go-w {root}, or set LEANTUNE_CACHE_DIR to a "
                                           "folder only you can write") + "); the slower torch-op path is used")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        lib.unavailable_reason() + " (the test's note)"]


@as_root
@needs_cc
@pytest.mark.parametrize("planted", ["library", "digest"])
def test_another_users_file_in_the_users_own_private_folder_is_refused(tmp_path, shared, monkeypatch, planted):
    """The folders are this user's and private now, but a file in them is another user's (put there
    while the folder was open): it is refused, not loaded, whatever its digest says."""
    root = shared / "cache"
    (root / "host_kernels").mkdir(parents=True)
    (root / "host_kernels").chmod(0o777)
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))
    marker = tmp_path / "constructor-ran"
    lib = _tiny(tmp_path)
    if planted == "library":
        path, _ = _plant(lib, tmp_path, marker)
        refused = path
    else:        # the user's own planted-looking library (the constructor one), another user's digest
        path = lib.library_path()
        data = _compiled(tmp_path, PLANTED, f'-DMARKER="{marker}"')
        path.write_bytes(data)
        path.chmod(0o600)
        refused = Path(str(path) + ".sha256")
        _as_nobody('cat > "$1"', str(refused), data=f"{hashlib.sha256(data).hexdigest()}  {path.name}\n".encode())
    (root / "host_kernels").chmod(0o700)
    root.chmod(0o700)

    got = lib.get()
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert got is None
    assert lib.unavailable_reason() == (f"{refused} is owned by another user (nobody, uid {NOBODY}): not loading it "
                                        "(remove it, and leantune builds its own); the slower torch-op path is used")


@needs_cc
@pytest.mark.parametrize("which, mode, by", [("root", 0o775, "group"), ("host_kernels", 0o707, "others"),
                                             ("host_kernels", 0o777, "group and others")])
def test_a_folder_writable_by_group_or_others_is_refused_with_a_sentence(tmp_path, cache, which, mode, by):
    folder = cache / "host_kernels"
    folder.mkdir(parents=True, mode=0o700)
    unsafe = cache if which == "root" else folder
    unsafe.chmod(mode)
    lib = _tiny(tmp_path)

    assert lib.get() is None
    assert lib.unavailable_reason() == (f"{unsafe} is writable by {by} (mode {mode:04o}): not loading libraries "
                                        f"from it (chmod go-w {unsafe}, or set LEANTUNE_CACHE_DIR to a folder only "
                                        "you can write); the slower torch-op path is used")
    assert list(folder.iterdir()) == [], "something was built in a refused folder"


@needs_cc
def test_a_group_writable_library_file_is_refused(tmp_path, cache):
    """A file the user owns, but made writable by others (chmod 666): anyone could have changed it."""
    first = _tiny(tmp_path)
    assert first.get().lt_answer() == 7
    path = first.library_path()
    path.chmod(0o666)
    again = native.NativeLibrary(first.source, _declare)

    assert again.get() is None
    assert again.unavailable_reason() == (f"{path} is writable by group and others (mode 0666): not loading it "
                                          "(remove it, and leantune builds its own); the slower torch-op path is used")


@as_root
@needs_cc
def test_folders_and_files_owned_by_root_are_trusted_for_another_user(tmp_path, cache, monkeypatch):
    """Root can replace anything anyway, and a cache made under sudo stays usable: the owner rule is
    "this user or root". (The process is root here; it is told it is uid 1000.)"""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    lib = _tiny(tmp_path)
    assert lib.get() is not None, lib.unavailable_reason()
    assert lib.library_path().stat().st_uid == 0
    monkeypatch.setattr(os, "geteuid", lambda: 1001)
    again = native.NativeLibrary(lib.source, _declare)
    assert again.get().lt_answer() == 7


@needs_cc
def test_a_fresh_build_is_private_and_records_its_digest(tmp_path, cache):
    lib = _tiny(tmp_path)
    assert lib.get().lt_answer() == 7
    path = lib.library_path()
    assert [oct(p.stat().st_mode & 0o777) for p in (cache, cache / "host_kernels")] == ["0o700", "0o700"]
    assert path.stat().st_mode & 0o077 == 0
    digest = Path(str(path) + ".sha256")
    assert digest.read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, digest.name], "a temporary was left"


@needs_cc
@pytest.mark.parametrize("damage", ["garbage", "no digest (an old build)", "digest mismatch", "symlink",
                                    "right digest, ctypes cannot load it", "right digest, a function missing"])
def test_a_garbage_or_stale_library_with_the_right_name_is_rebuilt_once(tmp_path, cache, caplog, damage):
    """Not kept as "unavailable" forever, nor loaded: get() rebuilds it once and loads the real one.
    The damaged file is the user's own, in the user's private folder (what an interrupted copy, an
    older leantune without digests, or a stray file leaves)."""
    lib = _tiny(tmp_path)                                      # its lt_answer() is 7
    path = lib.library_path()
    digest = Path(str(path) + ".sha256")
    path.parent.mkdir(parents=True, mode=0o700)
    path.parent.parent.chmod(0o700)
    other = _compiled(tmp_path, TINY % 5)                      # a working library, but not this build's
    if damage == "garbage":
        path.write_bytes(b"\x7fELF not really")
    elif damage == "no digest (an old build)":
        path.write_bytes(other)
    elif damage == "digest mismatch":
        path.write_bytes(other)
        digest.write_text(f"{hashlib.sha256(b'another build').hexdigest()}  {path.name}\n")
    elif damage == "symlink":
        (tmp_path / "elsewhere.so").write_bytes(other)
        path.symlink_to(tmp_path / "elsewhere.so")
    else:
        data = b"\x7fELF not really" if "ctypes" in damage else _compiled(tmp_path, "int lt_other(void) { return 5; }\n")
        path.write_bytes(data)
        digest.write_text(f"{hashlib.sha256(data).hexdigest()}  {path.name}\n")

    with caplog.at_level(logging.INFO, logger="leantune"):
        built = lib.get()
    assert built is not None, lib.unavailable_reason()
    assert built.lt_answer() == 7
    assert not path.is_symlink()
    assert digest.read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
    rebuilt = [r.getMessage() for r in caplog.records if r.getMessage().endswith("; rebuilding it")]
    assert len(rebuilt) == 1 and rebuilt[0].startswith(str(path)), rebuilt
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@needs_cc
def test_a_rebuild_that_fails_too_leaves_the_library_unavailable_with_the_reason(tmp_path, cache, caplog):
    lib = _tiny(tmp_path, code="int lt_answer(void) { return }\n")          # does not compile
    path = lib.library_path()
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING, logger="leantune"):
        assert lib.get() is None
        assert lib.get() is None
    reason = lib.unavailable_reason()
    assert reason.startswith(f"tiny.c did not compile with {native.compiler()} (exit 1: ")
    assert reason.endswith("); the slower torch-op path is used")
    assert [r.getMessage() for r in caplog.records] == [reason + " (the test's note)"]


def test_the_slower_path_is_said_once_also_without_a_compiler(tmp_path, cache, monkeypatch, caplog):
    """With the real host kernels' library object: one warning for any number of calls, naming the
    reason and what the torch-op path means for a user comparing runs."""
    empty = tmp_path / "no-compilers"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    real = host_kernels._LIBRARY
    lib = native.NativeLibrary(real.source, real.declare, real.extra_flags, real.note)
    with caplog.at_level(logging.INFO, logger="leantune"):
        for _ in range(3):
            assert lib.get() is None
        lib.unavailable_reason()
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [(logging.WARNING, "host_kernels.c cannot be built: no C compiler on PATH ($CC, cc, gcc); the "
                     "slower torch-op path is used (the torch-op step's results differ from the kernels' by up to "
                     "about 1.2e-4 per tensor, so runs with and without the kernels are close, not bitwise equal)")]


def test_kernels_off_by_choice_is_said_at_info_level_only(tmp_path, cache, monkeypatch, caplog):
    monkeypatch.setenv("LEANTUNE_HOST_KERNELS", "0")
    lib = _tiny(tmp_path)
    with caplog.at_level(logging.INFO, logger="leantune"):
        assert lib.get() is None
        assert lib.get() is None
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "LEANTUNE_HOST_KERNELS=0: tiny.c is not used; the slower torch-op path is used")]


@needs_cc
def test_the_real_host_kernels_replace_a_garbage_file_at_their_name(tmp_path, cache):
    """The real library object's source, flags and declarations (one build, ~1-10 s)."""
    real = host_kernels._LIBRARY
    lib = native.NativeLibrary(real.source, real.declare, real.extra_flags, real.note)
    path = lib.library_path()
    path.parent.mkdir(parents=True, mode=0o700)
    path.write_bytes(b"garbage with the right name")
    built = lib.get()
    assert built is not None, lib.unavailable_reason()
    values = (ctypes.c_float * 3)(1.0, 2.0, 3.0)
    assert built.lt_sumsq(0, 3, ctypes.addressof(values), 0) == 14.0
    assert Path(str(path) + ".sha256").read_text().split()[0] == hashlib.sha256(path.read_bytes()).hexdigest()
