"""hnclip_jax.hostmem: finding tcmalloc, the HNCLIP_TCMALLOC setting, and the one-time re-exec with LD_PRELOAD."""
import json
import os
import subprocess
import sys

import pytest

from hnclip_jax import hostmem

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_find_tcmalloc_searches_the_given_dirs(tmp_path):
  assert hostmem.find_tcmalloc([str(tmp_path)]) is None
  (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
  assert hostmem.find_tcmalloc([str(tmp_path)]) == str(tmp_path / "libtcmalloc.so.4")
  (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal build is preferred
  assert hostmem.find_tcmalloc([str(tmp_path / "missing"), str(tmp_path)]) == str(tmp_path / "libtcmalloc_minimal.so.4")


def test_preload_target_reads_the_setting(tmp_path, monkeypatch):
  lib = tmp_path / "libfake.so"
  lib.write_bytes(b"")
  for off in ("0", "off", "False", " no ", ""):
    assert hostmem.preload_target({hostmem.ENV: off}) is None
  assert hostmem.preload_target({}) is None  # opt-in: nothing unless asked
  assert hostmem.preload_target({hostmem.ENV: str(lib)}) == str(lib)
  with pytest.raises(ValueError, match=r"HNCLIP_TCMALLOC='/no/such/libtcmalloc.so'.*no such file"):
    hostmem.preload_target({hostmem.ENV: "/no/such/libtcmalloc.so"})
  # "auto" and "1" search the library directories: one with a tcmalloc, one without.
  empty, installed = tmp_path / "empty", tmp_path / "lib"
  empty.mkdir()
  installed.mkdir()
  (installed / "libtcmalloc_minimal.so.4").write_bytes(b"")
  monkeypatch.setattr(hostmem, "_DIRS", (str(empty), str(installed)))
  assert hostmem.preload_target({hostmem.ENV: "auto"}) == str(installed / "libtcmalloc_minimal.so.4")
  assert hostmem.preload_target({hostmem.ENV: "1"}) == str(installed / "libtcmalloc_minimal.so.4")
  monkeypatch.setattr(hostmem, "_DIRS", (str(empty),))
  assert hostmem.preload_target({hostmem.ENV: "auto"}) is None
  with pytest.raises(ValueError, match=r"HNCLIP_TCMALLOC='1' asks for tcmalloc but none is installed"):
    hostmem.preload_target({hostmem.ENV: "1"})


def _a_preloadable_library():
  """tcmalloc when installed (.ci/run installs it); otherwise any real shared object that python does not map on
  its own, to check the re-exec mechanics."""
  found = hostmem.find_tcmalloc()
  if found:
    return found
  # Not _lzma or _bz2: shutil (imported by subprocess, pdb, ...) maps them in every probe. Found without importing.
  import importlib.util
  for name in ("_sqlite3", "_curses", "_dbm", "_gdbm"):
    spec = importlib.util.find_spec(name)
    if spec and spec.origin and spec.origin.endswith(".so"):
      return spec.origin
  pytest.fail("no tcmalloc and none of _sqlite3/_curses/_dbm/_gdbm as a shared object to check the re-exec with; "
              "install libtcmalloc-minimal4 (.ci/run does)")


PROBE = r"""
import json, os, sys
sys.path.insert(0, {root!r})
print("start", flush=True)
from hnclip_jax import hostmem
hostmem.use_tcmalloc()
maps = open("/proc/self/maps").read()
import subprocess
child = subprocess.run([sys.executable, "-c", "import os, json; print(json.dumps(dict(os.environ)))"],
                       capture_output=True, text=True).stdout
print(json.dumps({{"argv": sys.argv[1:], "preload": os.environ.get("LD_PRELOAD", ""),
                  "mapped": os.path.realpath({lib!r}) in maps, "allocator": hostmem.host_allocator(),
                  "child_env": json.loads(child)}}))
"""


def _probe(tmp_path, setting, lib, how="script", preload=""):
  script = tmp_path / "probe.py"
  script.write_text(PROBE.format(root=ROOT, lib=lib))
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_HNCLIP_TCMALLOC_REEXEC", hostmem.ENV)}
  if setting is not None:
    env[hostmem.ENV] = setting
  if preload:
    env["LD_PRELOAD"] = preload
  args, stdin = {"script": ([str(script), "a b", "--flag=1"], None),
                 "stdin": (["-", "a b", "--flag=1"], script.read_text()),
                 "interactive": (["-i", str(script), "a b", "--flag=1"], ""),
                 "pdb": (["-m", "pdb", str(script), "a b", "--flag=1"], "continue\nquit\n")}[how]
  out = subprocess.run([sys.executable, "-u", *args], env=env, capture_output=True, text=True, timeout=60,
                       input=stdin)
  assert out.returncode == 0, out.stderr
  lines = [line for line in out.stdout.splitlines()]
  info = next(json.loads(line[line.index("{"):]) for line in lines if '"argv"' in line)
  return sum(line.endswith("start") for line in lines), info, out.stderr


def test_use_tcmalloc_reexecs_once_with_the_library_preloaded(tmp_path):
  lib = _a_preloadable_library()
  starts, info, _ = _probe(tmp_path, lib, lib)
  assert starts == 2  # the program ran up to use_tcmalloc twice: once before and once after the exec, not more
  assert info["argv"] == ["a b", "--flag=1"]  # interpreter options and arguments survive the exec
  assert info["mapped"]
  if "tcmalloc" in lib:
    assert "tcmalloc" in info["allocator"]
  # The preload and the marker are gone from the environment the program and its children see.
  assert info["preload"] == ""
  assert "LD_PRELOAD" not in info["child_env"] and "_HNCLIP_TCMALLOC_REEXEC" not in info["child_env"]


def test_a_users_own_preload_is_given_back_to_children(tmp_path):
  lib = _a_preloadable_library()
  import _bz2
  starts, info, _ = _probe(tmp_path, lib, lib, preload=_bz2.__file__)
  assert starts == 2 and info["mapped"]
  assert info["child_env"]["LD_PRELOAD"] == _bz2.__file__


@pytest.mark.parametrize("setting", [None, "0"])
def test_no_reexec_unless_asked(tmp_path, setting):
  lib = _a_preloadable_library()
  starts, info, _ = _probe(tmp_path, setting, lib)
  assert starts == 1 and info["preload"] == "" and not info["mapped"]
  assert info["allocator"] == "system malloc"


@pytest.mark.parametrize("how,reason", [("stdin", "read from stdin"), ("interactive", "interactive interpreter"),
                                        ("pdb", "under a debugger")])
def test_no_reexec_where_it_would_restart_the_session(tmp_path, how, reason):
  lib = _a_preloadable_library()
  starts, info, err = _probe(tmp_path, lib, lib, how=how)
  assert starts == 1 and not info["mapped"]  # ran once, to the end, in this process
  assert "HNCLIP_TCMALLOC ignored" in err and reason in err


def test_entry_point_rejects_a_missing_library_path(tmp_path):
  env = dict(os.environ, **{hostmem.ENV: str(tmp_path / "nope.so")})
  out = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--config", "configs/demo.py", "--workdir",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert out.returncode == 2
  assert out.stderr.strip() == (f"error: HNCLIP_TCMALLOC='{tmp_path / 'nope.so'}': no such file; give the path of a "
                                "tcmalloc shared library (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), "
                                "1, auto, or 0 to keep the system allocator")
