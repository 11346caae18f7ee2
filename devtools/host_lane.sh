#!/usr/bin/env bash
# The TPU host's conditions on a Linux machine without one (`make test-host`, CI after
# `make test`): the tests the host's `devtools/tpu_checks.sh suite` runs, under the
# conditions that fail tests there and nowhere else:
#
#   the kit's layout   the venv's base interpreter, not the venv: the dependencies (the
#                      venv's site-packages) and the project on PYTHONPATH, as
#                      `.tpu-kit/activate` puts them; WEIGHTSYNC_KIT set as it sets it
#   no inet socket     a network namespace of its own (`unshare -n`): loopback down, unix
#                      sockets only
#   an ordinary user   nobody (uid and gid 65534, the host's own user), owning the copy
#   no .git            a copy of the tree (tracked and untracked files, the built shim),
#                      inside a folder that is a repository of its own: `git -C` in the
#                      copy answers for that one, as for a copy carried into a home
#                      directory under git
#   gVisor's /proc     WEIGHTSYNC_PROC_LACKS=gvisor: the readers of weightsync/host_memory.py
#                      read no VmHWM, no RssAnon/RssFile/RssShmem, no fault counts, no
#                      clear_refs (what the host's sandbox lacks)
#
# It runs, in a copy under /tmp, the unit tests that start processes or read what the host
# lacks (HOST_LANE_UNIT_ALL=1: all of tests/unit, as the host does, ~15 min here) and the
# unix-only process tests, with `tpu_checks.sh suite`'s timeouts, and ends with one line:
# `host lane: N failed, M passed, K skipped in S s`; its status is 1 when a test failed.
# Run as root (the namespaces and the user switch); where the interpreter lies in a folder
# the user may not enter (/root/.pyenv), a mount namespace of its own shows it there.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv=${VENV:-.venv}
user=65534  # nobody, and its group
die() { echo "host lane: $*" >&2; exit 2; }
[ "$(id -u)" = 0 ] || die "run as root: it makes a network namespace and runs the tests as $user"
[ -x "$venv/bin/python" ] || die "no $venv: run 'make setup' first"
for tool in unshare setpriv git; do command -v "$tool" > /dev/null || die "$tool is missing"; done
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
py=$("$venv/bin/python" -c 'import sys; print(sys._base_executable)')
prefix=$("$venv/bin/python" -c 'import sys; print(sys.base_prefix)')

# the unit tests that start a process or read a fact the host lacks (/proc, getrusage,
# git, sockets); every other unit test runs the same here as in `make test`
unit_tests() {
  if [ -n "${HOST_LANE_UNIT:-}" ]; then echo "$HOST_LANE_UNIT"; return; fi  # those named (a trial)
  if [ "${HOST_LANE_UNIT_ALL:-}" = 1 ]; then echo tests/unit; return; fi
  grep -l -E 'subprocess|sys\.executable|multiprocessing|os\.fork|/proc/|getrusage|RUSAGE|host_memory|without_inet|inet_refused|"git"' \
    tests/unit/test_*.py
}

lane=$(mktemp -d /tmp/ws-host-lane.XXXXXX)
trap 'rm -rf "$lane"' EXIT
mkdir -p "$lane/tree" "$lane/home" "$lane/bin"
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2> /dev/null \
  | tar -xf - -C "$lane/tree"
cp weightsync/_native/*.so "$lane/tree/weightsync/_native/"  # as the kit's activate does
git init -q "$lane"
ln -s "$py" "$lane/bin/python3"
chown -R "$user:$user" "$lane"
chmod 755 "$lane"

# Where the user may not enter a folder above the interpreter or the venv's site-packages
# (/root/.pyenv, a checkout under /root), this namespace shows them there alone: each bound
# aside, an empty tmpfs over the closed folder, each bound back at its own path.
blocked_above() {  # the topmost folder above $1 the user may not enter, or nothing
  local dir=$1 found=""
  while [ "$dir" != / ]; do
    setpriv --reuid="$user" --regid="$user" --clear-groups test -x "$dir" || found=$dir
    dir=$(dirname "$dir")
  done
  echo "$found"
}
aside="" over="" back=""
i=0
for path in "$prefix" "$site"; do
  closed=$(blocked_above "$path")
  [ -n "$closed" ] || continue
  i=$((i + 1))
  mkdir "$lane/aside-$i"
  aside+="mount --bind '$path' '$lane/aside-$i' && "
  [[ " $over " == *" '$closed' "* ]] || over+="mount -t tmpfs -o mode=755 tmpfs '$closed' && "
  back+="mkdir -p '$path' && mount --bind '$lane/aside-$i' '$path' && "
done
expose="$aside$over$back:"

env_args=(env -i PATH="$lane/bin:/usr/local/bin:/usr/bin:/bin" HOME="$lane/home" LANG=C.UTF-8
  PYTHONPATH="$site:$lane/tree" PYTHONUNBUFFERED=1 WEIGHTSYNC_KIT="$lane/tree/.tpu-kit" WEIGHTSYNC_PROC_LACKS=gvisor)
in_lane() {  # in_lane COMMAND...: runs it in the copy, under the host's conditions
  unshare --net --mount --propagation private sh -c "$expose && exec \"\$@\"" lane \
    setpriv --reuid="$user" --regid="$user" --clear-groups --inh-caps=-all \
    "${env_args[@]}" sh -c 'cd "$0" && exec "$@"' "$lane/tree" "$@"
}
run_tests() {  # run_tests NAME PYTEST_ARGS...: pytest as the host runs it, its output in $lane/NAME.log
  local name=$1; shift
  echo "host lane: $name"
  in_lane python3 -m pytest -q -p no:cacheprovider "$@" | tee "$lane/$name.log" || true
}

# the conditions themselves, checked where the tests run: a lane that lost one would pass
# what the host fails
probe='
import os, sys
from pathlib import Path
from weightsync.addresses import inet_refused
from weightsync.host_memory import GVISOR_LACKS, lacks
facts = {"user": os.geteuid() != 0, "no venv": sys.prefix == sys.base_prefix, "no inet": bool(inet_refused()),
         "no .git": not Path(".git").exists(), "gVisor /proc": lacks() == GVISOR_LACKS,
         "deps on PYTHONPATH": __import__("grpc").__file__.startswith(os.environ["PYTHONPATH"].split(":")[0])}
words = {True: "yes", False: "NO"}
print("host lane: conditions:", ", ".join(f"{k} {words[v]}" for k, v in facts.items()))
sys.exit(0 if all(facts.values()) else 1)
'

t0=$SECONDS
in_lane python3 -c "$probe" || die "the lane lacks a condition of the host's"
# shellcheck disable=SC2046  # one word a file
run_tests unit --timeout 120 $(unit_tests)
run_tests unix-only --timeout 150 -m "tpu or unix_only" tests
line=$("$venv/bin/python" devtools/suite_verdict.py --name "host lane" "$lane/unit.log" "$lane/unix-only.log") && ok=1 || ok=0
echo "$line in $((SECONDS - t0)) s"
[ "$ok" = 1 ]
