"""Derive the JSON schema a test checks a custom resource against, from the upstream CRD definition.

kubernetes-validate bundles the schemas of Kubernetes' own API only; the custom resources ``deploy --target
k8s`` renders (prometheus-operator's ServiceMonitor, KEDA's ScaledObject, KServe's InferenceService) are
checked against the ``openAPIV3Schema`` of their published CRD, pruned to the fields our manifests use (the
whole upstream files are tens of kilobytes to megabytes)::

    python -m tools.crd_schema CRD.yaml --version v1 --source "<repo> <path> <tag> <commit>" \
        INSTANCE.yaml [INSTANCE.yaml ...] > tests/unit/assets/crd/<kind>.json

Pruning keeps, at every object on the path of a field the instances set, only the properties they set (with
the upstream types, enums, patterns, bounds and the complete ``required`` list) and adds
``additionalProperties: false`` there: what ``kubectl apply --validate=strict`` does for a structural CRD
schema (an unknown field is an error). A field set by an instance that upstream does not define is reported
and the tool fails. Maps (``additionalProperties`` schemas) and ``x-kubernetes-preserve-unknown-fields``
nodes are kept whole. Descriptions and CEL rules (``x-kubernetes-validations``, which only the API server
evaluates) are dropped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_KEEP = (
    "type",
    "enum",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "uniqueItems",
    "nullable",
    "required",
    "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields",
)


class UnknownField(ValueError):
    """An instance sets a field the upstream schema does not define."""


def _strip(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema without descriptions and CEL rules, recursively."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("description", "x-kubernetes-validations"):
            continue
        if isinstance(value, dict):
            out[key] = {k: _strip(v) for k, v in value.items()} if key == "properties" else _strip(value)
        elif isinstance(value, list) and key in ("anyOf", "oneOf", "allOf"):
            out[key] = [_strip(v) for v in value]
        else:
            out[key] = value
    return out


def prune(schema: dict[str, Any], instances: list[Any], path: str = "") -> dict[str, Any]:
    """``schema`` restricted to what ``instances`` (values at ``path``) use; see the module docstring."""
    node: dict[str, Any] = {k: schema[k] for k in _KEEP if k in schema}
    if "anyOf" in schema:
        node["anyOf"] = [_strip(s) for s in schema["anyOf"]]
    if schema.get("x-kubernetes-preserve-unknown-fields") or "additionalProperties" in schema:
        return _strip(schema)
    if "properties" in schema:
        used = [i for i in instances if isinstance(i, dict)]
        keys = list(dict.fromkeys(k for i in used for k in i))
        unknown = [k for k in keys if k not in schema["properties"]]
        if unknown:
            raise UnknownField(
                f"{path or '<root>'}: {unknown} not in the upstream schema "
                f"(known: {sorted(schema['properties'])})."
            )
        node["properties"] = {
            k: prune(schema["properties"][k], [i[k] for i in used if k in i], f"{path}.{k}") for k in keys
        }
        node["additionalProperties"] = False
    if "items" in schema:
        items = [item for i in instances if isinstance(i, list) for item in i]
        node["items"] = prune(schema["items"], items, f"{path}[]")
    return node


def crd_schema(
    crd: dict[str, Any], version: str, instances: list[dict[str, Any]], source: str
) -> dict[str, Any]:
    """The pruned JSON schema of ``crd``'s ``version`` for ``instances``, with its source named."""
    versions = {v["name"]: v for v in crd["spec"]["versions"]}
    if version not in versions:
        raise ValueError(
            f"--version {version!r} is not served by {crd['metadata']['name']}: {sorted(versions)}."
        )
    group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
    schema = prune(versions[version]["schema"]["openAPIV3Schema"], instances)
    schema["properties"]["apiVersion"] = {"const": f"{group}/{version}"}
    schema["properties"]["kind"] = {"const": kind}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "$comment": f"{kind} {group}/{version}, pruned by tools/crd_schema.py from {source}",
        **schema,
    }


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("crd", type=Path)
    parser.add_argument("instances", type=Path, nargs="+")
    parser.add_argument("--version", required=True)
    parser.add_argument("--source", required=True, help="upstream repository, path, tag and commit")
    args = parser.parse_args(argv)
    crd = next(d for d in yaml.safe_load_all(args.crd.read_text()) if d)
    instances = [yaml.safe_load(p.read_text()) for p in args.instances]
    try:
        schema = crd_schema(crd, args.version, instances, args.source)
    except (UnknownField, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    json.dump(schema, sys.stdout, indent=1, sort_keys=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
