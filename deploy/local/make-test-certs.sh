#!/usr/bin/env bash
# Makes a throwaway CA and peer certificates in DIR (for local clusters and tests of peer TLS).
# Needs the openssl CLI.
#   ca.pem                      the CA
#   node-ID.pem, node-ID.key    node ID's certificate, for ID in 1..N (default 5): names
#                               epp-node-ID (the default `--peer-tls-identity epp-node-{id}`),
#                               localhost and 127.0.0.1
#   node.pem, node.key          a certificate for localhost/127.0.0.1 only: valid TLS, bound to
#                               no node id (refused by peers that bind identities)
# usage: make-test-certs.sh DIR [N]
set -euo pipefail
dir="${1:?usage: make-test-certs.sh DIR [N]}"
count="${2:-5}"
mkdir -p "$dir"
cd "$dir"
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
  -keyout ca.key -out ca.pem -days 1 -subj /CN=epp-test-ca \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign 2>/dev/null

# issue NAME SAN: NAME.pem and NAME.key signed by the CA.
issue() {
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
    "$2" > "$1.cnf"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout "$1.key" -out "$1.csr" -subj "/CN=$1" 2>/dev/null
  openssl x509 -req -in "$1.csr" -CA ca.pem -CAkey ca.key -CAcreateserial \
    -out "$1.pem" -days 1 -extfile "$1.cnf" 2>/dev/null
  rm -f "$1.csr" "$1.cnf"
}

issue node "IP:127.0.0.1,DNS:localhost"
for id in $(seq 1 "$count"); do
  issue "node-$id" "DNS:epp-node-$id,DNS:localhost,IP:127.0.0.1"
done
