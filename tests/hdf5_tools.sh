#!/usr/bin/env bash
# Install Debian's hdf5-tools (h5ls, h5dump: HDF5 1.10 on Debian 12) for tests/test_checkpoint_faults.py,
# which checks that they read a real checkpoint's index.h5 (the format promise: any HDF5 tool reads the
# global view, not only the HDF5 2.0 inside PyPI's h5py).
#
#   sudo tests/hdf5_tools.sh      # exit 0: h5ls and h5dump are on PATH
#
# Idempotent and instant when they are installed. Any failure exits non-zero with the reason on
# stderr, which the test shows as its skip (or, under CI=true, failure) message.
set -euo pipefail

die() { echo "hdf5_tools.sh: $*" >&2; exit 1; }
command -v h5ls >/dev/null && command -v h5dump >/dev/null && exit 0
[ "$(id -u)" = 0 ] || die "h5ls/h5dump are missing and installing hdf5-tools needs root; run it with sudo"
command -v apt-get >/dev/null || die "h5ls/h5dump are missing and there is no apt-get to install hdf5-tools"
exec 9>/run/hpcpar-apt.lock
flock -w 300 9 || die "another installer has held /run/hpcpar-apt.lock for 300 s"
LOG=/tmp/hpcpar-hdf5-tools-apt.log
: >"$LOG"
install() { apt-get install -y -q --no-install-recommends -o DPkg::Lock::Timeout=120 hdf5-tools >>"$LOG" 2>&1; }
if ! install; then
    apt-get update -q >>"$LOG" 2>&1 || die "apt-get update failed (apt repositories unreachable?): $(tail -n 1 "$LOG")"
    install || die "apt-get install hdf5-tools failed: $(tail -n 1 "$LOG")"
fi
command -v h5ls >/dev/null && command -v h5dump >/dev/null || die "hdf5-tools is installed but h5ls/h5dump are not on PATH"
