#!/usr/bin/env bash
# System programs the tests run against: a real Prometheus and Alertmanager (sink tests),
# Node.js with npm and kcat (tests/test_other_clients.py: a kafkajs client and kcat against the
# JSON Schemas) and Debian's chromium (tests/test_report_page.py: the report page in a real browser).
# Idempotent: does nothing when they are already on PATH. `make test` runs this before
# pytest; without them those tests skip with the reason.
set -euo pipefail

have() { command -v "$1" >/dev/null 2>&1; }

if have prometheus && { have prometheus-alertmanager || have alertmanager; } && have node && have npm \
        && have kcat && have chromium; then
    echo "setup-system: prometheus, alertmanager, node, kcat and chromium already installed"
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    if have sudo && sudo -n true 2>/dev/null; then
        SUDO=sudo
    else
        echo "setup-system: not root and no passwordless sudo; install them yourself:" >&2
        echo "    sudo apt-get update && sudo apt-get install -y prometheus prometheus-alertmanager nodejs npm kcat chromium" >&2
        exit 1
    fi
else
    SUDO=
fi

if ! have apt-get; then
    echo "setup-system: apt-get not found (not Debian/Ubuntu); install prometheus and alertmanager" \
         "from https://prometheus.io/download/ and put them on PATH" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
# Only what is missing (a Node.js from elsewhere conflicts with Debian's npm);
# --no-install-recommends: the exporters Debian recommends are not needed by the tests.
packages=()
have prometheus || packages+=(prometheus)
have prometheus-alertmanager || have alertmanager || packages+=(prometheus-alertmanager)
have node || packages+=(nodejs)
have npm || packages+=(npm)
have kcat || packages+=(kcat)
have chromium || packages+=(chromium)
$SUDO apt-get install -y --no-install-recommends "${packages[@]}"
# Debian's packages start system services where an init system runs; the tests start
# their own instances on free loopback ports, so leave the services as the admin wants.
echo "setup-system: installed $(prometheus --version 2>&1 | head -n1)"
