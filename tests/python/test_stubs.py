"""The type stub python/meshrt/_core.pyi is generated from the built module
(python/stubgen.py): it must be what the generator writes now, so that the stub, the
signatures and the docstrings cannot drift. One process, no MPI beyond the import."""
import ast
import subprocess
import sys
import types
from pathlib import Path

import meshrt

ROOT = Path(__file__).resolve().parents[2]
STUB = ROOT / "python" / "meshrt" / "_core.pyi"
GENERATOR = ROOT / "python" / "stubgen.py"
FIX = f"PYTHONPATH=build/python python3 {GENERATOR.relative_to(ROOT)} > {STUB.relative_to(ROOT)}"


def _generated():
    return subprocess.run([sys.executable, str(GENERATOR)], check=True, capture_output=True, text=True).stdout


def test_stub_is_the_generators_output():
    assert STUB.is_file(), f"expected the stub at {STUB}, found nothing; write it with: {FIX}"
    want, have = _generated(), STUB.read_text()
    if want != have:
        import difflib

        diff = "".join(list(difflib.unified_diff(have.splitlines(True), want.splitlines(True), str(STUB),
                                                 "generated"))[:60])
        raise AssertionError(f"{STUB} differs from what the built module gives; regenerate it with: {FIX}\n{diff}")


def test_stub_parses_and_is_shipped_typed():
    ast.parse(STUB.read_text(), filename=str(STUB))
    assert (STUB.parent / "py.typed").is_file(), f"expected py.typed next to {STUB}, found nothing"


def test_every_public_name_is_declared():
    """meshrt's public names come from _core (declared by the stub) or its typed .py files."""
    tree = ast.parse(STUB.read_text())
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    runtime = {n for n in dir(meshrt) if not n.startswith("_") and not isinstance(getattr(meshrt, n), types.ModuleType)}
    from_python = {"function",  # meshrt/_functions.py, annotated there
                   "wait", "as_completed", "ALL_COMPLETED", "FIRST_COMPLETED", "FIRST_EXCEPTION"}  # _futures.py
    missing = sorted(runtime - declared - from_python)
    assert not missing, f"{STUB}: expected declarations of meshrt's public names {missing}, found none"
