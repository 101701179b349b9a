#!/usr/bin/env bash
# Build the docker sandbox image offline, without any registry:
#   sandboxes/python/build_local_image.sh [IMAGE]      (default agentrl-python:latest)
#
# It copies one Python of this machine (SANDBOX_PYTHON, default /usr/bin/python3, else the
# first python3 on PATH) into a minimal root filesystem: the interpreter, its standard
# library (without site-packages, tests, tkinter, idlelib), and the shared libraries that
# `ldd` lists for the interpreter and its extension modules. `docker import` turns that into
# an image (about 50 MB, a few seconds). The sandbox only needs `python3` on PATH and the
# mount points /work and /tmp (tmpfs at run time; the root is read-only): the docker backend
# sends its runner with every run.
# With a registry at hand, `docker build -t agentrl-python sandboxes/python` does the same
# from the Dockerfile next to this script.
set -euo pipefail
IMAGE=${1:-agentrl-python:latest}
PY=${SANDBOX_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x /usr/bin/python3 ]; then PY=/usr/bin/python3; else PY=$(command -v python3); fi
fi
command -v docker >/dev/null || { echo "build_local_image.sh: docker CLI not found" >&2; exit 1; }

ROOTFS=$(mktemp -d /tmp/agentrl-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

read -r PYBIN STDLIB DYNLOAD < <("$PY" -c '
import os, sys, sysconfig
print(os.path.realpath(sys.executable), sysconfig.get_path("stdlib"),
      os.path.join(sysconfig.get_path("platstdlib"), "lib-dynload"))')

copy() {  # copy a file to the same path inside the rootfs, following symlinks
  mkdir -p "$ROOTFS$(dirname "$1")"
  cp -L "$1" "$ROOTFS$1"
}

copy "$PYBIN"
mkdir -p "$ROOTFS$STDLIB"
tar -C "$STDLIB" --exclude=./site-packages --exclude=./dist-packages --exclude=./test \
    --exclude=./idlelib --exclude=./tkinter --exclude=./turtledemo --exclude=./ensurepip \
    --exclude=./lib2to3 --exclude='*/tests' -cf - . | tar -C "$ROOTFS$STDLIB" -xf -
if [ -d "$DYNLOAD" ] && [ ! -d "$ROOTFS$DYNLOAD" ]; then
  mkdir -p "$ROOTFS$DYNLOAD" && cp -a "$DYNLOAD/." "$ROOTFS$DYNLOAD/"
fi

# Shared libraries of the interpreter and of every extension module (and the loader).
{ ldd "$PYBIN"; find "$ROOTFS$STDLIB" "$ROOTFS$DYNLOAD" -name '*.so' 2>/dev/null \
    | sed "s|^$ROOTFS||" | while read -r so; do ldd "$so" 2>/dev/null || true; done; } \
  | grep -oE '/[^ ]+\.so[^ ]*' | sort -u | while read -r lib; do
      [ -e "$lib" ] && copy "$lib"
    done
# Keep the host's /lib -> usr/lib style symlinks so the loader path in the binary resolves.
for top in bin sbin lib lib32 lib64 libx32; do
  if [ -L "/$top" ] && [ ! -e "$ROOTFS/$top" ]; then ln -s "$(readlink "/$top")" "$ROOTFS/$top"; fi
done
mkdir -p "$ROOTFS/usr/bin" "$ROOTFS/usr/local/bin"
[ -e "$ROOTFS/usr/bin/python3" ] || ln -s "$PYBIN" "$ROOTFS/usr/bin/python3"
mkdir -p "$ROOTFS/work" "$ROOTFS/tmp" "$ROOTFS/etc" "$ROOTFS/proc" "$ROOTFS/dev" "$ROOTFS/sys"
chmod 1777 "$ROOTFS/work" "$ROOTFS/tmp"
echo "nobody:x:65534:65534:nobody:/work:/usr/sbin/nologin" > "$ROOTFS/etc/passwd"
echo "nogroup:x:65534:" > "$ROOTFS/etc/group"

tar --numeric-owner --owner=0 --group=0 -C "$ROOTFS" -cf - . \
  | docker import --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' --change 'ENV LANG=C.UTF-8' \
      --change 'WORKDIR /work' - "$IMAGE" >/dev/null
docker run --rm --network none "$IMAGE" python3 -I -c 'import json, subprocess, resource; print("ok")' >/dev/null \
  || { echo "build_local_image.sh: the image $IMAGE does not run python3" >&2; exit 1; }
echo "built $IMAGE from $PY ($(du -sh "$ROOTFS" | cut -f1))"
