#!/bin/sh
# Debian's nginx and its stream module, when missing, for the tests that run a real
# nginx. Never fails the build: without apt or root the nginx tests skip and say why.
set -u
nginx=$(command -v nginx || echo /usr/sbin/nginx)
need=""
if [ ! -x "$nginx" ]; then
    need="nginx libnginx-mod-stream"
elif "$nginx" -V 2>&1 | grep -q -- "--with-stream=dynamic" &&
    [ ! -e /usr/lib/nginx/modules/ngx_stream_module.so ]; then
    need="libnginx-mod-stream"
fi
[ -z "$need" ] && exit 0

warn() { echo "warning: could not install $need ($1); the nginx tests will be skipped" >&2; exit 0; }
command -v apt-get >/dev/null 2>&1 || warn "no apt-get"
sudo=""
if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then sudo="sudo -n"; else warn "not root"; fi
fi
echo "installing $need"
export DEBIAN_FRONTEND=noninteractive
install() { $sudo apt-get install -y -q --no-install-recommends $need >/dev/null; }
install || { $sudo apt-get update -q >/dev/null && install; } || warn "apt-get failed"
