#!/usr/bin/env bash
# The offline kit for a TPU host without a package index (docs/install-tpu.md): that host
# brings Python 3.11 and its JAX stack (jax, jaxlib, libtpu, NumPy); the kit brings the rest.
#
#   make tpu-kit                               # after `make setup`; the test tools included
#   devtools/tpu_kit.sh [EXTRA_DIST ...]       # the same, with the extras you name
#
# It writes .tpu-kit/ at the project root:
#   wheels/            CPython 3.11 x86-64 wheels of what weightsync needs at run time (and of
#                      the extras), at the versions this venv holds, minus the host's JAX stack
#   requirements.txt   those pins
#   native/            the C++ shim this venv's `make setup` built
#   activate           `source .tpu-kit/activate` on the host, from the project root
# Carry .tpu-kit/ to the host beside the project (it is gitignored).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${VENV:-.venv}
kit=.tpu-kit
# The host's own JAX stack: its builds match its libtpu, so the kit never shadows them.
host_dists=(jax jaxlib libtpu numpy ml-dtypes scipy opt-einsum)
# The host's glibc is 2.36; the newest manylinux tag first.
platforms=()
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform linux_x86_64 --platform any)

die() { echo "tpu-kit: $*" >&2; exit 1; }
[ -x "$venv/bin/python" ] || die "no $venv: run 'make setup' first (the kit takes its versions from it)"
shims=(weightsync/_native/libweightsync_native.*.so)
[ -f "${shims[0]}" ] || die "the native shim is not built: 'make native'"

rm -rf "$kit"
mkdir -p "$kit/wheels" "$kit/native"
"$venv/bin/python" devtools/dist_requires.py --closure weightsync "$@" --except "${host_dists[@]}" \
  | grep -v '^weightsync==' > "$kit/requirements.txt"
echo "tpu-kit: $(wc -l < "$kit/requirements.txt") distributions: $(tr '\n' ' ' < "$kit/requirements.txt")"
"$venv/bin/python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
  --implementation cp "${platforms[@]}" -d "$kit/wheels" -r "$kit/requirements.txt"
cp "${shims[@]}" "$kit/native/"

cat > "$kit/activate" <<'SH'
# source .tpu-kit/activate   (bash, from the project root, on the TPU host)
# Installs the kit's wheels once into $WEIGHTSYNC_KIT_SITE (default /tmp/weightsync-kit), puts
# them and the project on PYTHONPATH after the host's own entries (its JAX stays first), and
# puts the kit's shim into weightsync/_native/. WEIGHTSYNC_KIT names the kit: the tests that
# check this machine's own build and environment skip under it.
_ws_kit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
_ws_root=$(dirname "$_ws_kit")
_ws_site=${WEIGHTSYNC_KIT_SITE:-/tmp/weightsync-kit}
if ! cmp -s "$_ws_kit/requirements.txt" "$_ws_site/.kit-requirements.txt"; then
  rm -rf "$_ws_site"
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated --quiet --no-index --no-deps --no-compile \
    --target "$_ws_site" "$_ws_kit"/wheels/*.whl || return 1
  cp "$_ws_kit/requirements.txt" "$_ws_site/.kit-requirements.txt"
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_ws_site:$_ws_root" PATH="$PATH:$_ws_site/bin" PYTHONUNBUFFERED=1
export WEIGHTSYNC_KIT="$_ws_kit"
cp "$_ws_kit"/native/*.so "$_ws_root/weightsync/_native/"
unset _ws_kit _ws_root _ws_site
SH
echo "tpu-kit: $(du -sh "$kit" | cut -f1) in $kit ($(ls "$kit/wheels" | wc -l) wheels)"
