#!/usr/bin/env bash
# Makes a throwaway CA and one peer certificate for 127.0.0.1/localhost in DIR (for local clusters
# and tests of peer TLS): ca.pem, node.pem, node.key. Needs the openssl CLI.
set -euo pipefail
dir="${1:?usage: make-test-certs.sh DIR}"
mkdir -p "$dir"
cd "$dir"
cat > ext.cnf <<'CNF'
subjectAltName=IP:127.0.0.1,DNS:localhost
extendedKeyUsage=serverAuth,clientAuth
basicConstraints=CA:FALSE
CNF
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout ca.key -out ca.pem -days 1 -subj /CN=epp-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout node.key -out node.csr -subj /CN=localhost 2>/dev/null
openssl x509 -req -in node.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
  -out node.pem -days 1 -extfile ext.cnf 2>/dev/null
