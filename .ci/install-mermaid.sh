#!/usr/bin/env bash
# Install the Mermaid parser used by tests/states/test_statechart_doc.py (idempotent).
#
# Installs the `mermaid` npm package and `jsdom` (mermaid's sanitiser, DOMPurify, needs a DOM
# window), both pinned, into .ci/node/ (git-ignored) next to this script.
# tests/states/mermaid_parse.mjs imports them from there and calls mermaid's own parser under
# plain node: no browser, no puppeteer. When the pinned versions are present it does nothing.
#
# Needs node >= 20 and npm, and the npm registry once. Override the pins with MERMAID_VERSION /
# JSDOM_VERSION (mermaid 12 needs node >= 22.12; jsdom 26 supports node >= 18).
set -euo pipefail

MERMAID_VERSION="${MERMAID_VERSION:-11.17.2}"
JSDOM_VERSION="${JSDOM_VERSION:-26.1.0}"
prefix="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/node"

version_of() {  # the installed version of package $1 in $prefix, or nothing
    node -p "try { require('$prefix/node_modules/$1/package.json').version } catch { '' }" 2>/dev/null || true
}

if [[ "$(version_of mermaid)" == "$MERMAID_VERSION" && "$(version_of jsdom)" == "$JSDOM_VERSION" ]]; then
    echo "mermaid $MERMAID_VERSION and jsdom $JSDOM_VERSION already installed in $prefix"
    exit 0
fi

mkdir -p "$prefix"
# --ignore-scripts: neither package needs an install script.
npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --save-exact \
    "mermaid@$MERMAID_VERSION" "jsdom@$JSDOM_VERSION"
echo "installed mermaid $(version_of mermaid) and jsdom $(version_of jsdom) in $prefix"
