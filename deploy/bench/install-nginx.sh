#!/bin/sh
# Installs nginx from the Debian/Ubuntu packages, for `go run ./cmd/benchproxy`
# to measure the router beside it (--nginx auto finds it on PATH or at
# /usr/sbin/nginx). The benchmark runs nginx with its own configuration and
# prefix directory; the package's service is not needed.
set -eu
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
	echo "nginx is installed: $(/usr/sbin/nginx -v 2>&1 || nginx -v 2>&1)"
	exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx-light || DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx
/usr/sbin/nginx -v
