"""Installing: ``ops/check-prereqs.sh`` names what is missing with its Debian package (run with a PATH
that lacks a tool, a Python too old, a CPU without AVX2), and the ggml flags have one home that both
``make venv`` and ``pip install .`` (README) read."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops" / "check-prereqs.sh"
V3 = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi1 bmi2 lm\n"


def bin_dir(tmp_path: Path, *tools: str) -> Path:
    """A new PATH of only ``tools`` (and what the script itself runs)."""
    d = tmp_path / f"bin{len(list(tmp_path.glob('bin*')))}"
    d.mkdir()
    for tool in ("uname", "grep", "cut", *tools):
        found = shutil.which(tool)
        if found is None:
            pytest.fail(f"{tool} is not installed here (the test needs it to build its PATH)")
        (d / tool).symlink_to(found)
    return d


def check(path: Path, tmp_path: Path, *, py: str = sys.executable, cpuinfo: str = V3,
          native: str = "0") -> subprocess.CompletedProcess[str]:
    (tmp_path / "cpuinfo").write_text(cpuinfo)
    env = {"PATH": str(path), "PY": py, "CPUINFO": str(tmp_path / "cpuinfo"), "GGML_NATIVE": native}
    return subprocess.run(["/bin/sh", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=60)


def test_everything_there_passes(tmp_path: Path) -> None:
    r = check(bin_dir(tmp_path, "cc", "c++", "cmake", "ninja"), tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1] == "==> prerequisites ok"
    assert "  ok: x86-64 CPU with AVX2, FMA, F16C, BMI2" in r.stdout.splitlines()


def test_a_path_without_cmake_names_cmake_and_its_package(tmp_path: Path) -> None:
    r = check(bin_dir(tmp_path, "cc", "c++", "ninja"), tmp_path)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert "  missing: cmake (Debian/Ubuntu package: cmake)" in lines
    assert lines[-1] == "==> 1 missing; on Debian/Ubuntu: sudo apt-get install cmake"
    assert "  ok: ninja" in lines and "  ok: cc" in lines


def test_no_compiler_and_no_ninja_is_one_apt_line(tmp_path: Path) -> None:
    r = check(bin_dir(tmp_path, "cmake"), tmp_path)
    assert r.returncode == 1
    assert r.stdout.splitlines()[-1] == "==> 3 missing; on Debian/Ubuntu: sudo apt-get install build-essential ninja-build"


def test_an_old_python_and_a_cpu_without_avx2_are_named(tmp_path: Path) -> None:
    old = tmp_path / "python3.9"
    old.write_text("#!/bin/sh\nfor a; do case \"$a\" in *version_info\\[:2*) echo 3.9; exit 0;; esac; done\nexit 1\n")
    old.chmod(0o755)
    r = check(bin_dir(tmp_path, "cc", "c++", "cmake", "ninja"), tmp_path, py=str(old),
              cpuinfo="flags\t\t: fpu sse2 avx lm\n")
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert f"  missing: Python >= 3.11 ({old} is 3.9; give another with PY=python3.11) (Debian/Ubuntu package: python3)" in lines
    assert any(ln.startswith("  missing: CPU features avx2 fma f16c bmi2 (from ") and "GGML_NATIVE=1" in ln for ln in lines)
    assert lines[-1] == "==> 2 missing; on Debian/Ubuntu: sudo apt-get install python3"
    r = check(bin_dir(tmp_path), tmp_path, cpuinfo="flags\t\t: fpu sse2 lm\n", native="1")
    assert "  ok: GGML_NATIVE=1 builds ggml for this CPU (no x86-64-v3 check)" in r.stdout.splitlines()


def test_the_ggml_flags_have_one_home() -> None:
    """``make venv`` reads ops/ggml-cmake-args (as README's ``pip install .`` does), portable by default;
    test_ggml_kernels checks the loaded library was built so (no llamafile, no OpenMP)."""
    flags = (ROOT / "ops" / "ggml-cmake-args").read_text().split()
    assert {"-DGGML_NATIVE=OFF", "-DGGML_AVX2=ON", "-DGGML_AVX512=OFF", "-DGGML_OPENMP=OFF",
            "-DGGML_LLAMAFILE=OFF", "-DGGML_BLAS=OFF"} <= set(flags)
    # run as a top-level make even under ``make test`` (no inherited MAKEFLAGS, no "Entering directory")
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}
    dry = subprocess.run(["make", "--no-print-directory", "-n", "-B", ".venv/.installed"], capture_output=True,
                         text=True, cwd=ROOT, timeout=60, env=env)
    assert f'CMAKE_ARGS="{" ".join(flags)}"' in dry.stdout, dry.stdout + dry.stderr
    assert dry.stdout.splitlines()[0].endswith("sh ops/check-prereqs.sh")  # checked before anything is built
    native = subprocess.run(["make", "--no-print-directory", "-n", "-B", ".venv/.installed", "GGML_NATIVE=1"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert "-DGGML_NATIVE=ON " in native.stdout and "-DGGML_NATIVE=OFF" not in native.stdout
    readme = (ROOT / "README.md").read_text()
    assert 'CMAKE_ARGS="$(cat ops/ggml-cmake-args)" pip install --no-cache-dir --no-binary ggml-python .' in readme
