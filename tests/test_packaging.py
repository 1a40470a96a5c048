"""The wheel that ``pip install`` builds: every module of the package, the plugin entry points
and the pinned dependencies of ``pyproject.toml``, nothing else.

A full install of the wheel into a fresh venv and the main job run from outside the checkout
(the models then go to the user cache) is too slow for CI; it was run by hand (docs/guide/cpu-testing.md)."""

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    pytest.importorskip("setuptools")
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy of what the build reads, so that no build/ or egg-info lands in the checkout
    src = out / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "sglang_dspark_plugin", src / "sglang_dspark_plugin",
                    ignore=shutil.ignore_patterns("__pycache__"))
    # no build isolation: the venv's setuptools builds it, no package index needed
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (path,) = out.glob("sglang_dspark_plugin-*.whl")
    with zipfile.ZipFile(path) as z:
        yield {name: z.read(name) for name in z.namelist()}


def _dist_info(wheel, name):
    (key,) = [k for k in wheel if k.endswith(".dist-info/" + name)]
    return wheel[key].decode()


def test_wheel_holds_every_module_of_the_package_and_nothing_else(wheel):
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / "sglang_dspark_plugin").rglob("*.py")}
    shipped = {name for name in wheel if not name.split("/")[0].endswith(".dist-info")}
    assert shipped == source


def test_wheel_declares_the_plugin_entry_points_and_the_pins(wheel):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    entry_points = _dist_info(wheel, "entry_points.txt")
    section = entry_points.split("[sglang.srt.plugins]")[1].split("\n[")[0]
    declared = {line.split("=")[0].strip(): line.split("=")[1].strip() for line in section.splitlines() if "=" in line}
    assert declared == project["entry-points"]["sglang.srt.plugins"]
    assert declared["dspark"] == "sglang_dspark_plugin:register"
    requires = {line.split(":", 1)[1].strip() for line in _dist_info(wheel, "METADATA").splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}  # fmt: skip
    assert requires == set(project["dependencies"])
    assert {"sglang==0.5.23", "torch==2.14.1", "triton==3.8.0"} <= requires
