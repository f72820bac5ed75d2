"""The system BLAS: a system OpenBLAS by default where there is one, MLX's own with
$MLXFUN_BLAS=bundled, chosen before MLX is imported, with clear errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mlxfun.errors import MlxfunError
from mlxfun.kernels import blas

SNIPPET = """
import os
import mlxfun
from mlxfun.engine import strategy
from mlxfun.kernels import blas
blas.check()
import mlx.core as mx
mx.set_default_device(mx.cpu)
print(blas.LOADED)
print(strategy.default_strategy().dense_from)
print(blas.LOADED is not None and os.path.realpath(blas.LOADED) in blas.loaded_libraries())
"""


def run_with(spec: str) -> subprocess.CompletedProcess:
    env = {**os.environ, blas.ENV: spec}
    return subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True, text=True, timeout=300)


def test_a_missing_library_is_a_clear_error():
    env = {**os.environ, blas.ENV: "/nonexistent/libblas.so"}
    api = subprocess.run([sys.executable, "-c", "import mlxfun\nmlxfun.load()"], env=env, capture_output=True,
                         text=True, timeout=300)
    assert api.returncode != 0  # a Python caller gets the error at load, the first call
    assert "MlxfunError: MLXFUN_BLAS='/nonexistent/libblas.so': no such file" in api.stderr
    for command in (["generate", "-p", "hi"], ["serve"], ["chat"]):  # the command line: one line, no traceback
        cli = subprocess.run([sys.executable, "-m", "mlxfun", *command], env=env, capture_output=True, text=True,
                             timeout=300)
        assert cli.returncode == 2, command
        assert cli.stderr == "mlxfun: error: MLXFUN_BLAS='/nonexistent/libblas.so': no such file (give a BLAS " \
                             "shared library's path, or 'openblas')\n", command


def test_openblas_by_name(monkeypatch):
    found = [p for p in blas.OPENBLAS if os.path.exists(p)]
    out = run_with("openblas")
    if found:  # loaded before MLX: its products go through it, and 4-bit weights run as a dense copy
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [found[0], "1", "True"]
    else:
        assert out.returncode != 0 and "no OpenBLAS was found" in out.stderr
    monkeypatch.setattr(blas, "OPENBLAS", ("/nonexistent/libopenblas.so.0",))
    with pytest.raises(MlxfunError, match="no OpenBLAS was found"):
        blas.resolve("openblas")


def test_too_late_once_mlx_is_imported(monkeypatch, tmp_path):
    import mlx.core  # noqa: F401  (this process imported MLX long ago; made explicit here)

    lib = tmp_path / "libfake.so"
    lib.write_bytes(b"")
    monkeypatch.setenv(blas.ENV, str(lib))
    with pytest.raises(MlxfunError, match="imported before mlxfun"):
        blas.load_from_environment()


def test_unset_loads_a_system_openblas_where_there_is_one(monkeypatch):
    found = [p for p in blas.OPENBLAS if os.path.exists(p)]
    out = subprocess.run([sys.executable, "-c", SNIPPET], env={k: v for k, v in os.environ.items() if k != blas.ENV},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    # This machine's answer: its OpenBLAS (loaded, 4-bit weights as a dense copy), or MLX's own.
    assert out.stdout.split() == ([found[0], "1", "True"] if found else ["None", "None", "False"])


def test_the_default_on_machines_with_and_without_openblas(monkeypatch, tmp_path):
    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS", ("/nonexistent/libopenblas.so.0", str(lib)))
    assert blas.resolve("") == str(lib)  # with one: the first found
    assert blas.resolve("bundled") is None  # the exact mode, one variable away
    monkeypatch.setattr(blas, "OPENBLAS", ("/nonexistent/libopenblas.so.0",))
    assert blas.resolve("") is None  # without: MLX's own, silently
    with pytest.raises(MlxfunError, match="no OpenBLAS was found"):
        blas.resolve("openblas")  # asked for by name: an error that says where it looked


def test_bundled_keeps_mlx_own_blas():
    out = run_with("bundled")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None", "False"]


def test_unset_after_mlx_is_imported_keeps_mlx_own(monkeypatch, tmp_path):
    import mlx.core  # noqa: F401

    lib = tmp_path / "libopenblas.so.0"
    lib.write_bytes(b"")
    monkeypatch.setattr(blas, "OPENBLAS", (str(lib),))
    monkeypatch.delenv(blas.ENV, raising=False)
    assert blas.load_from_environment() is None  # too late, and nobody asked: no error
