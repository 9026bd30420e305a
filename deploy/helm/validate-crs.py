#!/usr/bin/env python3
"""Validates the custom resources in rendered manifests against the CRDs' openAPIV3Schema.

usage: validate-crs.py CRDS.yaml MANIFESTS.yaml [--known KIND ...]

Built-in kinds are kubernetes-validate's job. A custom resource of a kind the CRDs define is
checked against that version's schema (jsonschema, as the API server's structural schema would
type-check it); a custom resource of another kind fails unless named with --known (a kind whose
CRD is not ours, e.g. the Prometheus Operator's ServiceMonitor). Exit 1 on any failure.
"""
import sys

import jsonschema
import yaml

BUILTIN_GROUPS = {"v1", "apps/v1", "policy/v1", "rbac.authorization.k8s.io/v1"}


def main(argv):
    crds_path, manifests_path, *rest = argv
    known = set(rest[1:]) if rest[:1] == ["--known"] else set()
    schemas = {}
    for crd in yaml.safe_load_all(open(crds_path)):
        if not crd:
            continue
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schemas[(f"{group}/{version['name']}", kind)] = version["schema"]["openAPIV3Schema"]
    failed = 0
    for doc in yaml.safe_load_all(open(manifests_path)):
        if not doc or doc.get("apiVersion") in BUILTIN_GROUPS:
            continue
        key = (doc.get("apiVersion"), doc.get("kind"))
        name = f"{key[1]} {doc.get('metadata', {}).get('name')}"
        if key in schemas:
            errors = list(jsonschema.Draft7Validator(schemas[key]).iter_errors(doc))
            for e in errors:
                print(f"ERROR {name}: {'.'.join(map(str, e.path))}: {e.message}")
            failed += bool(errors)
            if not errors:
                print(f"OK {name} against the CRD schema of {key[0]}")
        elif key[1] in known:
            print(f"SKIP {name}: no schema here (named --known)")
        else:
            print(f"ERROR {name}: no CRD defines {key[0]} {key[1]}")
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
