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
#
# With --issue, signs one more key pair with DIR's CA, laid out as cert-manager's csi-driver
# mounts it in a pod (tls.crt, tls.key, ca.crt in OUT), valid for the given DNS names only:
#   make-test-certs.sh --issue DIR OUT DNS_NAME...
set -euo pipefail
if [ "${1:-}" = "--issue" ]; then
  ca="${2:?usage: make-test-certs.sh --issue DIR OUT DNS_NAME...}"
  out="${3:?usage: make-test-certs.sh --issue DIR OUT DNS_NAME...}"
  shift 3
  [ "$#" -gt 0 ] || { echo "make-test-certs.sh --issue: no DNS name" >&2; exit 2; }
  ca="$(cd "$ca" && pwd)"
  mkdir -p "$out"
  cd "$out"
  sans="$(printf 'DNS:%s,' "$@")"
  printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
    "${sans%,}" > tls.cnf
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
    -keyout tls.key -out tls.csr -subj "/CN=$1" 2>/dev/null
  openssl x509 -req -in tls.csr -CA "$ca/ca.pem" -CAkey "$ca/ca.key" -CAcreateserial \
    -CAserial tls.srl -out tls.crt -days 1 -extfile tls.cnf 2>/dev/null
  cp "$ca/ca.pem" ca.crt
  rm -f tls.csr tls.cnf tls.srl
  exit 0
fi
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
