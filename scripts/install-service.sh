#!/bin/sh
# Install the systemd units with ExecStart pointing at this checkout's .venv, and
# example settings in /etc/morphling (existing files are kept). `make install-service`
# runs it; give a directory to stage everything there instead of / (packaging, tests).
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
root=${1:-}
units=$root/etc/systemd/system
conf=$root/etc/morphling
mkdir -p "$units" "$conf"
for unit in morphling-emulator.service morphling-device@.service; do
    sed "s|/opt/morphling|$here|g" "$here/scripts/$unit" > "$units/$unit"
    echo "installed $units/$unit"
done
for example in emulator.toml device-example.toml; do
    if [ ! -e "$conf/$example" ]; then
        cp "$here/scripts/$example" "$conf/$example"
        echo "installed $conf/$example"
    fi
done
if [ -z "$root" ]; then
    if ! id morphling >/dev/null 2>&1; then
        useradd --system --home-dir /var/lib/morphling --no-create-home \
            --shell /usr/sbin/nologin morphling
        echo "created the system user morphling"
    fi
    if [ -d /run/systemd/system ]; then
        systemctl daemon-reload
    fi
    echo "next: systemctl enable --now morphling-emulator"
    echo "      (a board: copy device-example.toml to device-NAME.toml, then"
    echo "       systemctl enable --now morphling-device@NAME)"
fi
