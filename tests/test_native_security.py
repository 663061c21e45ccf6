"""What leantune/native.py loads: only a library this user built and recorded (issue 41).

A library's constructor runs with the loading user's rights, and the library's file name is computed
from public inputs, so a file another user could put there must never be loaded. The planted cases
run the planting as a second local user (nobody, uid 65534, through `subprocess`'s user/group) into
a shared mode-0777 folder, and the planted library's constructor writes a marker file: the marker
must not exist afterwards. Those cases need root (CI runs as root) and skip, saying so, elsewhere.

Most cases build a tiny C file of one function (about 0.1 s); one builds the real host kernels.
The simulated GPU's device guard library (memory/simulated.py) goes through the same machinery into
simulated_device/: its cases build a tiny C++ file in its place (a real build takes 3-6 s;
tests/test_simulated.py builds the real one), and call `simulated.enable()` in this process with
torch's backend renaming stopped right after the load (`_enable_up_to_the_load`), so nothing of the
process changes but a tiny library loaded.

The cache's folders: made 0700 wherever leantune makes them (the planner's cache too), also under
Ubuntu's umask 002; one of this user's own that is writable by group or others is tightened
(chmod go-w) and used, one of another user's or a symlink is refused.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

from leantune import native
from leantune.memory import simulated
from leantune.train import host_kernels

NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="planting as a second local user (nobody) needs root "
                                                         "to start a process as that user; CI runs as root")
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler on PATH ($CC, cc, gcc)")
needs_cxx = pytest.mark.skipif(simulated.find_compiler() is None, reason="no C++ compiler on PATH ($CXX, g++)")

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


def _plant(lib: native.NativeLibrary | None, tmp_path: Path, marker: Path,
           path: Path | None = None) -> tuple[Path, bytes]:
    """nobody puts a library at `lib`'s file name (or `path`), with its correct sha256 beside it (a
    planter can compute a digest as well as the build): only who owns and can write the files protects."""
    planted = _compiled(tmp_path, PLANTED, f'-DMARKER="{marker}"')
    path = path or lib.library_path()
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
        refused = root
    else:        # the root is this user's: tightened (0755) and used; host_kernels/ in it is nobody's
        root.mkdir()
        root.chmod(0o777)
        refused = root / "host_kernels"
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))
    marker = tmp_path / "constructor-ran"
    lib = _tiny(tmp_path)
    path, _ = _plant(lib, tmp_path, marker)
    assert os.stat(path).st_uid == NOBODY and os.stat(path.parent).st_uid == NOBODY

    with caplog.at_level(logging.INFO, logger="leantune"):
        got = lib.get()
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert got is None
    assert lib.unavailable_reason() == (f"{refused} is owned by another user (nobody, uid {NOBODY}): not loading "
                                        "libraries from it (set LEANTUNE_CACHE_DIR to a folder of your own); the "
                                        "slower torch-op path is used")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        lib.unavailable_reason() + " (the test's note)"]
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o777, "another user's folder was changed"
    assert stat.S_IMODE(root.stat().st_mode) == (0o777 if who_made_the_root == "nobody" else 0o755)


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
def test_a_folder_of_this_users_writable_by_group_or_others_is_tightened_and_used(tmp_path, cache, caplog, which,
                                                                                    mode, by):
    """Ubuntu's umask 002 makes folders 0775 (the planner's cache root, before it made them 0700):
    the folder is this user's, so it is made go-w and the kernels are used, said once at info level."""
    folder = cache / "host_kernels"
    folder.mkdir(parents=True, mode=0o700)
    unsafe = cache if which == "root" else folder
    unsafe.chmod(mode)
    lib = _tiny(tmp_path)

    with caplog.at_level(logging.INFO, logger="leantune"):
        built = lib.get()
        again = native.NativeLibrary(lib.source, _declare).get()        # a second load: nothing left to say
    assert built is not None, lib.unavailable_reason()
    assert built.lt_answer() == 7 and again.lt_answer() == 7
    assert stat.S_IMODE(unsafe.stat().st_mode) == mode & ~0o022
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, f"{unsafe} was writable by {by} (mode {mode:04o}): made it {mode & ~0o022:04o} (chmod go-w), "
                       "since leantune loads libraries only from folders only you can write")]


@needs_cc
def test_a_sticky_shared_folder_of_this_users_is_refused_not_tightened(tmp_path, cache):
    """LEANTUNE_CACHE_DIR=/tmp run as root: /tmp is this user's, but mode 1777 means shared on
    purpose (others' files belong there); chmod-ing it would break every other user."""
    cache.mkdir()
    cache.chmod(0o1777)
    lib = _tiny(tmp_path)

    assert lib.get() is None
    assert lib.unavailable_reason() == (f"{cache} is writable by group and others (mode 1777): not loading libraries "
                                        f"from it (chmod go-w {cache}, or set LEANTUNE_CACHE_DIR to a folder only you "
                                        "can write); the slower torch-op path is used")
    assert stat.S_IMODE(cache.stat().st_mode) == 0o1777 and list(cache.iterdir()) == []


@as_root
@needs_cc
@pytest.mark.parametrize("which", ["root", "host_kernels"])
def test_a_group_writable_folder_of_another_user_is_refused_and_left_as_it_is(tmp_path, shared, monkeypatch, which):
    """Tightening is for this user's own folders only: nobody's 0775 folder is refused, not chmod-ed,
    and nothing is built in it."""
    root = shared / "cache"
    if which == "root":
        _as_nobody('umask 002; mkdir "$1"', str(root))
        refused = root
    else:
        root.mkdir(mode=0o700)
        root.chmod(0o777)                 # open while nobody makes host_kernels/, then private again
        refused = root / "host_kernels"
        _as_nobody('umask 002; mkdir "$1"', str(refused))
        root.chmod(0o700)
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))
    lib = _tiny(tmp_path)

    assert lib.get() is None
    assert lib.unavailable_reason() == (f"{refused} is owned by another user (nobody, uid {NOBODY}): not loading "
                                        "libraries from it (set LEANTUNE_CACHE_DIR to a folder of your own); the "
                                        "slower torch-op path is used")
    assert stat.S_IMODE(refused.stat().st_mode) == 0o775 and refused.stat().st_uid == NOBODY
    assert not lib.library_path().exists()


@needs_cc
@pytest.mark.parametrize("link", ["host_kernels to a private folder", "the root to a group-writable folder"])
def test_a_symlinked_folder_is_refused_and_not_tightened_through_the_link(tmp_path, cache, link):
    """host_kernels/ is leantune's own folder: a symlink there is someone's doing, refused wherever
    it points. The root may be a link the user made (a cache on another disk): followed and checked,
    but a group-writable folder behind it is refused, never chmod-ed through the link."""
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    if link.startswith("host_kernels"):
        cache.mkdir(mode=0o700)
        (cache / "host_kernels").symlink_to(target)
        expect = (f"{cache / 'host_kernels'} is a symbolic link: not loading libraries from it (remove it, and "
                  "leantune makes its own folder)")
    else:
        target.chmod(0o775)
        cache.symlink_to(target)
        expect = (f"{cache} is writable by group (mode 0775): not loading libraries from it (chmod go-w {cache}, or "
                  "set LEANTUNE_CACHE_DIR to a folder only you can write)")
    lib = _tiny(tmp_path)

    assert lib.get() is None
    assert lib.unavailable_reason() == expect + "; the slower torch-op path is used"
    assert list(target.iterdir()) == [], "something was built behind the link"
    assert stat.S_IMODE(target.stat().st_mode) == (0o700 if link.startswith("host_kernels") else 0o775)


@pytest.fixture
def umask_002():
    old = os.umask(0o002)
    yield
    os.umask(old)


@needs_cc
def test_under_umask_002_every_folder_the_kernels_make_is_0700(tmp_path, monkeypatch, umask_002):
    """The cache root, host_kernels/ and every missing folder above the root (os.makedirs made those
    0775: a folder another group member could swap the cache root in)."""
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(tmp_path / "home" / ".cache" / "leantune"))
    monkeypatch.delenv("LEANTUNE_HOST_KERNELS", raising=False)
    lib = _tiny(tmp_path)
    assert lib.get().lt_answer() == 7
    made = [tmp_path / "home", tmp_path / "home" / ".cache", tmp_path / "home" / ".cache" / "leantune",
            tmp_path / "home" / ".cache" / "leantune" / "host_kernels"]
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {str(p): "0o700" for p in made}


def _save_an_answer():
    from leantune.planner import answer_cache

    answer_cache.save_answer({"model": "flux-dev", "vram": "8GiB"},
                             {"stdout": "", "stderr": "", "rc": 0, "machine": {"describe": "test"}})
    return answer_cache.answer_path({"model": "flux-dev", "vram": "8GiB"})


def _save_a_calibration():
    from leantune.planner.corrections import Calibration, CalibrationStore

    store = CalibrationStore()
    store.put("key", Calibration.from_dict({}))
    return store.path


def _save_a_measurement():
    from leantune.planner import spec_cache
    from leantune.planner.workload import Workload

    class Measured:
        def to_dict(self):
            return {}

    spec_cache.save_measured("flux-dev", Workload(), Measured())
    return spec_cache.cache_path("flux-dev", Workload())


PLANNER_WRITES = {"a kept answer": _save_an_answer, "a calibration": _save_a_calibration,
                  "a measurement": _save_a_measurement}


@needs_cc
@pytest.mark.parametrize("first", list(PLANNER_WRITES))
def test_the_planners_cache_made_under_umask_002_is_0700_and_the_kernels_use_it(tmp_path, monkeypatch, caplog,
                                                                                umask_002, first):
    """The issue's follow-up: a first `leantune plan` made ~/.cache/leantune (and the folders above
    it) 0775 under Ubuntu's umask, and the kernels then refused it. Whichever of the planner's
    writes comes first makes the shared cache root, and each makes its folder 0700."""
    root = tmp_path / "home" / ".cache" / "leantune"
    monkeypatch.setenv("LEANTUNE_CACHE", str(root))             # the planner's name for the cache root
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))         # the kernels'
    monkeypatch.delenv("LEANTUNE_HOST_KERNELS", raising=False)
    written = [PLANNER_WRITES[first]()] + [write() for name, write in PLANNER_WRITES.items() if name != first]
    assert all(p.is_file() for p in written), written
    made = {tmp_path / "home", tmp_path / "home" / ".cache", root} | {p.parent for p in written}
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {str(p): "0o700" for p in made}

    lib = _tiny(tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="leantune"):
        assert lib.get() is not None, lib.unavailable_reason()
    assert not [r.getMessage() for r in caplog.records], "the kernels had something to say about the cache"


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


# -- the simulated GPU's device guard library (memory/simulated.py) ----------------------------------

class _Stopped(Exception):
    """Raised where enable() would rename torch's PrivateUse1 backend: after the library's load."""


def _enable_up_to_the_load(monkeypatch) -> None:
    """simulated.enable() in this process, stopped right after it loads the guard library: as if
    the simulated device were not set up yet (also after a test that set it up), and with torch's
    backend renaming (irreversible, process-wide) raising _Stopped instead."""
    def stop(*_args, **_kwargs):
        raise _Stopped

    monkeypatch.setattr(simulated, "_ready", False)
    monkeypatch.setattr(torch._C, "_get_privateuse1_backend_name", lambda: "privateuseone")
    monkeypatch.setattr(torch.utils, "rename_privateuse1_backend", stop)
    simulated.enable()


def _simulated_library_path(source: Path) -> Path:
    """Where the guard library of `source` is kept, from public inputs only (what a planter computes)."""
    cc = simulated.find_compiler()
    key = hashlib.sha256(source.read_bytes() + torch.__version__.encode() + cc.encode()).hexdigest()[:16]
    return simulated.cache_dir() / f"{source.stem}-{key}.so"


@as_root
@needs_cc
@needs_cxx
@pytest.mark.parametrize("who_made_the_root", ["this user, mode 0777", "nobody"])
def test_a_simulated_device_library_planted_by_another_user_is_never_loaded(tmp_path, shared, monkeypatch,
                                                                            who_made_the_root):
    """The same hole in the simulated device: nobody plants a library at the real guard library's
    name in simulated_device/ of a shared cache, with its digest. Neither build_library() nor
    enable() hands it on or loads it; both say which folder is refused and why."""
    root = shared / "cache"
    if who_made_the_root == "nobody":
        _as_nobody('mkdir "$1"', str(root))
        refused = root
    else:
        root.mkdir()
        root.chmod(0o777)
        refused = root / "simulated_device"
    monkeypatch.setenv("LEANTUNE_CACHE_DIR", str(root))
    marker = tmp_path / "constructor-ran"
    path = _simulated_library_path(simulated.SOURCE)
    _plant(None, tmp_path, marker, path)
    assert os.stat(path).st_uid == NOBODY and os.stat(path.parent).st_uid == NOBODY
    said = (f"{refused} is owned by another user (nobody, uid {NOBODY}): not loading libraries from it (set "
            "LEANTUNE_CACHE_DIR to a folder of your own); the simulated device cannot be set up")

    with pytest.raises((simulated.SimulatedDeviceUnavailable, _Stopped)) as enabled:     # _Stopped: it loaded one
        _enable_up_to_the_load(monkeypatch)
    assert not marker.exists(), "the planted library was loaded: its constructor ran"
    assert str(enabled.value) == said
    with pytest.raises(simulated.SimulatedDeviceUnavailable) as built:
        simulated.build_library()
    assert str(built.value) == said


# A stand-in for simulated_device.cpp (same file name, so the same library name): its constructor
# writes the path it was loaded from.
WHERE = """#include <dlfcn.h>
#include <cstdio>
static void here() {}
__attribute__((constructor)) static void loaded() {
    Dl_info info;
    if (dladdr((void *)&here, &info) && info.dli_fname) {
        std::FILE *f = std::fopen("%s", "w");
        if (f) { std::fputs(info.dli_fname, f); std::fclose(f); }
    }
}
extern "C" int lt_answer(void) { return 7; }
"""


@needs_cxx
@pytest.mark.parametrize("damage", ["none (a first build)", "garbage", "no digest (an old build)"])
def test_the_simulated_device_library_is_recorded_and_loaded_from_a_private_copy(tmp_path, cache, monkeypatch, caplog,
                                                                                damage):
    """build_library() records the library's digest in a 0700 simulated_device/, rebuilding a damaged
    file at its name once; enable() loads the checked bytes from a private copy (the loaded file
    is a mkstemp name, gone after the load), never the cache's file itself."""
    source = tmp_path / "simulated_device.cpp"
    marker = tmp_path / "loaded-from"
    source.write_text(WHERE % marker)
    monkeypatch.setattr(simulated, "SOURCE", source)
    path = _simulated_library_path(source)
    digest = Path(str(path) + ".sha256")
    if damage != "none (a first build)":
        path.parent.mkdir(parents=True, mode=0o700)
        path.parent.parent.chmod(0o700)
        path.write_bytes(b"\x7fELF not really" if damage == "garbage" else _compiled(tmp_path, TINY % 5))

    with caplog.at_level(logging.INFO, logger="leantune"):
        assert simulated.build_library() == path
    assert digest.read_text() == f"{hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name}\n"
    assert [oct(stat.S_IMODE(p.stat().st_mode)) for p in (cache, path.parent)] == ["0o700", "0o700"]
    assert path.stat().st_mode & 0o077 == 0
    rebuilt = [r.getMessage() for r in caplog.records if r.getMessage().endswith("; rebuilding it")]
    assert len(rebuilt) == (0 if damage.startswith("none") else 1), rebuilt

    with pytest.raises(_Stopped):
        _enable_up_to_the_load(monkeypatch)
    loaded = Path(marker.read_text())
    assert loaded.parent == path.parent and loaded.name.startswith(f".{path.name}.") and loaded.name.endswith(
        ".load.so"), f"loaded {loaded}, not a private copy of {path}"
    assert not loaded.exists()
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, digest.name], "a temporary was left"
