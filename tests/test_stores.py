"""The storage layer (hnclip_jax/stores: one contract, a module per backend): the same operations behave the same on
the local disk and on a bucket (the GCS emulator, tests/gcs.py), a store registered from outside the package serves
every paths call, and no module outside the layer asks which store a path is on."""
from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re

import pytest

from hnclip_jax import paths, stores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(params=["local", "gcs"])
def base(request, tmp_path, monkeypatch):
  """A fresh directory on each built-in store."""
  if request.param == "local":
    return str(tmp_path / "store")
  emu = request.getfixturevalue("gcs")
  for k, v in emu.env.items():
    monkeypatch.setenv(k, v)
  return f"gs://bkt/{tmp_path.name}"


def test_each_store_keeps_the_contract(base, tmp_path):
  """Every operation of stores.Store through paths, checked the same way on both stores: whole-file writes, line
  appends (a torn last line gets a line of its own), listings, MD5s, a directory replaced whole, copies in and out,
  removal, and the single-writer lease."""
  d = paths.resolve(base, "test")
  paths.makedirs(d)
  f = paths.join(d, "a.txt")
  assert not paths.exists(f) and paths.listdir(d) == []
  paths.write_text(f, "one")
  paths.write_text(f, "two")  # replaced whole
  assert paths.read_text(f) == "two" and paths.isfile(f) and not paths.isdir(f)
  log = paths.join(d, "sub", "log.jsonl")
  paths.makedirs(paths.dirname(log))
  paths.append_line(log, b'{"a": 1}\n')
  paths.write_bytes(log, paths.read_bytes(log) + b'{"torn')  # a write cut off mid-line
  paths.append_line(log, b'{"a": 2}\n')
  assert paths.read_bytes(log) == b'{"a": 1}\n{"torn\n{"a": 2}\n'
  assert paths.listdir(d) == ["a.txt", "sub"] and paths.isdir(paths.join(d, "sub"))
  listed = paths.files(d)
  assert [x["rel"] for x in listed] == ["a.txt", "sub/log.jsonl"]
  assert listed[0]["md5"] == base64.b64encode(hashlib.md5(b"two").digest()).decode() and listed[0]["size"] == 3
  cut = paths.truncate(log, 9)  # in place where the store can; a bucket says it cannot
  assert cut == paths.opens_natively(log) and paths.read_bytes(log)[:9] == b'{"a": 1}\n'
  with paths.open_read(f) as r:
    assert r.read() == b"two"

  best = paths.join(d, "best")
  seen = []

  def fill(marker):
    def write(directory):
      paths.makedirs(directory)
      seen.append(paths.exists(paths.join(best, "done")))  # the old one is whole while the new one is written
      paths.write_text(paths.join(directory, "x"), marker)
      paths.write_text(paths.join(directory, "done"), marker)  # the completion marker last
    return write

  paths.replace_dir(best, fill("old"))
  paths.replace_dir(best, fill("new"))
  assert paths.read_text(paths.join(best, "done")) == "new" and paths.listdir(best) == ["done", "x"]
  assert seen[1] == paths.opens_natively(best)  # renamed over the old one, or written in place after removing it
  assert not any(n.startswith("best.") for n in paths.listdir(d))  # no temp or old copy left

  local = tmp_path / "up"
  (local / "deep").mkdir(parents=True)
  (local / "deep" / "f.bin").write_bytes(b"\x00" * 10)
  (local / "marker").write_text("m")
  paths.upload_tree(str(local), paths.join(d, "tree"), last=("marker",))
  with paths.local_copy(paths.join(d, "tree")) as copy:
    assert open(os.path.join(copy, "deep", "f.bin"), "rb").read() == b"\x00" * 10
  with paths.staged_dir(paths.join(d, "staged")) as out:
    with open(os.path.join(out, "s.txt"), "w") as w:
      w.write("s")
  assert paths.read_text(paths.join(d, "staged", "s.txt")) == "s"
  paths.move(paths.join(d, "a.txt"), paths.join(d, "b.txt"))
  assert not paths.exists(f) and paths.read_text(paths.join(d, "b.txt")) == "two"
  paths.check_writable(paths.join(d, "new"))
  assert paths.listdir(paths.join(d, "new")) == []  # the probe is gone

  lock = paths.join(d, ".lock")
  held = paths.lease(lock)
  with pytest.raises(stores.Held) as e:
    paths.lease(lock)  # the same process counts as another holder: the guard is per lease, not per pid
  assert str(os.getpid()) in str(e.value.holder.get("pid")) and e.value.detail
  assert held.lost is None
  held.release()
  paths.lease(lock).release()  # free again

  paths.rmtree(d)
  assert not paths.exists(d) and paths.listdir(d) == []
  paths.rmtree(d)  # nothing there: nothing to do


class MemStore(stores.Store):
  """A third store, from outside the package: objects in a dict (what docs/buckets.md "Another store" describes)."""
  schemes = ("mem",)
  native = False

  def __init__(self):
    self.objects = {}

  def resolve(self, path, flag):
    if not str(path).split("://", 1)[1].strip("/"):
      raise ValueError(f"{flag}={path} names nothing")
    return str(path).rstrip("/")

  def is_root(self, path):
    return "/" not in str(path).split("://", 1)[1]

  def root(self, path):
    return "mem://" + str(path).split("://", 1)[1].split("/")[0]

  def _under(self, path):
    return [k for k in self.objects if k.startswith(path.rstrip("/") + "/")]

  def exists(self, path):
    return path in self.objects or bool(self._under(path))

  def isdir(self, path):
    return bool(self._under(path))

  def listdir(self, path):
    return sorted({k[len(path.rstrip("/")) + 1:].split("/")[0] for k in self._under(path)})

  def read_bytes(self, path):
    if path not in self.objects:
      raise FileNotFoundError(path)
    return self.objects[path]

  def open_read(self, path, block_size):
    import io
    return io.BytesIO(self.read_bytes(path))

  def files(self, directory):
    return [{"path": k, "rel": k[len(directory.rstrip("/")) + 1:], "size": len(self.objects[k]),
             "md5": base64.b64encode(hashlib.md5(self.objects[k]).digest()).decode(), "generation": ""}
            for k in sorted(self._under(directory))]

  def makedirs(self, path):
    pass

  def write_bytes(self, path, data):
    self.objects[path] = bytes(data)

  def append_line(self, path, line):
    old = self.objects.get(path, b"")
    self.objects[path] = old + (b"\n" if old and not old.endswith(b"\n") else b"") + line

  def put_file(self, local, path):
    with open(local, "rb") as f:
      self.objects[path] = f.read()

  def remove(self, path):
    del self.objects[path]

  def rmtree(self, path):
    for k in self._under(path) + ([path] if path in self.objects else []):
      del self.objects[k]

  def move(self, src, dst):
    for k in self._under(src) + ([src] if src in self.objects else []):
      self.objects[dst + k[len(src):]] = self.objects.pop(k)

  def replace_dir(self, final, write):
    self.rmtree(final)
    write(final)

  def check_writable(self, directory):
    self.write_bytes(directory + "/.probe", b"x")
    self.remove(directory + "/.probe")

  def lease(self, path):
    if path in self.objects:
      raise stores.Held({"pid": self.objects[path].decode()}, f"holds {path}")
    self.objects[path] = str(os.getpid()).encode()
    store = self

    class _Lease(stores.Lease):
      def release(self):
        store.objects.pop(path, None)
    return _Lease()


@contextlib.contextmanager
def registered(store):
  before = dict(stores._STORES)
  stores.register(store)
  try:
    yield store
  finally:
    stores._STORES.clear()
    stores._STORES.update(before)


def test_a_store_registered_from_outside_serves_every_paths_call(tmp_path):
  """One module (here a class) and one register() call: paths resolves, reads, writes, stages and leases mem:// with
  no change to the package; an unregistered scheme is refused naming the ones there are."""
  with pytest.raises(ValueError, match=r"--workdir=mem://x/run: nothing here opens mem:// URLs; use a local path or "
                                       r"gs://BUCKET/PATH"):
    paths.resolve("mem://x/run", "--workdir")
  with registered(MemStore()) as mem:
    d = paths.resolve("mem://x/run/", "--workdir")
    assert d == "mem://x/run" and paths.root(d) == "mem://x" and not paths.is_root(d) and paths.is_root("mem://x")
    assert not paths.opens_natively(d)
    paths.write_text(paths.join(d, "model.json"), "{}")
    paths.append_line(paths.join(d, "metrics.jsonl"), b"{}\n")
    with paths.staged_dir(paths.join(d, "tokenizer")) as local:  # a library that writes local files only
      open(os.path.join(local, "vocab.txt"), "w").write("a b")
    with paths.local_copy(paths.join(d, "tokenizer")) as local:  # ... and one that reads them
      assert open(os.path.join(local, "vocab.txt")).read() == "a b"
    assert paths.listdir(d) == ["metrics.jsonl", "model.json", "tokenizer"]
    from hnclip_jax.workdir import Workdir
    wd = Workdir("mem://x/run")
    assert wd.best == "mem://x/run/best" and paths.exists(wd.model_json)
    from hnclip_jax import preemption
    lock = preemption.WorkdirLock(wd)
    with pytest.raises(ValueError, match=rf"another train.py \(pid {os.getpid()}\) holds mem://x/run/.lock, or use "):
      preemption.WorkdirLock(wd)
    lock.release()
    assert not paths.exists(wd.lock)
    assert set(mem.objects) == {"mem://x/run/model.json", "mem://x/run/metrics.jsonl",
                                "mem://x/run/tokenizer/vocab.txt"}
  with pytest.raises(ValueError, match="nothing here opens mem://"):
    paths.exists("mem://x/run")


SCHEME_TEST = re.compile(r"""is_url\(|["']://["']|startswith\(\s*["']gs|["']gs://["']\s*\+|split\(["']://""")


def test_no_module_outside_the_storage_layer_asks_which_store_a_path_is_on():
  """The scheme of a path is looked at in hnclip_jax/stores/ only (paths.py and storage.py hand every call to a
  store): a grep of the package, train.py and eval.py finds no scheme test anywhere else."""
  found = []
  for d, _, names in os.walk(os.path.join(ROOT, "hnclip_jax")):
    for name in names:
      full = os.path.join(d, name)
      rel = os.path.relpath(full, ROOT)
      if not name.endswith(".py") or rel.startswith(os.path.join("hnclip_jax", "stores")):
        continue
      found += [f"{rel}:{i}: {line.strip()}" for i, line in enumerate(open(full), 1) if SCHEME_TEST.search(line)]
  for script in ("train.py", "eval.py"):
    found += [f"{script}:{i}" for i, line in enumerate(open(os.path.join(ROOT, script)), 1) if SCHEME_TEST.search(line)]
  assert not found, found
  assert SCHEME_TEST.search('if paths.is_url(workdir):') and SCHEME_TEST.search('x.split("://", 1)')  # it can find


@pytest.mark.parametrize("port", ["40312", "40499", "44010"])
def test_a_bucket_error_is_named_by_its_kind_never_by_digits_in_a_url(port, monkeypatch):
  # CI once read a dead emulator on port 40312 as "403: may not write". The status is a whole number or gcsfs' .code.
  from hnclip_jax.stores import gcs as gcs_store
  monkeypatch.setattr(gcs_store, "credentials_problem", lambda: None)
  store = stores.of("gs://bkt/run")
  dead = stores.Unreachable(f"Cloud Storage cannot be reached (Cannot connect to host 127.0.0.1:{port} ssl:default "
                            "[Connect call failed ('127.0.0.1', {port})])")
  assert "cannot be reached for gs://bkt" in store.describe_error("gs://bkt/run", dead)

  class HttpError(OSError):
    def __init__(self, code, text):
      super().__init__(text)
      self.code = code

  url = f"http://127.0.0.1:{port}/storage/v1/b/bkt/o"
  assert "may not write gs://bkt" in store.describe_error("gs://bkt/run", HttpError(403, f"Forbidden: {url}"))
  assert "does not exist" in store.describe_error("gs://bkt/run", HttpError(404, f"{url}"))
  assert "may not write gs://bkt" in store.describe_error("gs://bkt/run", RuntimeError(f"HTTP 403 for {url}"))
  assert "cannot be reached" in store.describe_error("gs://bkt/run", ConnectionError(f"cannot connect to {url}"))
