#!/usr/bin/env bash
# Sourced by the installers that fetch from npm: installs npm (Debian's package, which brings
# node) when it is missing; fails when it cannot.
if ! command -v npm >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq npm >/dev/null
  else
    echo "npm is missing and apt-get is unavailable" >&2
    exit 1
  fi
fi
