# source .tpu-kit/activate-vllm   (bash, from the project root, on the TPU host)
# The kit's `activate`, then vLLM's TPU engine (docs/install-tpu.md#vllms-tpu-engine): the
# wheels .tpu-kit/vllm/closure.txt names, installed once into $WEIGHTSYNC_VLLM_SITE (default
# /tmp/weightsync-vllm; again only when the closure changes) with pip --no-index --no-deps,
# `kit` rows from the kit, `host` rows from the host's wheel folders ($WEIGHTSYNC_HOST_WHEELS,
# colon-separated, default /opt/pypi/files:/opt/pypi-more/files:/opt/wheels). That folder goes
# last on PYTHONPATH: the host's JAX stack and the kit's wheels stay first.
# (devtools/tpu_vllm_kit.py copies this file into the kit; edit it in devtools/.)
_ws_vkit=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$_ws_vkit/activate" || return 1
_ws_vsite=${WEIGHTSYNC_VLLM_SITE:-/tmp/weightsync-vllm}
if ! cmp -s "$_ws_vkit/vllm/closure.txt" "$_ws_vsite/.kit-closure.txt"; then
  _ws_files=()
  _ws_missing=()
  IFS=: read -ra _ws_dirs <<< "${WEIGHTSYNC_HOST_WHEELS:-/opt/pypi/files:/opt/pypi-more/files:/opt/wheels}"
  while IFS=$'\t' read -r _ws_where _ws_wheel; do
    case $_ws_where in kit | host) ;; *) continue ;; esac
    _ws_found=
    if [ "$_ws_where" = kit ]; then
      [ -e "$_ws_vkit/vllm/wheels/$_ws_wheel" ] && _ws_found="$_ws_vkit/vllm/wheels/$_ws_wheel"
    else
      for _ws_dir in "${_ws_dirs[@]}"; do
        if [ -e "$_ws_dir/$_ws_wheel" ]; then _ws_found="$_ws_dir/$_ws_wheel"; break; fi
      done
    fi
    if [ -n "$_ws_found" ]; then _ws_files+=("$_ws_found"); else _ws_missing+=("$_ws_where:$_ws_wheel"); fi
  done < "$_ws_vkit/vllm/closure.txt"
  if [ "${#_ws_missing[@]}" != 0 ]; then
    echo "activate-vllm: ${#_ws_missing[@]} wheel(s) not found (kit: in $_ws_vkit/vllm/wheels; host: in ${_ws_dirs[*]}): ${_ws_missing[*]}" >&2
    unset _ws_vkit _ws_vsite _ws_files _ws_missing _ws_dirs _ws_where _ws_wheel _ws_found _ws_dir
    return 1
  fi
  echo "activate-vllm: installing ${#_ws_files[@]} wheels into $_ws_vsite" >&2
  rm -rf "$_ws_vsite"
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated --quiet --no-index --no-deps --no-compile \
    --disable-pip-version-check --target "$_ws_vsite" "${_ws_files[@]}" || return 1
  cp "$_ws_vkit/vllm/closure.txt" "$_ws_vsite/.kit-closure.txt"
fi
case ":${PYTHONPATH:-}:" in
  *":$_ws_vsite:"*) ;;
  *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$_ws_vsite" PATH="$PATH:$_ws_vsite/bin" ;;
esac
export WEIGHTSYNC_VLLM_SITE="$_ws_vsite"
unset _ws_vkit _ws_vsite _ws_files _ws_missing _ws_dirs _ws_where _ws_wheel _ws_found _ws_dir
