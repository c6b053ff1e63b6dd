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


def test_preload_target_reads_the_setting(tmp_path):
  lib = tmp_path / "libfake.so"
  lib.write_bytes(b"")
  for off in ("0", "off", "False", " no "):
    assert hostmem.preload_target({hostmem.ENV: off}) is None
  assert hostmem.preload_target({hostmem.ENV: str(lib)}) == str(lib)
  assert hostmem.preload_target({}) == hostmem.find_tcmalloc()
  assert hostmem.preload_target({hostmem.ENV: "auto"}) == hostmem.find_tcmalloc()
  with pytest.raises(ValueError, match=r"HNCLIP_TCMALLOC='/no/such/libtcmalloc.so'.*no such file"):
    hostmem.preload_target({hostmem.ENV: "/no/such/libtcmalloc.so"})


def _a_preloadable_library():
  """tcmalloc when installed (.ci/run installs it); otherwise any real shared object that python does not map on
  its own, to check the re-exec mechanics."""
  found = hostmem.find_tcmalloc()
  if found:
    return found
  import _lzma
  return _lzma.__file__


PROBE = r"""
import json, os, sys
sys.path.insert(0, {root!r})
print("start", flush=True)
from hnclip_jax import hostmem
hostmem.use_tcmalloc()
maps = open("/proc/self/maps").read()
print(json.dumps({{"argv": sys.argv[1:], "preload": os.environ.get("LD_PRELOAD", ""),
                  "mapped": os.path.realpath({lib!r}) in maps, "allocator": hostmem.host_allocator()}}))
"""


def _probe(tmp_path, setting, lib):
  script = tmp_path / "probe.py"
  script.write_text(PROBE.format(root=ROOT, lib=lib))
  env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "_HNCLIP_TCMALLOC_REEXEC")}
  env[hostmem.ENV] = setting
  out = subprocess.run([sys.executable, "-u", str(script), "a b", "--flag=1"], env=env, capture_output=True,
                       text=True, timeout=60)
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  return lines.count("start"), json.loads(lines[-1])


def test_use_tcmalloc_reexecs_once_with_the_library_preloaded(tmp_path):
  lib = _a_preloadable_library()
  starts, info = _probe(tmp_path, lib, lib)
  assert starts == 2  # the program ran up to use_tcmalloc twice: once before and once after the exec, not more
  assert info["argv"] == ["a b", "--flag=1"]  # interpreter options and arguments survive the exec
  assert info["preload"].split(":")[0] == lib
  assert info["mapped"]
  if "tcmalloc" in lib:
    assert "tcmalloc" in info["allocator"]


def test_use_tcmalloc_off_keeps_the_process(tmp_path):
  lib = _a_preloadable_library()
  starts, info = _probe(tmp_path, "0", lib)
  assert starts == 1 and info["preload"] == "" and not info["mapped"]
  assert info["allocator"] == "system malloc"


def test_entry_point_rejects_a_missing_library_path(tmp_path):
  env = dict(os.environ, **{hostmem.ENV: str(tmp_path / "nope.so")})
  out = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "--config", "configs/demo.py", "--workdir",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
  assert out.returncode == 2
  assert out.stderr.strip() == (f"error: HNCLIP_TCMALLOC='{tmp_path / 'nope.so'}': no such file; give the path of a "
                                "tcmalloc shared library (e.g. /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4), "
                                "'auto', or 0 to keep the system allocator")
