"""Rebuild the vendored Gateway API schemas from the npm package that ships them.

    python deploy/gateway/crds/extract.py                # runs `npm pack` in a temporary folder
    python deploy/gateway/crds/extract.py PACKAGE.tgz    # or reads a tarball you fetched

`@kubernetes-models/gateway-api@0.5.1` (npm) embeds, in each model's CommonJS module, the
`openAPIV3Schema` of Gateway API v1.0.0's released CRDs as a JSON-compatible object literal
(`const schema = {...};`), converted by `@kubernetes-models/crd-generate` (descriptions and
CEL rules dropped, `nullable: true` on optional fields, `metadata` as a `$ref` to ObjectMeta).
This script checks the tarball's sha256, cuts each literal out, parses it as JSON and writes
it unchanged but for one added `$comment` naming its origin. Nothing else is edited.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "@kubernetes-models/gateway-api"
VERSION = "0.5.1"
SHA256 = "3650c87c49f95ccf5fee93f29a076ea4781e2a346fbe085a1143a4da9323d156"
GATEWAY_API_RELEASE = "v1.0.0"
# (module inside the package, vendored file): the kinds deploy/gateway/ uses.
GROUP_V1 = "package/gateway.networking.k8s.io/v1"
MODULES = {
    f"{GROUP_V1}/Gateway.js": "gateway.networking.k8s.io_v1_gateway.json",
    f"{GROUP_V1}/HTTPRoute.js": "gateway.networking.k8s.io_v1_httproute.json",
}
HERE = Path(__file__).resolve().parent
START = "const schema = "


def fetch() -> bytes:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["npm", "pack", "--silent", f"{PACKAGE}@{VERSION}"], cwd=tmp, check=True)
        (tarball,) = Path(tmp).glob("*.tgz")
        return tarball.read_bytes()


def schema_literal(module: str) -> dict:
    """The object literal assigned to `const schema` in a generated module, as JSON."""
    at = module.index(START) + len(START)
    value, end = json.JSONDecoder().raw_decode(module, at)
    if module[end] != ";":
        raise ValueError(f"unexpected text after the schema literal: {module[end : end + 40]!r}")
    return dict(value)


def main(argv: list[str]) -> int:
    data = Path(argv[1]).read_bytes() if len(argv) > 1 else fetch()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        print(f"sha256 {digest} is not the recorded {SHA256}", file=sys.stderr)
        return 1
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member, out in MODULES.items():
            extracted = tar.extractfile(member)
            assert extracted is not None, member
            schema = schema_literal(extracted.read().decode())
            comment = (
                f"openAPIV3Schema of Gateway API {GATEWAY_API_RELEASE} as shipped in npm "
                f"{PACKAGE}@{VERSION} ({member.removeprefix('package/')}); "
                "written by deploy/gateway/crds/extract.py"
            )
            text = json.dumps({"$comment": comment, **schema}, indent=1) + "\n"
            (HERE / out).write_text(text)
            print(f"wrote {out} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
